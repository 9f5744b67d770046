"""``python -m omni_transformers.measure --first-audio`` as docs/performance/models-and-speech.md runs it, at a
tiny size: one JSON line per level with the CPU each process spent per request, and the table; ``--modes``
lays the vocoder's mode over whichever stage carries the pipeline's audio."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def test_first_audio_reports_each_processs_cpu_per_request(tiny_model):
    done = subprocess.run(
        [sys.executable, "-m", "omni_transformers.measure", str(tiny_model), "--pipeline", "qwen2_5_omni",
         "--first-audio", "1,2", "--modes", "fast", "--requests", "2", "--text", "what is the weather like",
         "--max-new-tokens", "4", "--talker-max-new-tokens", "8", "--talker-greedy"],
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["in_flight"] for row in rows] == [1, 2]
    for row in rows:
        # the caller and the pipeline's three processes, each of which did some work for every request
        assert set(row["cpu_ms_per_request"]) == {"caller", "thinker", "speech", "vocoder"}
        assert all(ms > 0 for ms in row["cpu_ms_per_request"].values()), row
        assert row["cores_used"] > 0 and 0 < row["codes_p50"] <= 8
    assert "| qwen2_5_omni | fast | 2 |" in done.stdout and "| CPU per request | cores |" in done.stdout


@pytest.mark.parametrize(("pipeline", "vocoder"), [("qwen2_5_omni", "token2wav"), ("qwen3_omni", "code2wav"),
                                                   ("csm", "vocoder")])
def test_modes_set_the_mode_of_the_stage_that_carries_the_audio(pipeline, vocoder):
    from omni_core import load_config
    from omni_core.plugins import load_plugins

    from omni_transformers.measure import MODES, with_stage_args

    cfg = load_config(pipeline, registry=load_plugins().registry)
    for mode in ("exact", "fast"):
        stages = {s.name: s for s in with_stage_args(cfg, MODES[mode]).stages}
        assert stages[vocoder].args["mode"] == mode

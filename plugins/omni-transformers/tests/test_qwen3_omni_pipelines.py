"""The Qwen3-Omni pipelines: ``qwen3_omni`` (thinker process, speech process), ``qwen3_omni.split`` (a process per
stage) and their GPU-placed variants (tests/test_gpu_variants.py checks they are their base plus placement);
the split pipeline answers what the default one answers, run through ``omni run`` on a tiny checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from omni_core.config import collect_issues, load_config
from omni_core.plugins import load_plugins
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture

from omni_transformers.qwen3_omni import tiny

pytestmark = [pytest.mark.timeout(900)]

STAGES = ["processor", "audio_encoder", "vision_encoder", "thinker", "text", "talker", "code2wav"]


def omni(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMNI_LOAD_PLUGINS": "transformers", "NO_COLOR": "1"}
    env.pop("OMNI_TRANSFORMERS_MODEL", None)
    return subprocess.run([sys.executable, "-c", "from omni_core.cli import main; main()", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.parametrize("name, processes", [("qwen3_omni", 2), ("qwen3_omni.split", 7), ("qwen3_omni.gpu", 2),
                                             ("qwen3_omni.split.gpu", 7)])
def test_the_pipelines_are_valid(name, processes):
    registry = load_plugins(env={"OMNI_LOAD_PLUGINS": "transformers"}).registry
    cfg = load_config(name, registry=registry)
    assert collect_issues(cfg, registry) == []
    assert [s.name for s in cfg.stages] == STAGES
    assert cfg.terminal_stages_fn == "transformers.qwen3_omni.terminal_stages"
    assert len({s.process or s.name for s in cfg.stages}) == processes


def test_omni_plan_puts_the_thinker_and_the_speech_stages_on_different_gpus():
    done = omni("plan", "qwen3_omni.gpu", "--json", "--gpus", "2")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    gpu = {row["stage"]: row["gpu"] for row in plan["placement"]}
    assert gpu["thinker"] == gpu["processor"] == gpu["text"] == 0
    assert gpu["talker"] == gpu["code2wav"] == 1
    assert not plan["warnings"], plan["warnings"]


@pytest.mark.usefixtures("no_leaks")
def test_the_split_pipeline_answers_what_the_default_one_answers(tmp_path):
    ckpt = tiny.write_tiny_checkpoint(tmp_path / "ckpt")
    exe = shutil.which("omni")
    assert exe, "the omni console script is not installed"
    request = json.dumps({"text": "What is up?", "speaker": "aiden", "max_new_tokens": 12, "temperature": 0,
                          "talker_do_sample": False, "talker_max_new_tokens": 40})
    results = {}
    for name in ("qwen3_omni", "qwen3_omni.split"):
        env = {k: v for k, v in os.environ.items() if k != "OMNI_TRANSFORMERS_MODEL"}
        done = subprocess.run([exe, "run", name, "--model", str(ckpt), "--input", request, "--tensor-data"],
                              env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    one, split = results["qwen3_omni"], results["qwen3_omni.split"]
    assert split["text"] == one["text"] and split["token_ids"] == one["token_ids"]
    assert split["codes"] == one["codes"] and len(one["codes"]) > 0
    assert split["audio"] == one["audio"]  # the same frames, decoded the same way, alone

"""`omni plan`: text, JSON, mermaid and dot output for simulated GPUs, errors and exit codes, and
planning without importing any stage code."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from omni_core.cli import app
from omni_core.plan.placement import Device

GIB = 1 << 30

SPEECH = """\
name: speech
placement:
  strategy: {strategy}
  memory_per_gpu: 85899345920   # 80 GiB
stages:
  - name: audio_encoder
    factory: acme_models:AudioEncoder
    memory: 0.2
    next: thinker
  - name: thinker
    factory: acme_models:Thinker
    tp_size: 2
    memory: 0.6
    next: talker
    stream_to: talker
  - name: talker
    factory: acme_models:Talker
    memory: 20000000000
    process: speech
    next: vocoder
  - name: vocoder
    factory: acme_models:Vocoder
    process: speech
    terminal: true
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A directory with the stage module the configs name; importing it fails, so a command that
    imports stage code cannot pass. The operator environment has no CUDA_VISIBLE_DEVICES and
    the machine 8 cores, so output does not depend on where the tests run."""
    (tmp_path / "acme_models.py").write_text("raise RuntimeError('stage code was imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    yield tmp_path
    sys.modules.pop("acme_models", None)


def write(workdir, strategy="pack", text=SPEECH, name="speech.yaml") -> str:
    (workdir / name).write_text(text.format(strategy=strategy))
    return name


def omni(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, list(args), env=env)


# -- text ------------------------------------------------------------------------------------------


def test_text_report_with_two_gpus_shows_every_section(workdir):
    result = omni("plan", write(workdir, "pack"), "--gpus", "2")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == textwrap.dedent("""\
        pipeline 'speech': strategy pack, 2 GPUs (simulated, 80.0 GiB each)

        placement
          stage          replica  rank  gpu  memory  process
          audio_encoder  0        0     0    20%     audio_encoder
          thinker        0        0     0    60%     thinker.0
          thinker        0        1     1    60%     thinker.1
          talker         0        0     1    23.3%   speech
          vocoder        0        0     1    10%*    speech
          * no memory set: counted as the default share (10%)

        gpus
          gpu    used   stages
          GPU 0  80%    audio_encoder 20%, thinker rank 0 60%
          GPU 1  93.3%  thinker rank 1 60%, talker 23.3%, vocoder 10%*

        process groups
          group          stages           processes
          audio_encoder  audio_encoder    audio_encoder
          thinker        thinker          thinker.0, thinker.1
          speech         talker, vocoder  speech

        processes
          process        gpu  device  CUDA_VISIBLE_DEVICES  threads  leader
          audio_encoder  0    cuda:0  '0'                   2        -
          thinker.0      0    cuda:0  '0'                   2        -
          thinker.1      1    cuda:0  '1'                   2        thinker.0
          speech         1    cuda:0  '1'                   2        -

        edges
          from           to       kind    relay
          audio_encoder  thinker  next    shm
          thinker        talker   next    shm
          thinker        talker   stream  shm
          talker         vocoder  next    object (same process)

        endpoints
          process        address
          (coordinator)  ipc://<runtime_dir>/coordinator
          audio_encoder  ipc://<runtime_dir>/p0
          thinker.0      ipc://<runtime_dir>/p1
          thinker.1      ipc://<runtime_dir>/p2
          speech         ipc://<runtime_dir>/p3

        warnings
          - GPU 0 is shared by tensor-parallel thinker rank 0 and audio_encoder; TP ranks run in lockstep, so the slowest GPU sets the pace
          - GPU 1 is shared by tensor-parallel thinker rank 1 and talker, vocoder; TP ranks run in lockstep, so the slowest GPU sets the pace
        """)


def test_text_report_with_eight_gpus_spreads_and_has_no_warnings(workdir):
    result = omni("plan", write(workdir, "spread"), "--gpus", "8")
    assert result.exit_code == 0, result.stderr
    assert "strategy spread, 8 GPUs (simulated, 80.0 GiB each)" in result.stdout
    assert "  GPU 7  0%     (idle)" in result.stdout
    assert "  thinker.1      2    cuda:0  '2'" in result.stdout
    assert result.stdout.endswith("warnings\n  (none)\n")


def test_without_gpus_everything_runs_on_the_cpu(workdir):
    result = omni("plan", write(workdir, "pack"), "--gpus", "0")
    assert result.exit_code == 0, result.stderr
    assert "strategy pack, no GPU (every stage on the CPU)" in result.stdout
    assert "\ngpus\n" not in result.stdout
    assert "  thinker.1      -    cpu     ''" in result.stdout


def test_operator_cuda_visible_devices_shows_in_the_processes(workdir):
    result = omni("plan", write(workdir, "pack"), "--gpus", "2", env={"CUDA_VISIBLE_DEVICES": "6,7"})
    assert result.exit_code == 0, result.stderr
    assert "  thinker.0      0    cuda:0  '6'" in result.stdout
    assert "  thinker.1      1    cuda:0  '7'" in result.stdout


def test_gpus_default_to_the_config_then_to_detected_devices(workdir, monkeypatch):
    text = SPEECH.replace("  memory_per_gpu:", "  gpus: 3\n  memory_per_gpu:")
    assert "3 GPUs (simulated" in omni("plan", write(workdir, "spread", text)).stdout
    seen = []

    def detect(memory_override):
        seen.append(memory_override)
        return (Device(0, memory_override), Device(1, memory_override))

    monkeypatch.setattr("omni_core.plan.topology.detect_devices", detect)
    assert "2 GPUs (detected, 80.0 GiB each)" in omni("plan", write(workdir, "spread")).stdout
    assert seen == [80 * GIB]


# -- JSON ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", [["--json"], ["--format", "json"]])
def test_json_with_two_gpus_has_placement_groups_edges_endpoints_and_warnings(workdir, flag):
    result = omni("plan", write(workdir, "pack"), "--gpus", "2", *flag)
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["pipeline"], data["strategy"]) == ("speech", "pack")
    assert data["devices"]["count"] == 2 and data["devices"]["simulated"]
    assert [(r["stage"], r["rank"], r["gpu"], r["process"]) for r in data["placement"]] == [
        ("audio_encoder", 0, 0, "audio_encoder"), ("thinker", 0, 0, "thinker.0"), ("thinker", 1, 1, "thinker.1"),
        ("talker", 0, 1, "speech"), ("vocoder", 0, 1, "speech"),
    ]
    assert data["placement"][4]["memory_declared"] is False
    assert data["process_groups"][2] == {"name": "speech", "stages": ["talker", "vocoder"], "processes": ["speech"]}
    assert {(e["src"], e["dst"], e["kind"]): e["relay"] for e in data["edges"]}[("talker", "vocoder", "next")] == "object"
    assert data["endpoints"] == {
        "coordinator": "ipc://<runtime_dir>/coordinator",
        "processes": {"audio_encoder": "ipc://<runtime_dir>/p0", "thinker.0": "ipc://<runtime_dir>/p1",
                      "thinker.1": "ipc://<runtime_dir>/p2", "speech": "ipc://<runtime_dir>/p3"},
    }
    thinker1 = data["processes"][2]
    assert (thinker1["name"], thinker1["leader"], thinker1["cuda_visible_devices"], thinker1["endpoint"]) == (
        "thinker.1", "thinker.0", "1", "ipc://<runtime_dir>/p2")
    assert thinker1["forced_env"] == {"CUDA_VISIBLE_DEVICES": "1", "OMNI_GPU_ID": "1"}
    assert len(data["warnings"]) == 2


def test_json_with_eight_gpus_puts_each_process_on_its_own_gpu_under_spread(workdir):
    data = json.loads(omni("plan", write(workdir, "spread"), "--gpus", "8", "--json").stdout)
    assert [p["gpu"] for p in data["processes"]] == [0, 1, 2, 3]
    assert [g["used"] for g in data["devices"]["gpus"]][:4] == [0.2, 0.6, 0.6, pytest.approx(0.332831, abs=1e-6)]
    assert data["warnings"] == []


# -- graphs ----------------------------------------------------------------------------------------


def test_mermaid_with_two_gpus_draws_groups_and_relays(workdir):
    result = omni("plan", write(workdir, "pack"), "--gpus", "2", "--format", "mermaid")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == textwrap.dedent("""\
        flowchart LR
          input(["input"])
          output(["output"])
          subgraph g0["audio_encoder · GPU 0"]
            s0["audio_encoder"]
          end
          subgraph g1["thinker · tp 2 · GPUs 0, 1"]
            s1["thinker"]
          end
          subgraph g2["speech · GPU 1"]
            s2["talker"]
            s3["vocoder"]
          end
          input --> s0
          s0 -->|shm| s1
          s1 -->|shm| s2
          s1 -.->|stream: shm| s2
          s2 -->|object| s3
          s3 --> output
        """)


def test_mermaid_with_eight_gpus_labels_each_group_with_its_gpus(workdir):
    out = omni("plan", write(workdir, "spread"), "--gpus", "8", "--format", "mermaid").stdout
    assert 'subgraph g1["thinker · tp 2 · GPUs 1, 2"]' in out
    assert 'subgraph g2["speech · GPU 3"]' in out


def test_dot_with_two_gpus_draws_clusters_and_dashed_streams(workdir):
    result = omni("plan", write(workdir, "pack"), "--gpus", "2", "--format", "dot")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert out.startswith('digraph "speech" {\n  rankdir=LR;\n')
    assert '  subgraph cluster_1 {\n    label="thinker · tp 2 · GPUs 0, 1";\n    s1 [label="thinker"];\n  }' in out
    assert '  s1 -> s2 [label="stream: shm", style=dashed];' in out
    assert '  s2 -> s3 [label="object"];' in out
    assert out.endswith("  s3 -> output;\n}\n")


def test_dot_with_eight_gpus_and_cpu_stages_says_cpu(workdir):
    out = omni("plan", write(workdir, "spread"), "--gpus", "8", "--format", "dot").stdout
    assert 'label="speech · GPU 3";' in out
    assert 'label="speech · CPU";' in omni("plan", "speech.yaml", "--gpus", "0", "--format", "dot").stdout


def test_graph_labels_escape_quotes():
    from omni_core.plan.render import dot_text, mermaid_text

    assert dot_text('a "b" \\c') == '"a \\"b\\" \\\\c"'
    assert mermaid_text('a "b" | c') == "a #quot;b#quot; #124; c"


# -- errors and usage ------------------------------------------------------------------------------


def test_a_placement_that_does_not_fit_exits_1_naming_stage_and_gpu(workdir):
    result = omni("plan", write(workdir, "pack"), "--gpus", "1")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert "invalid pipeline config speech.yaml: 2 errors" in result.stderr
    assert "stages[1].gpu: stage 'thinker' has ranks 0 and 1 both on GPU 0" in result.stderr
    assert "GPU 0 is over its memory budget by 63.3% (50.6 GiB) at stage 'thinker'" in result.stderr


def test_errors_as_json_list_path_message_and_hint(workdir):
    result = omni("plan", write(workdir, "pack"), "--gpus", "1", "--json")
    assert result.exit_code == 1
    errors = json.loads(result.stdout)["errors"]
    assert [e["path"] for e in errors] == ["stages[1].gpu", "stages[1].memory"]
    assert all(e["hint"] for e in errors)


def test_an_invalid_config_is_reported_before_planning(workdir):
    result = omni("plan", write(workdir, "pakc"), "--gpus", "2")
    assert result.exit_code == 1
    assert "unknown placement strategy 'pakc' (did you mean 'pack'?)" in result.stderr


def test_json_and_another_format_contradict(workdir):
    result = omni("plan", write(workdir, "pack"), "--json", "--format", "dot")
    assert result.exit_code == 2
    assert "--json and --format dot contradict each other" in result.stderr


def test_negative_gpus_is_a_usage_error(workdir):
    assert omni("plan", write(workdir, "pack"), "--gpus", "-1").exit_code == 2


def test_planning_imports_no_stage_code(workdir):
    result = omni("plan", write(workdir, "spread"), "--gpus", "2")
    assert result.exit_code == 0, result.stderr
    assert "acme_models" not in sys.modules

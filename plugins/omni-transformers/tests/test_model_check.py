"""The checkpoint path is checked without loading anything: ``omni validate qwen2_5_omni`` fails
clearly without ``OMNI_TRANSFORMERS_MODEL`` (or with a folder that holds no checkpoint), and
``omni run`` fails before starting any process, with the message once and no traceback. Runs the
real ``omni`` console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture

from omni_transformers.kit.checks import check_model

pytestmark = pytest.mark.timeout(300)

MISSING = "stages[0].args.model: no checkpoint: the stage has no model argument and OMNI_TRANSFORMERS_MODEL is not set"


def omni(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    exe = shutil.which("omni")
    assert exe, "the omni console script is not installed"
    base = {k: v for k, v in os.environ.items() if k not in ("OMNI_TRANSFORMERS_MODEL", "OMNI_LOAD_PLUGINS", "OMNI_LOG_LEVEL")}
    return subprocess.run([exe, *args], cwd=cwd, env={**base, "OMNI_LOG_FORMAT": "json", **env},
                          capture_output=True, text=True, timeout=280)


def checked_stages(name: str) -> list[str]:
    """``stages[i]`` of every stage of pipeline ``name`` that loads a part of the checkpoint."""
    from omni_core.config import load_config
    from omni_core.plugins import load_plugins

    cfg = load_config(name, registry=load_plugins(env={"OMNI_LOAD_PLUGINS": "transformers"}).registry)
    return [f"stages[{i}]" for i, s in enumerate(cfg.stages) if s.factory.startswith("transformers.qwen2_5_omni.")]


def test_validate_names_the_missing_checkpoint_once_and_passes_a_checkpoint_folder(tmp_path):
    result = omni("validate", "qwen2_5_omni", cwd=tmp_path)
    assert result.returncode == 1
    (line,) = [line for line in result.stderr.splitlines() if "args.model" in line]
    first, *others = checked_stages("qwen2_5_omni")
    assert first == "stages[0]" and len(others) >= 3
    assert MISSING in line and f"(also {', '.join(others)})" in line
    assert "set OMNI_TRANSFORMERS_MODEL=DIR or args.model" in line and "Traceback" not in result.stderr
    folder = tmp_path / "ckpt"
    folder.mkdir()
    bad = omni("validate", "qwen2_5_omni.split", cwd=tmp_path, OMNI_TRANSFORMERS_MODEL=str(folder))
    assert bad.returncode == 1
    assert f"OMNI_TRANSFORMERS_MODEL={str(folder)!r} is not a checkpoint folder (no config.json in it)" in bad.stderr
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni"}))
    good = omni("validate", "qwen2_5_omni", cwd=tmp_path, OMNI_TRANSFORMERS_MODEL=str(folder))
    assert good.returncode == 0, good.stderr
    assert "valid pipeline 'qwen2_5_omni'" in good.stdout


@pytest.mark.usefixtures("no_leaks")
def test_run_without_a_checkpoint_fails_before_any_process_once_without_a_traceback(tmp_path):
    result = omni("run", "qwen2_5_omni", "--input", '{"text": "hi"}', "--log-level", "info", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.count("no checkpoint") == 1, result.stderr
    assert "Traceback" not in result.stderr
    events = [json.loads(line)["event"] for line in result.stderr.splitlines() if line.startswith("{")]
    assert "pipeline starting" not in events and "process started" not in events


def test_the_check_reads_args_before_the_environment(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert list(check_model({"model": str(tmp_path)}, env={})) == []
    assert list(check_model({}, env={"OMNI_TRANSFORMERS_MODEL": str(tmp_path)})) == []
    (issue,) = check_model({"model": str(tmp_path / "nope")}, env={"OMNI_TRANSFORMERS_MODEL": str(tmp_path)})
    assert issue.path == "model" and issue.message == f"model={str(tmp_path / 'nope')!r}: no such folder"
    (issue,) = check_model({"model": 3}, env={})
    assert issue.message == "model must be a folder path, got 3"

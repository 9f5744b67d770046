"""``omni run demo`` through the installed CLI, in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
import wave

import pytest
from conftest import processes_with_env, runtime_dirs, shm_segments

from omni_core.testing.waiting import holds_within

pytestmark = pytest.mark.timeout(120)


def omni_command() -> list[str]:
    """The ``omni`` console script of this environment (or the same entry point via python)."""
    script = shutil.which("omni", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-c", "from omni_core.cli import main; main()"]


def run_omni(args: list[str], cwd) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``omni ARGS`` in ``cwd``; then check that its whole process tree is gone (found by a
    marker in the environment, orphans included), with its runtime dirs and shm segments."""
    marker = f"CONTRIB_TEST_MARKER={uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    env[marker.split("=")[0]] = marker.split("=")[1]
    proc = subprocess.Popen(omni_command() + args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    holds_within(lambda: not processes_with_env(marker), 30, 0.1)
    assert not processes_with_env(marker), f"processes of `omni {' '.join(args[:2])}` left running"
    assert not runtime_dirs(proc.pid), f"runtime dirs left: {runtime_dirs(proc.pid)}"
    assert not shm_segments(proc.pid), f"/dev/shm segments left: {shm_segments(proc.pid)}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), proc.pid


def test_omni_run_demo_streams_tokens_then_the_result_and_writes_the_wav(tmp_path):
    done, _ = run_omni(["run", "demo", "--input", '{"text": "hello omni", "max_tokens": 5, "wav_path": "hello.wav"}',
                        "--stream"], tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    *chunks, last = lines
    assert [c["stage"] for c in chunks] == ["thinker"] * 5
    assert [c["chunk"]["index"] for c in chunks] == [0, 1, 2, 3, 4]
    result = last["result"]
    assert " ".join(c["chunk"]["text"] for c in chunks) + "." == result["thinker"]["text"]
    # the file asked for, relative to the directory omni was started in; nothing else is written
    wav_path = tmp_path / "hello.wav"
    assert result["vocoder"]["wav_path"] == str(wav_path)
    assert not (tmp_path / "omni-demo").exists()
    with wave.open(str(wav_path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() == result["vocoder"]["samples"] == (5 * 4 + 1) * 1200
    assert result["vocoder"]["duration"] == pytest.approx(21 * 1200 / 24000)

"""`omni serve --gpus N`, as `omni run --gpus N`: stages placed on N of the machine's GPUs; more
than the machine has is refused before anything starts, naming `omni plan --gpus N`."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from plugin_fixtures import run_omni

from omni_core.testing.serve import ServerProcess

pytestmark = [pytest.mark.timeout(240)]

HERE = Path(__file__).parent
CONFIG = str(HERE / "configs" / "serve" / "small.yaml")


def test_help_documents_gpus():
    result = run_omni("serve", "--help")
    assert result.returncode == 0
    assert "--gpus" in result.stdout and "omni plan CONFIG --gpus N" in " ".join(result.stdout.split())


def test_more_gpus_than_the_machine_has_are_refused_before_anything_starts():
    result = run_omni("serve", CONFIG, "--port", "0", "--gpus", "4096")
    assert result.returncode == 2, result.stderr
    assert "error: --gpus 4096:" in result.stderr
    assert "omni plan CONFIG --gpus 4096" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_gpus_0_serves_on_the_cpu():
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    with ServerProcess(CONFIG, "--gpus", "0", env=env).serving() as server:
        answer = httpx.post(f"{server.url}/v1/pipelines/small/requests", json={"input": {"text": "hi"}}, timeout=60)
        assert answer.status_code == 200, answer.text
    assert server.returncode == 0, server.output()
    server.assert_nothing_left()

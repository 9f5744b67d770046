"""A stage process warns when its event loop is blocked (``limits.loop_block_warning``), with
the loop thread's stack, so a user finds the synchronous call that holds it; building the stages
(loading a model) holds the loop by design and is not warned about. Runs the real ``omni``
console script, whose stage processes log to its stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

OMNI = str(Path(sys.executable).parent / "omni")

pytestmark = pytest.mark.timeout(240)

STAGES = '''
import time


class SlowToBuild:
    def __init__(self, build: float = 0.0):
        time.sleep(build)  # a model load: holds the loop before the stage serves

    def __call__(self, payload, ctx):
        return payload


class HoldsTheLoop:
    async def __call__(self, payload, ctx):  # async: runs on the loop (a plain def runs in a thread)
        hold_the_loop(payload.get("hold", 0.0))
        return payload


def hold_the_loop(seconds):
    time.sleep(seconds)  # the mistake the warning points at: blocking inside a stage call
'''

CONFIG = '''
name: blocky
stages:
  - name: load
    factory: "blockstages:SlowToBuild"
    args: {build: 3.0}
    next: hold
  - name: hold
    factory: "blockstages:HoldsTheLoop"
    terminal: true
placement: {strategy: explicit}
limits: {heartbeat_interval: 0.2, heartbeat_timeout: 30, loop_block_warning: 1.0}
'''


def test_a_blocked_loop_is_warned_with_its_stack_and_building_stages_is_not(tmp_path):
    (tmp_path / "blockstages.py").write_text(textwrap.dedent(STAGES).lstrip())
    (tmp_path / "blocky.yaml").write_text(textwrap.dedent(CONFIG).lstrip())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "PYTEST_", "PYTHONPATH"))}
    done = subprocess.run(
        [OMNI, "--log-level", "info", "run", "blocky.yaml", "--input", '{"text": "x", "hold": 3.0}'],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["text"] == "x"
    warnings = [e for e in (json.loads(line) for line in done.stderr.splitlines() if line.startswith("{"))
                if e.get("event") == "event loop blocked"]
    assert len(warnings) == 1, done.stderr
    assert warnings[0]["blocked_for"] >= 1.0
    assert "hold_the_loop" in warnings[0]["stack"], warnings[0]["stack"]
    assert "SlowToBuild" not in done.stderr and "__init__" not in warnings[0]["stack"]

"""Fixtures of the omni-contrib-stages tests: plugin isolation and leak checks.

Multi-process tests must leave nothing behind: no stage process, no runtime directory
(``omni-run-<pid>-*``), no /dev/shm segment of their runs. Only what this test process (or a
subprocess it started) created is checked, so other test runs on the machine do not interfere.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from omni_core.plugins import reset_plugins
from omni_core.testing.cuda import pytest_configure, pytest_runtest_setup  # noqa: F401 - the cuda marker

HERE = Path(__file__).parent
# The test helper modules: stage processes import them by name (they inherit sys.path).
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


@pytest.fixture(autouse=True)
def _isolated_plugins(monkeypatch):
    """No test sees the OMNI_* settings of the shell that runs pytest, nor a registry an earlier
    test loaded."""
    for key in [k for k in os.environ if k.startswith("OMNI_")]:
        monkeypatch.delenv(key)
    reset_plugins()
    yield
    reset_plugins()


def arun(coro, timeout: float = 60):
    """Run ``coro`` to completion within ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


# -- leak checks: omni-core's, shared with plugin authors ----------------------------------------

from omni_core.testing.leaks import (  # noqa: E402,F401
    assert_nothing_left,
    descendants,
    module_no_leaks,
    no_leaks,
    processes_with_env,
    runtime_dirs,
    shm_segments,
    stage_processes,
)

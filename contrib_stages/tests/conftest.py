"""Fixtures of the omni-contrib-stages tests: plugin isolation and leak checks.

Multi-process tests must leave nothing behind: no stage process, no runtime directory
(``omni-run-<pid>-*``), no /dev/shm segment of their runs. Only what this test process (or a
subprocess it started) created is checked, so other test runs on the machine do not interfere.
"""

from __future__ import annotations

import asyncio
import glob
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

from omni_core.plugins import reset_plugins

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


# -- leak checks -------------------------------------------------------------------------------------


def _service_pids() -> set[int]:
    """multiprocessing's long-lived helpers in this process: the forkserver and the resource
    tracker (they serve every pipeline this process starts)."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    return {getattr(server, "_forkserver_pid", None), getattr(tracker, "_pid", None)} - {None}


def descendants(root: int | None = None) -> set[int]:
    """Pids of every live descendant of ``root`` (default: this process), zombies excluded."""
    root = root or os.getpid()
    parents: dict[int, int] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(stat.split("/")[2])] = int(fields[1])
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                found.add(child)
                todo.append(child)
    return found


def stage_processes() -> set[int]:
    return descendants() - _service_pids()


def runtime_dirs(owner: int | None = None) -> set[str]:
    """Runtime directories of pipelines started by process ``owner`` (default: this one)."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"omni-run-{owner or os.getpid()}-*")))


def shm_segments(owner: int | None = None) -> set[str]:
    """/dev/shm segments of runs started by process ``owner`` (run ids start with its pid)."""
    prefix = f"omni-{owner or os.getpid()}-"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)} if os.path.isdir("/dev/shm") else set()


def processes_with_env(marker: str) -> set[int]:
    """Live processes whose environment holds ``marker`` (how a subprocess's whole process tree
    is found, orphans included)."""
    needle = marker.encode()
    found = set()
    for environ in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(environ, "rb") as f:
                if needle in f.read():
                    pid = int(environ.split("/")[2])
                    with open(f"/proc/{pid}/stat") as s:
                        if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                            found.add(pid)
        except (OSError, IndexError):
            continue
    return found


def assert_nothing_left(before_dirs: set[str], before_shm: set[str], wait: float = 5.0) -> None:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if not stage_processes() and runtime_dirs() <= before_dirs and shm_segments() <= before_shm:
            return
        time.sleep(0.05)
    assert not stage_processes(), f"stage processes left running: {stage_processes()}"
    assert runtime_dirs() <= before_dirs, f"runtime dirs left: {runtime_dirs() - before_dirs}"
    assert shm_segments() <= before_shm, f"/dev/shm segments left: {shm_segments() - before_shm}"


@pytest.fixture
def no_leaks():
    """Fail the test if it leaves stage processes, runtime dirs or shm segments behind."""
    before_dirs, before_shm = runtime_dirs(), shm_segments()
    yield
    assert_nothing_left(before_dirs, before_shm)


@pytest.fixture(scope="module")
def module_no_leaks():
    """``no_leaks`` for module-scoped pipelines: checked once the module's fixtures are gone."""
    before_dirs, before_shm = runtime_dirs(), shm_segments()
    yield
    assert_nothing_left(before_dirs, before_shm)

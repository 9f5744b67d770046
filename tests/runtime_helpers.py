"""Helpers for multi-process runtime tests: run a coroutine with a deadline, and check that a
test leaves no process, runtime directory, socket file or /dev/shm segment behind."""

from __future__ import annotations

import asyncio
import glob
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import tempfile
import time

import pytest

STAGES = "omni_test_stages"


def arun(coro, timeout: float = 60):
    """Run ``coro`` to completion within ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def _service_pids() -> set[int]:
    """multiprocessing's long-lived helpers: the forkserver and the resource tracker."""
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
        if fields[0] == "Z":
            continue
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
    """Descendants that are stage processes (multiprocessing's own helpers are not)."""
    return descendants() - _service_pids()


def runtime_dirs() -> set[str]:
    """Runtime dirs of pipelines this process started (their names carry its pid)."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"omni-run-{os.getpid()}-*")))


def shm_segments() -> set[str]:
    """/dev/shm segments of runs this process started (run ids begin with its pid)."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {name for name in os.listdir("/dev/shm") if name.startswith("omni") and str(os.getpid()) in name}


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


def stage(name: str, factory: str, **fields) -> dict:
    """A stage config entry whose factory lives in the test stages module."""
    return {"name": name, "factory": f"{STAGES}:{factory}", **fields}


def fn(name: str) -> str:
    return f"{STAGES}:{name}"


def pipeline(*stages: dict, **fields) -> dict:
    return {"name": fields.pop("name", "test"), "stages": list(stages), **fields}

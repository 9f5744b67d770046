"""Leak checks for multi-process tests: no stage process, runtime directory or /dev/shm segment
may outlive the test that created it.

Only what this test process (or a given owner pid) created is checked, so other runs on the same
machine do not interfere::

    from omni_core.testing.leaks import no_leaks  # a pytest fixture

    @pytest.mark.usefixtures("no_leaks")
    def test_my_pipeline(): ...
"""

from __future__ import annotations

import glob
import os
import tempfile
import time

import pytest

from .._compat import forkserver_pid, resource_tracker_pid


def service_pids() -> set[int]:
    """multiprocessing's long-lived helpers in this process: the forkserver and the resource
    tracker (they serve every pipeline this process starts, and are not leaks)."""
    return {pid for pid in (forkserver_pid(), resource_tracker_pid()) if pid is not None}


def _stat(pid: int) -> tuple[str, int] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def descendants(root: int | None = None) -> set[int]:
    """Pids of every live descendant of ``root`` (default: this process), zombies excluded."""
    root = root or os.getpid()
    parents: dict[int, int] = {}
    for path in glob.glob("/proc/[0-9]*/stat"):
        pid = int(path.split("/")[2])
        stat = _stat(pid)
        if stat is not None and stat[0] != "Z":
            parents[pid] = stat[1]
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                found.add(child)
                todo.append(child)
    return found


def stage_processes() -> set[int]:
    """Descendants of this process that are not multiprocessing's own helpers."""
    return descendants() - service_pids()


def runtime_dirs(owner: int | None = None) -> set[str]:
    """Runtime directories of pipelines started by process ``owner`` (default: this one)."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"omni-run-{owner or os.getpid()}-*")))


def shm_segments(owner: int | None = None) -> set[str]:
    """/dev/shm segments of runs started by process ``owner`` (run ids start with its pid)."""
    if not os.path.isdir("/dev/shm"):
        return set()
    prefix = f"omni-{owner or os.getpid()}-"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


def processes_with_env(marker: str) -> set[int]:
    """Live processes whose environment holds ``marker`` (finds a subprocess's whole process tree,
    orphans included)."""
    needle = marker.encode()
    found = set()
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(path, "rb") as f:
                if needle not in f.read():
                    continue
        except OSError:
            continue
        pid = int(path.split("/")[2])
        if alive(pid):
            found.add(pid)
    return found


def assert_nothing_left(before_dirs: set[str], before_shm: set[str], wait: float = 5.0) -> None:
    """Wait up to ``wait`` seconds for this process's stage processes, runtime dirs and shm
    segments (beyond those that existed before) to be gone; fail naming what is left."""
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

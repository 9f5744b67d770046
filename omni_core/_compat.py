"""Every use of a CPython internal in omni-core, in one place.

Each internal below is read once, here, and exposed through a small function with a documented
fallback for a Python where it is gone (or a clear error where there can be none). ``MISSING``
names the internals this interpreter lacks; tests/test_compat.py fails on any, so that a new
Python release that drops one is noticed by the test suite, not by a user.

- ``asyncio.tasks._enter_task`` / ``_leave_task``: a stage call's first step runs inline, with a
  stand-in as the current task (runtime/eager.py). Fallback: ``EAGER_START`` is False and every
  call gets its task at once (correct, one loop turn slower).
- the event loop's ``_ready`` queue: the outbox sends at once when no other callback is ready
  (runtime/channel.py). Fallback: ``ready_queue`` returns None and every post waits for the end
  of the loop turn (what it does on uvloop).
- ``multiprocessing.forkserver._forkserver``: whether the forkserver runs, its pid, and stopping
  it to change what it preloads (runtime/launcher.py, testing/leaks.py). Fallback: the server is
  taken as not running, and ``stop_forkserver`` does nothing (a running server keeps its preload;
  the modules then load in each stage process).
- ``multiprocessing.resource_tracker._resource_tracker``: its pid (testing/leaks.py). Fallback:
  no pid, so a test's leak check may count the tracker as a leaked process.
- a patch of ``multiprocessing.spawn.get_preparation_data``: spawned and forkserver children do
  not re-run the parent's ``__main__`` (runtime/launcher.py, bench/baselines.py). Fallback:
  nothing is patched, and a user script needs an ``if __name__ == "__main__"`` guard, as
  multiprocessing asks everywhere.
"""

from __future__ import annotations

import asyncio
import asyncio.tasks
import contextlib
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.spawn
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

_enter_task: Callable[[asyncio.AbstractEventLoop, Any], None] | None = getattr(
    asyncio.tasks, "_enter_task", None)
_leave_task: Callable[[asyncio.AbstractEventLoop, Any], None] | None = getattr(
    asyncio.tasks, "_leave_task", None)

#: True where a coroutine's first step can run inline with a stand-in as the current task.
EAGER_START = _enter_task is not None and _leave_task is not None


def enter_task(loop: asyncio.AbstractEventLoop, task: Any) -> None:
    """Make ``task`` the loop's current task (``asyncio.current_task`` returns it)."""
    if _enter_task is None:
        raise RuntimeError("asyncio.tasks._enter_task is gone from this Python; "
                           "check omni_core._compat.EAGER_START before calling enter_task")
    _enter_task(loop, task)


def leave_task(loop: asyncio.AbstractEventLoop, task: Any) -> None:
    """Undo ``enter_task(loop, task)``."""
    if _leave_task is None:
        raise RuntimeError("asyncio.tasks._leave_task is gone from this Python; "
                           "check omni_core._compat.EAGER_START before calling leave_task")
    _leave_task(loop, task)


def ready_queue(loop: asyncio.AbstractEventLoop) -> deque | None:
    """The loop's queue of ready callbacks (asyncio's own loops), or None where it has none
    that can be read (uvloop, or a Python that renamed it)."""
    ready = getattr(loop, "_ready", None)
    return ready if isinstance(ready, deque) else None


def _forkserver() -> Any:
    return getattr(multiprocessing.forkserver, "_forkserver", None)


def forkserver_pid() -> int | None:
    """The pid of this process's forkserver, None when it does not run (or cannot be told)."""
    return getattr(_forkserver(), "_forkserver_pid", None)


def stop_forkserver() -> bool:
    """Stop this process's forkserver (its children die with it); False where it cannot be."""
    stop = getattr(_forkserver(), "_stop", None)
    if stop is None:
        return False
    stop()
    return True


def resource_tracker_pid() -> int | None:
    """The pid of multiprocessing's resource tracker in this process, None when not running."""
    tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
    return getattr(tracker, "_pid", None)


@contextlib.contextmanager
def without_main_module() -> Iterator[None]:
    """Processes spawned (or forkserver-started) inside this block do not re-run the parent's
    ``__main__`` (multiprocessing's default): a user's script without an ``if __name__ ==
    "__main__"`` guard would start pipelines recursively, and under pytest it costs a lot."""
    original = getattr(multiprocessing.spawn, "get_preparation_data", None)
    if original is None:
        yield
        return

    def prepare(name: str) -> dict:
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    multiprocessing.spawn.get_preparation_data = prepare
    try:
        yield
    finally:
        multiprocessing.spawn.get_preparation_data = original


def missing() -> list[str]:
    """The internals above that this Python lacks (none on every Python omni-core is tested on)."""
    loop = asyncio.new_event_loop()
    try:
        has_ready = ready_queue(loop) is not None
    finally:
        loop.close()
    checks = {
        "asyncio.tasks._enter_task": _enter_task is not None,
        "asyncio.tasks._leave_task": _leave_task is not None,
        "asyncio.BaseEventLoop._ready (a deque)": has_ready,
        "multiprocessing.forkserver._forkserver._forkserver_pid":
            hasattr(_forkserver(), "_forkserver_pid"),
        "multiprocessing.forkserver._forkserver._stop": callable(getattr(_forkserver(), "_stop", None)),
        "multiprocessing.resource_tracker._resource_tracker._pid": hasattr(
            getattr(multiprocessing.resource_tracker, "_resource_tracker", None), "_pid"),
        "multiprocessing.spawn.get_preparation_data":
            callable(getattr(multiprocessing.spawn, "get_preparation_data", None)),
    }
    return [name for name, present in checks.items() if not present]

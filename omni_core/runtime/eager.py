"""A stage call's eager start: :func:`start_call` and the stand-in it runs under.

A stage call runs at once, inside the callback that received its payload, up to its first
suspension (what Python 3.12's eager tasks do); only a call that suspends gets a task, which
resumes it from there. An ``Echo``-like stage so finishes its request, send included, without a
task and a loop turn. The same mechanism serves every Python version (3.10 up): the first step
runs in a fresh copy of the context, as a task's would, and ``asyncio.current_task()`` returns a
stand-in for the task to come, so ``asyncio.timeout()`` and ``TaskGroup`` work from the first
line; what is asked of the stand-in (a cancellation) passes to the task once there is one.
Making the stand-in current uses asyncio internals (omni_core/_compat.py); on a Python without
them, every call gets its task at once.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars
import sys
from collections.abc import Callable
from typing import Any

from .._compat import EAGER_START, enter_task, leave_task
from ..logs import get_logger
from .ordered import Resume

__all__ = ["Starting", "start_call"]

log = get_logger()

_current_task = asyncio.current_task
_TASK_CONTEXT = sys.version_info >= (3, 11)  # create_task(context=...)


class Starting:
    """Stands for a stage call's task while its first step runs, before it has one."""

    __slots__ = ("_loop", "_cancels", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._cancels = 0
        self.task: asyncio.Task | None = None

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def cancel(self, msg: Any = None) -> bool:
        if self.task is not None:
            return self.task.cancel(msg)
        self._cancels += 1  # raised at the call's first suspension, as for a running task
        return True

    def cancelling(self) -> int:
        # Task.cancelling/uncancel are 3.11+, as are their callers (asyncio.timeout, TaskGroup).
        return self.task.cancelling() if self.task is not None else self._cancels  # type: ignore[attr-defined]

    def uncancel(self) -> int:
        if self.task is not None:
            return self.task.uncancel()  # type: ignore[attr-defined]
        if self._cancels:
            self._cancels -= 1
        return self._cancels

    def done(self) -> bool:
        return self.task is not None and self.task.done()

    def cancelled(self) -> bool:
        return self.task is not None and self.task.cancelled()

    def get_name(self) -> str:
        return "omni-stage-call" if self.task is None else self.task.get_name()


def _first_step(coro: collections.abc.Coroutine, stand_in: Starting, loop: asyncio.AbstractEventLoop) -> Any:
    """Run ``coro`` up to its first suspension with ``stand_in`` as the current task."""
    outer = _current_task(loop)
    if outer is not None:
        leave_task(loop, outer)
    enter_task(loop, stand_in)
    try:
        return coro.send(None)
    finally:
        leave_task(loop, stand_in)
        if outer is not None:
            enter_task(loop, outer)


def start_call(coro: collections.abc.Coroutine, stand_in: Starting, ended: Callable[[Any], None], *,
               stage: str) -> asyncio.Task | None:
    """Run ``coro`` (a call of stage ``stage``) up to its first suspension now, with ``stand_in`` as its task.
    Returns the task that resumes it, or None when it finished without suspending. ``ended(t)``
    is called once the call is over, with the task (or ``stand_in`` if it never got one)."""
    loop = stand_in.get_loop()
    context = contextvars.copy_context()
    resume: Any = coro  # without EAGER_START (see omni_core._compat), a task at once
    if EAGER_START:
        try:
            first = context.run(_first_step, coro, stand_in, loop)
        except StopIteration:  # finished without suspending: no task
            ended(stand_in)
            return None
        except BaseException:  # pragma: no cover - a stage call handles every exception itself
            log.exception("stage call failed", stage=stage)
            ended(stand_in)
            return None
        resume = Resume(coro, first)
    task = (loop.create_task(resume, context=context) if _TASK_CONTEXT  # type: ignore[call-arg]  # 3.11+
            else context.run(loop.create_task, resume))
    stand_in.task = task
    if stand_in._cancels:
        task.cancel()
    # A done callback runs even for a task cancelled before its next step (an abort right
    # after the call suspended), whose ``finally`` then runs at that step.
    task.add_done_callback(lambda _: ended(task))
    return task

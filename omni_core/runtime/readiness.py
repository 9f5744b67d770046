"""Whether the processes of a run are ready: :class:`Readiness` (the runner's).

A process of the current generation is *starting* until it says ``Ready`` (ready), says
``StartFailed`` or dies (failed: a :class:`~omni_core.errors.StartupError` saying why).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ..errors import StartupError
from . import wire

__all__ = ["START_FAILURE_GRACE", "Readiness"]

#: Seconds a failed start waits for more failures (several processes failing at once are all
#: reported) and a process that died while starting waits for the StartFailed it may have sent.
START_FAILURE_GRACE = 0.2


def _failure(fut: asyncio.Future) -> StartupError | None:
    """Why a process's readiness failed (its future only ever fails with a StartupError)."""
    exc = None if fut.cancelled() else fut.exception()
    if exc is None or isinstance(exc, StartupError):
        return exc
    return StartupError(f"{type(exc).__name__}: {exc}")


class Readiness:
    """One future per process of the current generation (see the module docstring)."""

    def __init__(self, pipeline: str, log: Any):
        self.pipeline = pipeline
        self.log = log
        self._ready: dict[str, asyncio.Future] = {}

    def expect(self, name: str, loop: asyncio.AbstractEventLoop) -> None:
        """Process ``name`` (a new generation) is starting."""
        self._ready[name] = loop.create_future()

    def starting(self, name: str) -> bool:
        fut = self._ready.get(name)
        return fut is not None and not fut.done()

    def is_ready(self, name: str) -> bool:
        fut = self._ready.get(name)
        return fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None

    def on_ready(self, msg: wire.Ready) -> bool:
        """``Ready`` from a starting process: True when it was (it is ready now)."""
        fut = self._ready.get(msg.process)
        if fut is None or fut.done():
            return False
        self.log.info("process ready", process=msg.process, pid=msg.pid)
        fut.set_result(msg.pid)
        return True

    def on_start_failed(self, msg: wire.StartFailed) -> None:
        fut = self._ready.get(msg.process)
        if fut is not None and not fut.done():
            if msg.stage:
                text = f"{msg.path}: stage {msg.stage!r} failed to start (process {msg.process!r}): {msg.message}"
            else:
                text = f"process {msg.process!r} failed to start: {msg.message}"
            self.log.info("process failed to start", process=msg.process, pid=msg.pid, stage=msg.stage or None,
                          path=msg.path or None, error=msg.message.splitlines()[0] if msg.message else "")
            fut.set_exception(StartupError(text, process=msg.process, traceback=msg.traceback,
                                           stage=msg.stage or None, path=msg.path or None, detail=msg.message))

    def died(self, name: str, error: StartupError, loop: asyncio.AbstractEventLoop) -> None:
        """Starting process ``name`` died: it fails with ``error`` after ``START_FAILURE_GRACE``
        (a process that reported StartFailed exits right after: its report, which may still be
        on its way, says more than the exit)."""
        ready = self._ready[name]

        def fail() -> None:
            if not ready.done():
                ready.set_exception(error)

        loop.call_later(START_FAILURE_GRACE, fail)

    def cancel(self) -> None:
        """A failed start ends: the deaths of the processes still starting are expected now."""
        for fut in self._ready.values():
            if not fut.done():
                fut.cancel()

    async def wait(self, names: list[str], deadline: float, startup_timeout: float) -> None:
        """Wait until every process of ``names`` is ready; at the first that fails (reports
        ``StartFailed`` or dies), raise at once: one ``StartupError`` for it and for any other
        that failed within ``START_FAILURE_GRACE`` of it (their ``failures``)."""
        waiting = {self._ready[n]: n for n in names}
        pending = set(waiting)
        while pending:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                late = ", ".join(sorted(waiting[f] for f in pending))
                raise StartupError(
                    f"pipeline {self.pipeline!r}: process(es) {late} not ready within "
                    f"limits.startup_timeout ({startup_timeout:g} s); raise it if stage "
                    "construction (model loading) is slow"
                )
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if any(_failure(fut) for fut in done):
                if pending:  # siblings failing with the same cause report within moments; a death
                    # counts START_FAILURE_GRACE after it happened (its StartFailed may follow)
                    more, pending = await asyncio.wait(pending, timeout=2 * START_FAILURE_GRACE)
                    done |= more
                raise StartupError.several([exc for fut in waiting if fut in done and (exc := _failure(fut))])

"""What the batching kits share: one worker task on the event loop, woken by an event, calling the
user's function (awaited when it is ``async``, else on a worker thread of its own), and a close
that fails whoever still waits.

:class:`~omni_core.kits.batching.MicroBatcher` and :class:`~omni_core.kits.decode_loop.DecodeLoop`
are :class:`Worker` subclasses: they say what one turn of the worker does (:meth:`Worker._turn`)
and how to fail their callers (:meth:`Worker._fail_all`); binding to the event loop, waking,
sleeping until a deadline, stopping on a bug and closing are written here once, and so is running
one batch and handing its results out (:meth:`Worker._run_batch`, for every batcher).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..runtime.channel import send_together


def is_async(fn: Callable) -> bool:
    """An ``async def`` function or method, a partial of one, or an object with an async
    ``__call__``."""
    if inspect.iscoroutinefunction(fn):
        return True
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)


class Calls:
    """How a kit calls its user function: awaited when it is ``async``, else on one worker thread of
    its own (made at the first call), so the event loop is never blocked. With ``stats``, the
    seconds spent inside the function are added to ``stats.busy_s``."""

    def __init__(self, fn: Callable, thread_name: str, stats: Any = None):
        self.fn = fn
        self.thread_name = thread_name
        self.stats = stats
        self._executor: ThreadPoolExecutor | None = None

    def _timed(self, arg: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(arg)
        finally:
            self.stats.busy_s += time.perf_counter() - t0

    async def __call__(self, arg: Any) -> Any:
        fn = self.fn  # replaceable between calls
        if is_async(fn):
            if self.stats is None:
                return await fn(arg)
            t0 = time.perf_counter()
            try:
                return await fn(arg)
            finally:
                self.stats.busy_s += time.perf_counter() - t0
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=self.thread_name)
        call = fn if self.stats is None else self._timed
        return await asyncio.get_running_loop().run_in_executor(self._executor, call, arg)

    def shutdown(self) -> None:
        """Stop the worker thread (a call running there finishes; none is waited for)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


class Worker:
    """One worker task per kit, bound to the event loop of the first call.

    Subclasses set ``kind`` (how errors name the kit: ``"batcher"``, ``"decode loop"``),
    ``closed_error`` (raised to callers once the kit is closed) and ``broken_error`` (raised to
    callers when the worker itself fails), and implement :meth:`_turn`, :meth:`_fail_all` and,
    when they hold per-loop state, :meth:`_forget`.
    """

    kind = "worker"
    closed_error: type[Exception] = RuntimeError
    broken_error: type[Exception] = RuntimeError

    def __init__(self, fn: Callable, *, name: str | None, thread_name: str, stats: Any = None):
        self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        self._calls = Calls(fn, f"{thread_name}-{self.name}", stats)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    # -- for the subclasses' front doors --------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise self.closed_error(f"{self.kind} {self.name!r} is closed")

    def _bind(self) -> asyncio.AbstractEventLoop:
        """Bind to the running event loop and return it: the first call starts the worker task; a
        call on another loop is refused unless the bound one is closed (``asyncio.run`` returned),
        in which case the kit starts afresh on the new one."""
        loop = asyncio.get_running_loop()
        if self._loop is not None and loop is not self._loop and self._loop.is_closed():
            self._loop = None
            self._forget()
        if self._loop is None:
            self._loop = loop
            self._wake = asyncio.Event()
            self._worker = loop.create_task(self._work(), name=f"{self.kind.replace(' ', '-')}:{self.name}")
        elif loop is not self._loop:
            raise RuntimeError(f"{self.kind} {self.name!r} is bound to another running event loop; create one per loop")
        return loop

    def _poke(self) -> None:
        """Wake the worker: something it waits for may have changed."""
        if self._wake is not None:
            self._wake.set()

    async def close(self) -> None:
        """Stop: callers still waiting fail with ``closed_error``; a call already running in the
        worker thread finishes there, but is not waited for. Idempotent."""
        if self._closed:
            return
        self._closed = True
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await worker
        self._fail_all(self.closed_error(f"{self.kind} {self.name!r} was closed"))
        self._calls.shutdown()

    async def _run_batch(self, batch: Sequence[Any]) -> None:
        """For the batchers: call the function on the batch's ``item``s and settle each one's
        ``future`` with its result (an exception in the results fails that item alone; one the
        function raises fails the whole batch; a cancelled worker fails it with
        ``closed_error``), then :meth:`_handed_out`. Callers that gave up are skipped."""
        try:
            results = list(await self._calls([w.item for w in batch]))
            if len(results) != len(batch):
                raise self.broken_error(
                    f"batch function of {self.kind} {self.name!r} returned {len(results)} results for "
                    f"{len(batch)} items; it must return one result per item, in order"
                )
        except asyncio.CancelledError:
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(self.closed_error(f"{self.kind} {self.name!r} was closed while the batch ran"))
            raise
        except Exception as exc:
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(exc)
            return
        for w, result in zip(batch, results, strict=True):
            if w.future.done():
                continue
            if isinstance(result, BaseException):
                w.future.set_exception(result)
            else:
                w.future.set_result(result)
        self._handed_out()

    def _handed_out(self) -> None:
        """One turn's results were handed to their callers' tasks: what those tasks send next
        (chunks, results) leaves as one message per destination process
        (:func:`omni_core.runtime.channel.send_together`), not one per row."""
        send_together()

    # -- the worker task ------------------------------------------------------------------------

    async def _work(self) -> None:
        try:
            while True:
                if not await self._turn():
                    await self._sleep()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug here must never leave callers waiting forever
            self._closed = True
            self._fail_all(self.broken_error(f"{self.kind} {self.name!r} stopped: {type(exc).__name__}: {exc}"))
            raise

    async def _sleep(self, until: float | None = None) -> None:
        """Wait until :meth:`_poke` (or the loop time ``until``, if given)."""
        assert self._loop is not None and self._wake is not None
        wake = self._wake
        wake.clear()
        timer = None if until is None else self._loop.call_at(until, wake.set)
        try:
            await wake.wait()
        finally:
            if timer is not None:
                timer.cancel()

    # -- what a kit says ------------------------------------------------------------------------

    async def _turn(self) -> bool:
        """One turn of the worker; False: nothing to do until the next :meth:`_poke`."""
        raise NotImplementedError

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every caller still waiting with ``exc``."""
        raise NotImplementedError

    def _forget(self) -> None:
        """The bound event loop ended: drop what belonged to it."""

"""Dynamic micro-batching: collect the concurrent calls of one stage into one batch.

A stage serves many requests at once (one asyncio task each, up to ``max_concurrency``); a model
is fastest when it sees them together. :class:`MicroBatcher` sits between the two: every call
``await``s :meth:`MicroBatcher.submit` with its own item, and the batcher hands the function a
list of items and each caller its own result::

    from omni_core.batching import MicroBatcher

    class Encoder:
        def __init__(self, device: str = "cpu"):
            self.model = build_model().to(device).eval()
            self.batcher = MicroBatcher(self.forward, max_batch_size=16, max_wait=0.005)

        def forward(self, items):                 # a worker thread, one batch at a time
            with torch.inference_mode():
                return list(self.model(torch.stack(items)))

        async def __call__(self, payload, ctx):
            return {"embeds": await self.batcher.submit(payload["features"])}

        async def close(self):                    # the runtime calls it at shutdown
            await self.batcher.close()

Policy. A batch starts when ``max_batch_size`` items are waiting, or ``max_wait`` seconds after
the oldest waiting item arrived, whichever comes first (``max_wait=0``: whatever is waiting when
the batcher gets to run). One batch runs at a time; items that arrive meanwhile make up the next
one, so under load batches fill up without waiting at all.

Contract of ``fn(items) -> results``: ``items`` is a list in arrival order; ``results`` is a
sequence of the same length, ``results[i]`` being the answer for ``items[i]``. ``fn`` may be
``async`` (awaited on the event loop) or plain (run in a worker thread owned by the batcher, so
the event loop is never blocked). An exception instance in ``results`` is raised to that caller
only (one bad item need not fail its neighbours); an exception raised by ``fn`` is raised to every
caller of that batch. Either way the batcher goes on serving.

Cancellation. A caller cancelled (the request was aborted) before its batch started is left out
of it; one cancelled while its batch runs simply never sees the result. Memory is bounded by the
callers: there is one waiting item per caller, and a stage has at most ``max_concurrency``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import attrs

T = TypeVar("T")
R = TypeVar("R")

BatchFn = Callable[[list[T]], "Sequence[R] | Awaitable[Sequence[R]]"]


class BatcherClosed(RuntimeError):
    """The batcher was closed: the item was not (and will not be) processed."""


class BatchError(RuntimeError):
    """The batch function broke its contract (for example, returned the wrong number of results)."""


@attrs.define
class BatchStats:
    """What the batcher did so far: ``batches`` run, ``items`` processed, the ``largest`` batch,
    and how many batches had each size (``sizes[n]``)."""

    batches: int = 0
    items: int = 0
    largest: int = 0
    sizes: dict[int, int] = attrs.Factory(dict)

    def record(self, size: int) -> None:
        self.batches += 1
        self.items += size
        self.largest = max(self.largest, size)
        self.sizes[size] = self.sizes.get(size, 0) + 1

    @property
    def mean(self) -> float:
        """Mean batch size (0.0 before the first batch)."""
        return self.items / self.batches if self.batches else 0.0


class _Waiting:
    __slots__ = ("item", "future", "arrived")

    def __init__(self, item: Any, future: asyncio.Future, arrived: float):
        self.item = item
        self.future = future
        self.arrived = arrived


async def _cancel(worker: asyncio.Task | None) -> None:
    """Cancel a worker task and wait until it ended (whatever it raised)."""
    if worker is not None:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await worker


def _is_async(fn: Callable) -> bool:
    """An ``async def`` function or method, a partial of one, or an object with an async
    ``__call__``."""
    if inspect.iscoroutinefunction(fn):
        return True
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)


class _Calls:
    """How a batcher or a decode loop calls its user function: awaited when it is ``async``, else
    on one worker thread of its own (made at the first call), so the event loop is never blocked.
    With ``stats``, the seconds spent inside the function are added to ``stats.busy_s``."""

    def __init__(self, fn: Callable, thread_name: str, stats: Any = None):
        self.fn = fn
        self.thread_name = thread_name
        self.stats = stats
        self._async = _is_async(fn)
        self._executor: ThreadPoolExecutor | None = None

    def _timed(self, arg: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(arg)
        finally:
            self.stats.busy_s += time.perf_counter() - t0

    async def __call__(self, arg: Any) -> Any:
        if self._async:
            if self.stats is None:
                return await self.fn(arg)
            t0 = time.perf_counter()
            try:
                return await self.fn(arg)
            finally:
                self.stats.busy_s += time.perf_counter() - t0
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=self.thread_name)
        call = self.fn if self.stats is None else self._timed
        return await asyncio.get_running_loop().run_in_executor(self._executor, call, arg)

    def shutdown(self) -> None:
        """Stop the worker thread (a call running there finishes; none is waited for)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


class MicroBatcher(Generic[T, R]):
    """Collects concurrent :meth:`submit` calls into batches for ``fn`` (see the module docstring).

    ``max_batch_size``: the most items in one batch (1 disables batching but keeps one call at a
    time). ``max_wait``: seconds the oldest waiting item may wait for others. ``name`` appears in
    errors. The batcher binds to the event loop of its first ``submit``.
    """

    def __init__(self, fn: BatchFn, *, max_batch_size: int = 8, max_wait: float = 0.002, name: str | None = None):
        if not callable(fn):
            raise TypeError(f"MicroBatcher needs a callable batch function, got {type(fn).__name__}")
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer of at least 1, got {max_batch_size!r}")
        if isinstance(max_wait, bool) or not isinstance(max_wait, (int, float)) or max_wait < 0:
            raise ValueError(f"max_wait must be a number of seconds of at least 0, got {max_wait!r}")
        self.max_batch_size = max_batch_size
        self.max_wait = float(max_wait)
        self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        self.stats = BatchStats()
        self._calls = _Calls(fn, f"batcher-{self.name}")
        self._waiting: deque[_Waiting] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._closed = False

    @property
    def fn(self) -> BatchFn:
        """The batch function (replaceable: the next batch calls the new one)."""
        return self._calls.fn

    @fn.setter
    def fn(self, fn: BatchFn) -> None:
        self._calls.fn = fn

    def __repr__(self) -> str:
        return (f"MicroBatcher({self.name!r}, max_batch_size={self.max_batch_size}, "
                f"max_wait={self.max_wait:g}, waiting={len(self._waiting)})")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def waiting(self) -> int:
        """Items waiting for a batch (cancelled ones excluded)."""
        return sum(1 for w in self._waiting if not w.future.done())

    async def submit(self, item: T) -> R:
        """Queue ``item`` for the next batch and return its result (or raise its error)."""
        if self._closed:
            raise BatcherClosed(f"batcher {self.name!r} is closed")
        loop = asyncio.get_running_loop()
        wake = self._wake
        if wake is None:
            self._loop = loop
            self._wake = wake = asyncio.Event()
            self._worker = loop.create_task(self._work(loop, wake), name=f"batcher:{self.name}")
        elif loop is not self._loop:
            raise RuntimeError(f"batcher {self.name!r} is bound to another event loop; create one per loop")
        future = loop.create_future()
        self._waiting.append(_Waiting(item, future, loop.time()))
        wake.set()
        return await future

    async def close(self) -> None:
        """Stop: items still waiting fail with :class:`BatcherClosed`; a batch already running in a
        worker thread finishes there, but its callers are not waited for. Idempotent."""
        if self._closed:
            return
        self._closed = True
        worker, self._worker = self._worker, None
        await _cancel(worker)
        self._fail_waiting(BatcherClosed(f"batcher {self.name!r} was closed before the item was processed"))
        self._calls.shutdown()

    # -- the worker ------------------------------------------------------------------------------

    async def _work(self, loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> None:
        try:
            while True:
                batch = await self._next_batch(loop, wake)
                await self._run(batch)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug here must never leave callers waiting forever
            self._fail_waiting(BatchError(f"batcher {self.name!r} stopped: {type(exc).__name__}: {exc}"))
            self._closed = True
            raise

    def _prune(self) -> None:
        """Forget items whose caller gave up (cancelled) before their batch started."""
        if any(w.future.done() for w in self._waiting):
            self._waiting = deque(w for w in self._waiting if not w.future.done())

    async def _next_batch(self, loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> list[_Waiting]:
        while True:
            self._prune()
            if not self._waiting:
                wake.clear()
                await wake.wait()
                continue
            if len(self._waiting) >= self.max_batch_size:
                break
            deadline = self._waiting[0].arrived + self.max_wait
            if loop.time() >= deadline:
                break
            wake.clear()
            timer = loop.call_at(deadline, wake.set)
            try:
                await wake.wait()
            finally:
                timer.cancel()
        return [self._waiting.popleft() for _ in range(min(self.max_batch_size, len(self._waiting)))]

    async def _run(self, batch: list[_Waiting]) -> None:
        items = [w.item for w in batch]
        self.stats.record(len(items))
        try:
            results = list(await self._calls(items))
            if len(results) != len(items):
                raise BatchError(
                    f"batch function of batcher {self.name!r} returned {len(results)} results for "
                    f"{len(items)} items; it must return one result per item, in order"
                )
        except asyncio.CancelledError:
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(BatcherClosed(f"batcher {self.name!r} was closed while the batch ran"))
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

    def _fail_waiting(self, exc: BaseException) -> None:
        waiting, self._waiting = self._waiting, deque()
        for w in waiting:
            if not w.future.done():
                w.future.set_exception(exc)

"""Dynamic micro-batching: collect the concurrent calls of one stage into one batch.

A stage serves many requests at once (one asyncio task each, up to ``max_concurrency``); a model
is fastest when it sees them together. :class:`MicroBatcher` sits between the two: every call
``await``s :meth:`MicroBatcher.submit` with its own item, and the batcher hands the function a
list of items and each caller its own result::

    from omni_core.kits import MicroBatcher

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
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import attrs

from .worker import Worker

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


class MicroBatcher(Worker, Generic[T, R]):
    """Collects concurrent :meth:`submit` calls into batches for ``fn`` (see the module docstring).

    ``max_batch_size``: the most items in one batch (1 disables batching but keeps one call at a
    time). ``max_wait``: seconds the oldest waiting item may wait for others. ``name`` appears in
    errors and the worker thread's name. The batcher binds to the event loop of its first
    ``submit`` (and to a new one once that one is closed: ``asyncio.run`` again).
    """

    kind = "batcher"
    closed_error = BatcherClosed
    broken_error = BatchError

    def __init__(self, fn: BatchFn, *, max_batch_size: int = 8, max_wait: float = 0.002, name: str | None = None):
        if not callable(fn):
            raise TypeError(f"MicroBatcher needs a callable batch function, got {type(fn).__name__}")
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer of at least 1, got {max_batch_size!r}")
        if isinstance(max_wait, bool) or not isinstance(max_wait, (int, float)) or max_wait < 0:
            raise ValueError(f"max_wait must be a number of seconds of at least 0, got {max_wait!r}")
        super().__init__(fn, name=name, thread_name="batcher")
        self.max_batch_size = max_batch_size
        self.max_wait = float(max_wait)
        self.stats = BatchStats()
        self._waiting: deque[_Waiting] = deque()

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
    def waiting(self) -> int:
        """Items waiting for a batch (cancelled ones excluded)."""
        return sum(1 for w in self._waiting if not w.future.done())

    async def submit(self, item: T) -> R:
        """Queue ``item`` for the next batch and return its result (or raise its error)."""
        self._check_open()
        loop = self._bind()
        future = loop.create_future()
        self._waiting.append(_Waiting(item, future, loop.time()))
        self._poke()
        return await future

    # -- the worker ------------------------------------------------------------------------------

    def _forget(self) -> None:
        self._waiting.clear()

    async def _turn(self) -> bool:
        if any(w.future.done() for w in self._waiting):  # callers that gave up before their batch
            self._waiting = deque(w for w in self._waiting if not w.future.done())
        if not self._waiting:
            return False
        assert self._loop is not None
        deadline = self._waiting[0].arrived + self.max_wait
        if len(self._waiting) < self.max_batch_size and self._loop.time() < deadline:
            await self._sleep(deadline)  # for more items, or the oldest one's deadline
            return True
        await self._run([self._waiting.popleft() for _ in range(min(self.max_batch_size, len(self._waiting)))])
        return True

    async def _run(self, batch: list[_Waiting]) -> None:
        self.stats.record(len(batch))
        await self._run_batch(batch)

    def _fail_all(self, exc: BaseException) -> None:
        waiting, self._waiting = self._waiting, deque()
        for w in waiting:
            if not w.future.done():
                w.future.set_exception(exc)

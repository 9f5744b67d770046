"""Stream flow control: credits per stream, so a fast producer waits instead of failing.

A stream is the chunks one stage emits to one consumer (another stage, or the caller) for one
request. The producer holds a :class:`Window` of ``limits.stream_buffer`` credits for it; each
chunk sent takes one, and ``ctx.emit`` waits while none is left. The consumer's
:class:`StreamBuffer` gives credits back as its reader consumes chunks (in batches, and whenever
the reader has caught up), through a ``Credit`` message or, inside one process, directly. So a
consumer never holds more than ``stream_buffer`` unread chunks of a stream, and the relay memory
behind them is bounded by the credits. A producer that waits longer than
``limits.stream_stall_timeout`` fails its request with :class:`StreamStalled`, naming both
stages. A consumer that stops reading for good (its call returned) closes the stream: the
producer's later chunks to it are dropped at the source.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from .types import Inbound

Grant = Callable[[int, bool], None]  # (credits, closed)


class StreamClosed(Exception):
    """A stream could not be read (it is not declared, or it was cut off)."""


class StreamStalled(Exception):
    """A stream made no progress for ``limits.stream_stall_timeout``: its reader stopped reading."""


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(False)


class Window:
    """The producer's side of one stream: credits left, and whether the reader closed it."""

    __slots__ = ("credits", "closed", "initial", "_waiters")

    def __init__(self, credits: int):
        self.credits = credits
        self.initial = credits
        self.closed = False
        #: Producers waiting for a credit: one call may emit to one reader from several tasks.
        self._waiters: list[asyncio.Future] = []

    @property
    def waiting(self) -> int:
        """How many emits wait for a credit of this window."""
        return len(self._waiters)

    def grant(self, n: int, closed: bool = False) -> None:
        self.credits += n
        self.closed = self.closed or closed
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(True)

    async def acquire(self, timeout: float, what: Callable[[], str]) -> bool:
        """Take one credit, waiting for one; False when the reader closed the stream.

        It waits on a plain future with a timer rather than ``asyncio.wait_for``, which on
        Python 3.11 and older returns instead of raising when the task is cancelled (an abort)
        just as the credit comes: the call then went on emitting for an ended request."""
        while not self.closed and self.credits <= 0:
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            self._waiters.append(waiter)
            timer = loop.call_later(timeout, _expire, waiter)
            try:
                granted = await waiter
            finally:
                timer.cancel()
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            if not granted:
                raise StreamStalled(
                    f"{what()} made no progress for {timeout:g} s (limits.stream_stall_timeout): the "
                    f"reader holds all {self.initial} unread chunks (limits.stream_buffer) and reads none. "
                    "Read the stream with ctx.stream_from(); a reader whose payload comes from the "
                    "streaming stage itself (next) starts before the stream ends only with "
                    "can_accept_stream_before_payload: true on it (its call then starts on the first chunk)"
                ) from None
        if self.closed:
            return False
        self.credits -= 1
        return True


class Windows:
    """Every stream window of one process, keyed ``(rid, source stage, consumer)``."""

    def __init__(self, credits: int):
        self.initial = credits
        self._windows: dict[int, dict[tuple[str, str], Window]] = {}  # rid -> (src, dst) -> window

    def __len__(self) -> int:
        return sum(len(per) for per in self._windows.values())

    def requests(self) -> set[int]:
        return set(self._windows)

    def get(self, rid: int, src: str, dst: str) -> Window:
        per = self._windows.get(rid)
        if per is None:
            per = self._windows[rid] = {}
        window = per.get((src, dst))
        if window is None:
            window = per[(src, dst)] = Window(self.initial)
        return window

    def grant(self, rid: int, src: str, dst: str, n: int, closed: bool = False) -> None:
        per = self._windows.get(rid)
        window = per.get((src, dst)) if per is not None else None
        if window is not None:
            window.grant(n, closed)

    def drop(self, rid: int, src: str | None = None) -> None:
        """Forget the windows of request ``rid`` (of source ``src`` only, when given)."""
        per = self._windows.get(rid)
        if per is None:
            return
        if src is None:
            del self._windows[rid]
            return
        for key in [k for k in per if k[0] == src]:
            del per[key]
        if not per:
            del self._windows[rid]


class StreamBuffer:
    """The consumer's side of one stream: chunks not yet read, until the end signal.

    ``grant`` gives credits back to the producer (None: the producer is not flow-controlled
    through this buffer, as on a TP follower, which mirrors its leader). A chunk may come with an
    :class:`Inbound` (relay memory it views); that memory is released once the reader has moved
    past the chunk, or when the buffer is dropped."""

    __slots__ = ("chunks", "ended", "event", "limit", "grant", "_owed", "_batch", "_held", "closed")

    def __init__(self, limit: int, grant: Grant | None = None):
        self.chunks: deque[tuple[Any, Inbound | None]] = deque()
        self.ended = False
        self.closed = False
        self.event = asyncio.Event()
        self.limit = limit
        self.grant = grant
        self._owed = 0
        self._batch = max(1, limit // 4)
        self._held: Inbound | None = None

    def __len__(self) -> int:
        return len(self.chunks)

    def put(self, chunk: Any, inbound: Inbound | None = None) -> None:
        if self.closed:
            if inbound is not None:
                inbound.release()
            return
        self.chunks.append((chunk, inbound))
        self.event.set()

    def end(self) -> None:
        self.ended = True
        self.event.set()

    def _consumed(self) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None
        if self.grant is None:
            return
        # Credits go back in batches of a quarter of the window: a producer waits only when its
        # reader is at least three quarters of a window behind, and a reader that keeps up costs
        # one credit message per batch, not one per chunk.
        self._owed += 1
        if self._owed >= self._batch:
            owed, self._owed = self._owed, 0
            self.grant(owed, False)

    def _release_held(self) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None

    async def __aiter__(self) -> AsyncIterator[Any]:
        taken = False
        while True:
            while self.chunks:
                if taken:
                    self._consumed()
                chunk, self._held = self.chunks.popleft()
                taken = True
                yield chunk
            if taken:
                self._consumed()
                taken = False
            if self.ended:
                return
            self._release_held()
            self.event.clear()
            await self.event.wait()

    def storages(self) -> set:
        """Relay storages that chunks not yet released view."""
        out: set = set()
        for inbound in [self._held, *(i for _, i in self.chunks)]:
            if inbound is not None:
                out |= inbound.storages
        return out

    def close(self) -> None:
        """The reader will read no more: free what is buffered and tell the producer."""
        if self.closed:
            return
        self.closed = True
        if self._held is not None:
            self._held.release()
            self._held = None
        while self.chunks:
            _, inbound = self.chunks.popleft()
            if inbound is not None:
                inbound.release()
        if self.grant is not None and not self.ended:
            self.grant(0, True)

"""What a stage sees of one request: :class:`StageContext`."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .stage import StageRuntime


class StreamClosed(Exception):
    """A stream could not be read (its buffer overflowed, or it is not declared)."""


class StreamBuffer:
    """Chunks one source stage streamed to this stage for one request, until its end signal.

    Bounded: more than ``limit`` unread chunks is an error for the request, never unbounded
    memory."""

    __slots__ = ("chunks", "ended", "event", "limit", "overflowed")

    def __init__(self, limit: int):
        self.chunks: deque = deque()
        self.ended = False
        self.overflowed = False
        self.event = asyncio.Event()
        self.limit = limit

    def put(self, chunk: Any) -> bool:
        if len(self.chunks) >= self.limit:
            self.overflowed = True
            self.event.set()
            return False
        self.chunks.append(chunk)
        self.event.set()
        return True

    def end(self) -> None:
        self.ended = True
        self.event.set()

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            while self.chunks:
                yield self.chunks.popleft()
            if self.overflowed:
                raise StreamClosed(f"more than {self.limit} unread chunks (limits.stream_buffer)")
            if self.ended:
                return
            self.event.clear()
            await self.event.wait()


class StageContext:
    """Handed to every stage call with the payload: ``await stage(payload, ctx)``.

    - ``request_id``: the caller's id for this request; ``stage_name``: this stage.
    - ``await ctx.emit(chunk)``: stream a chunk to this stage's ``stream_to`` stages and, when
      this stage is terminal, to the caller (``Pipeline.stream``).
    - ``ctx.stream_from(stage)``: async iterator over the chunks ``stage`` streams to this one,
      ending when that stage signals the end of its stream.
    - ``ctx.aborted``: True once the request was aborted (sync stages running in a worker thread
      should check it in long loops; async stages are cancelled).
    """

    __slots__ = ("request_id", "stage_name", "_rid", "_runtime", "_aborted", "_loop")

    def __init__(self, runtime: StageRuntime, rid: int, request_id: str):
        self.request_id = request_id
        self.stage_name = runtime.name
        self._rid = rid
        self._runtime = runtime
        self._aborted = False
        self._loop = asyncio.get_running_loop()

    @property
    def aborted(self) -> bool:
        return self._aborted

    async def emit(self, chunk: Any) -> None:
        """Stream ``chunk`` on (see the class docstring for where it goes)."""
        await self._runtime.emit(self._rid, self.request_id, chunk)

    def emit_threadsafe(self, chunk: Any, timeout: float | None = None) -> None:
        """``emit`` for sync stages running in a worker thread; blocks until the chunk is sent."""
        asyncio.run_coroutine_threadsafe(self.emit(chunk), self._loop).result(timeout)

    def stream_from(self, stage: str) -> AsyncIterator[Any]:
        """The chunks ``stage`` streams to this stage for this request."""
        return self._runtime.stream_from(self._rid, stage)

    def __repr__(self) -> str:
        return f"StageContext(stage={self.stage_name!r}, request_id={self.request_id!r})"

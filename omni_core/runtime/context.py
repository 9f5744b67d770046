"""What a stage sees of one request: :class:`StageContext`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from .flow import StreamBuffer, StreamClosed, StreamStalled

__all__ = ["StageContext", "StreamBuffer", "StreamClosed", "StreamStalled"]

if TYPE_CHECKING:  # pragma: no cover
    from .stage import StageRuntime


class StageContext:
    """Handed to every stage call with the payload: ``await stage(payload, ctx)``.

    - ``request_id``: the caller's id for this request; ``stage_name``: this stage.
    - ``await ctx.emit(chunk)``: stream a chunk to this stage's ``stream_to`` stages and, when
      this stage is terminal, to the caller (``Pipeline.stream``). It waits while a reader holds
      ``limits.stream_buffer`` unread chunks of this stream (flow control).
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

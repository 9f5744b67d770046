"""What a stage sees of one request: :class:`StageContext`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from .flow import StreamBuffer, StreamClosed, StreamStalled

__all__ = ["PENDING", "CallState", "PayloadPending", "StageContext", "StreamBuffer", "StreamClosed", "StreamStalled"]


class _Runtime(Protocol):
    """What a context uses of its stage's runtime (:class:`~.stage.StageRuntime`)."""

    name: str

    async def emit(self, rid: int, request_id: str, chunk: Any) -> None: ...

    def stream_from(self, rid: int, stage: str) -> AsyncIterator[Any]: ...


class PayloadPending(TypeError):
    """A stage used :data:`PENDING` as if it were its payload."""


class _Pending:
    """The type of :data:`PENDING`. Using it as a payload (indexing, iterating, ``get``) raises
    :class:`PayloadPending`, which says to ``await ctx.payload()`` instead."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "omni_core.PENDING"

    def __reduce__(self) -> str:
        return "PENDING"

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise PayloadPending(
            "the stage's call started on its first stream chunk, before its payload arrived "
            "(can_accept_stream_before_payload: true), so its payload argument is omni_core.PENDING: "
            "get the payload with `payload = await ctx.payload()` (ctx.payload_threadsafe() in a sync stage)"
        )

    __getitem__ = __iter__ = __len__ = __contains__ = get = keys = items = values = _refuse


#: The ``payload`` argument of a call that started on a stream chunk before its payload arrived
#: (``can_accept_stream_before_payload: true``); ``await ctx.payload()`` returns the payload.
PENDING: Any = _Pending()

_ENDED = object()  # a call's payload once the call has ended


class CallState:
    """The runtime's side of one call, which the call's :class:`StageContext` reads: the payload,
    handed over at the start or, for a call that started on a stream chunk, when it comes
    (:meth:`arrive`); whether the request was aborted (:meth:`abort`); the call's end (:meth:`end`),
    which stops anyone still waiting for the payload."""

    __slots__ = ("aborted", "_payload", "_arrival", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, payload: Any = PENDING):
        self.aborted = False
        self._payload = payload
        self._arrival: asyncio.Future | None = None  # while someone waits in payload()
        self._loop = loop

    def arrive(self, payload: Any) -> None:
        """The payload of a call that started without it."""
        if self._payload is _ENDED:  # the call returned meanwhile: nobody will read it
            return
        self._payload = payload
        if self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(payload)

    def abort(self) -> None:
        self.aborted = True

    def end(self) -> None:
        """The call ended: drop the payload and stop anyone still waiting for it."""
        self._payload = _ENDED
        if self._arrival is not None and not self._arrival.done():
            self._arrival.cancel()
        self._arrival = None

    async def payload(self, stage: str) -> Any:
        payload = self._payload
        if payload is not PENDING:
            if payload is _ENDED:
                raise StreamClosed(f"stage {stage!r} asked for its payload after its call ended")
            return payload
        if self._arrival is None:
            self._arrival = self._loop.create_future()
        return await asyncio.shield(self._arrival)


class StageContext:
    """Handed to every stage call with the payload: ``await stage(payload, ctx)``.

    - ``request_id``: the caller's id for this request; ``stage_name``: this stage.
    - ``await ctx.emit(chunk)``: stream a chunk to this stage's ``stream_to`` stages and, when
      this stage is terminal, to the caller (``Pipeline.stream``). It waits while a reader holds
      ``limits.stream_buffer`` unread chunks of this stream (flow control).
    - ``ctx.stream_from(stage)``: async iterator over the chunks ``stage`` streams to this one,
      ending when that stage signals the end of its stream.
    - ``await ctx.payload()``: the call's payload. A stage with
      ``can_accept_stream_before_payload: true`` starts on its first stream chunk when that comes
      before its payload; its ``payload`` argument is then :data:`PENDING` and ``ctx.payload()``
      waits until the payload arrives. Anywhere else it returns the payload at once.
    - ``ctx.aborted``: True once the request was aborted (sync stages running in a worker thread
      should check it in long loops; async stages are cancelled).
    - ``ctx.from_network``: True when the request came over the network (any ``omni serve``
      route), False for ``omni run`` and the Python API (unless the caller passed
      ``from_network=True``). A stage that treats an input as a server file asks
      :func:`omni_core.files.local_path` for it, which applies the rule for such requests.
    """

    __slots__ = ("request_id", "stage_name", "from_network", "_rid", "_runtime", "_loop", "_call")

    def __init__(self, runtime: _Runtime, rid: int, request_id: str, payload: Any = PENDING,
                 loop: asyncio.AbstractEventLoop | None = None, from_network: bool = False,
                 call: CallState | None = None):
        """``call``: the runtime's side of the call (a new one holding ``payload`` if not given)."""
        self.request_id = request_id
        self.from_network = from_network
        self.stage_name = runtime.name
        self._rid = rid
        self._runtime = runtime
        self._loop = loop if loop is not None else asyncio.get_running_loop()
        self._call = call if call is not None else CallState(self._loop, payload)

    @property
    def aborted(self) -> bool:
        return self._call.aborted

    async def emit(self, chunk: Any) -> None:
        """Stream ``chunk`` on (see the class docstring for where it goes)."""
        await self._runtime.emit(self._rid, self.request_id, chunk)

    def emit_threadsafe(self, chunk: Any, timeout: float | None = None) -> None:
        """``emit`` for sync stages running in a worker thread; blocks until the chunk is sent."""
        asyncio.run_coroutine_threadsafe(self.emit(chunk), self._loop).result(timeout)

    async def payload(self) -> Any:
        """The call's payload, waiting for it if the call started before it arrived (see the
        class docstring). An abort of the request cancels the wait like any other."""
        return await self._call.payload(self.stage_name)

    def payload_threadsafe(self, timeout: float | None = None) -> Any:
        """``payload`` for sync stages running in a worker thread; blocks until it arrives."""
        return asyncio.run_coroutine_threadsafe(self.payload(), self._loop).result(timeout)

    def stream_from(self, stage: str) -> AsyncIterator[Any]:
        """The chunks ``stage`` streams to this stage for this request."""
        return self._runtime.stream_from(self._rid, stage)

    def __repr__(self) -> str:
        return f"StageContext(stage={self.stage_name!r}, request_id={self.request_id!r})"

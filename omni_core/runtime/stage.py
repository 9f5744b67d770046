"""One stage inside its host process: runs requests concurrently and applies the stage's wiring.

Per request the stage receives a payload (or, for a fan-in stage, one per source until its
``wait_for`` set is complete), calls the user's stage object, and hands the result to the host's
router. Stream chunks for the request are buffered per source stage, with credits (see
:mod:`.flow`): chunks that arrive before the payload wait for it; chunks that arrive after the
call returned are dropped. A stage with ``can_accept_stream_before_payload`` starts its call on
whichever comes first, its first stream chunk or its payload; a call started on a chunk gets
:data:`~.context.PENDING` as its payload and ``await ctx.payload()`` hands it over when it comes
(``awaiting``). Everything a request holds here (task, fan-in parts, buffered chunks, relay
buffers, a payload wait) is freed when it ends, however it ends.
"""

from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter
from typing import Any

from structlog.contextvars import bind_contextvars, reset_contextvars

from .. import metrics, tracing
from ..config.schema import StageConfig
from ..errors import PluginError
from .context import PENDING, CallState, StageContext
from .eager import Starting, start_call
from .fan_in import FanIn
from .flow import Grant, StreamClosed
from .inflow import Inflow
from .slots import Slots
from .stage_port import StagePort
from .types import Inbound, StageFunctions, WiringError

__all__ = ["Inbound", "StageFunctions", "StagePort", "StageRuntime", "WiringError"]

def _request_id_var() -> Any:
    """structlog's context variable of ``request_id`` (what ``bind_contextvars(request_id=...)``
    sets and every log line reads): setting it directly costs half as much, once per call."""
    tokens = bind_contextvars(request_id=None)
    reset_contextvars(**tokens)
    return tokens["request_id"].var


_REQUEST_ID = _request_id_var()


class StageCancelled(Exception):
    """The stage's own code raised ``asyncio.CancelledError`` (not an abort of the request)."""


class StageRuntime:
    """Serves one stage of one process. Created by the host after the factory ran;
    ``streaming_sources``: the stages that stream to this one."""

    def __init__(self, port: StagePort, cfg: StageConfig, obj: Any, fns: StageFunctions, *, stream_buffer: int,
                 streaming_sources: frozenset[str] = frozenset(), follower: bool = False):
        if not callable(obj):
            raise PluginError(f"stage {cfg.name!r}: the factory returned {type(obj).__name__}, which is not callable")
        self.port = port
        self.cfg = cfg
        self.name = cfg.name
        self.obj = obj
        self.fns = fns
        self.is_async = inspect.iscoroutinefunction(obj) or inspect.iscoroutinefunction(type(obj).__call__)
        self.meter = metrics.stage_meter(cfg.name)
        self.follower = follower
        # Tensor-parallel ranks run one call at a time, in the same order, so collectives match.
        concurrency = 1 if cfg.tp_size > 1 else cfg.max_concurrency
        self.slots = Slots(concurrency)
        self.executor = None if self.is_async else ThreadPoolExecutor(concurrency, thread_name_prefix=f"stage-{cfg.name}")
        self.running: dict[int, asyncio.Task | Starting] = {}  # a stand-in until the call suspends
        self.calls: dict[int, CallState] = {}
        self.inbounds: dict[int, Inbound] = {}  # what each running call received
        self.fan_in = FanIn(cfg, fns)
        self.streams = Inflow(cfg.name, streaming_sources, stream_buffer, follower=follower)
        self.finished: set[int] = set()  # stream targets: requests whose call here has returned
        #: can_accept_stream_before_payload: the call starts on the first chunk if it comes first
        self.starts_on_chunk = cfg.can_accept_stream_before_payload and bool(streaming_sources)
        #: calls started on a chunk whose payload has not come: their call state, None once the
        #: call ended (a payload that comes then is dropped)
        self.awaiting: dict[int, CallState | None] = {}
        self.loop: asyncio.AbstractEventLoop | None = None

    def requests(self) -> set[int]:
        """Every request this stage holds state for."""
        return {*self.running, *self.fan_in, *self.streams, *self.finished, *self.awaiting}

    def state(self) -> dict[str, int]:
        prefix = f"stage.{self.name}."
        return {prefix + "running": len(self.running), prefix + "fan_in": len(self.fan_in),
                prefix + "streams": len(self.streams), prefix + "finished": len(self.finished),
                prefix + "awaiting": len(self.awaiting)}

    # -- arrivals ------------------------------------------------------------------------------

    def on_payload(self, rid: int, request_id: str, src: str, payload: Any, inbound: Inbound) -> None:
        """A payload for request ``rid`` arrived from ``src`` (``""``: the caller)."""
        if not self.cfg.wait_for:
            self._arrived(rid, request_id, src, payload, inbound)
            return
        try:
            done = self.fan_in.add(rid, request_id, src, payload, inbound)
        except BaseException as exc:  # noqa: B902 - user code: fail the request, keep serving
            self.port.fail(rid, self.name, exc)
            return
        if done is not None:
            self._arrived(rid, request_id, src, *done)

    def _arrived(self, rid: int, request_id: str, src: str, payload: Any, inbound: Inbound) -> None:
        """The call's whole payload is here: start the call, or hand the payload to the call that
        started on a stream chunk."""
        if rid in self.awaiting:
            call = self.awaiting.pop(rid)
            if call is None:  # that call ended without it
                inbound.release()
            else:  # released with the rest of what the call received
                self.inbounds[rid].merge(inbound)
                call.arrive(payload)
            return
        if rid in self.running or rid in self.finished:
            inbound.release()
            self.port.fail(rid, self.name, WiringError(f"stage {self.name!r} received a second payload for the request (from {src!r})"))
            return
        self._start(rid, request_id, payload, inbound)

    def on_chunk(self, rid: int, request_id: str, src: str, chunk: Any, inbound: Inbound | None, grant: Grant | None) -> None:
        """A stream chunk from ``src`` arrived for request ``rid``. ``grant`` gives its credit
        back to the producer once read (None on a TP follower: its leader's reads do). The first
        chunk starts the call of a stage that can accept a stream before its payload."""
        if src not in self.streams.sources:
            if inbound is not None:
                inbound.release()
            self.port.fail(rid, self.name, WiringError(f"stage {src!r} streamed to {self.name!r} but it is not in its stream_to"))
            return
        if rid in self.finished:  # the call here already returned: it reads no more
            if inbound is not None:
                inbound.release()
            if grant is not None:
                grant(1, True)
            return
        self.streams.put(rid, src, chunk, inbound, grant)
        if self.starts_on_chunk and rid not in self.running:
            self._start(rid, request_id, PENDING, Inbound())

    def on_stream_end(self, rid: int, src: str) -> None:
        if rid not in self.finished:
            self.streams.buffer(rid, src).end()

    def stream_from(self, rid: int, src: str):
        return self.streams.reader(rid, src)

    # -- running ---------------------------------------------------------------------------------

    def _start(self, rid: int, request_id: str, payload: Any, inbound: Inbound) -> None:
        self.inbounds[rid] = inbound
        loop = self.loop
        if loop is None:
            loop = self.loop = asyncio.get_running_loop()
        call = self.calls[rid] = CallState(loop, payload)
        ctx = StageContext(self, rid, request_id, loop=loop, from_network=rid in self.port.networked, call=call)
        if payload is PENDING:
            self.awaiting[rid] = call
        stand_in = Starting(loop)
        self.running[rid] = stand_in
        task = start_call(self._run(rid, call, ctx, payload, inbound), stand_in,
                          lambda t: self._ended(rid, t, inbound), stage=self.name)
        if task is not None and self.running.get(rid) is stand_in:
            self.running[rid] = task

    def _ended(self, rid: int, task: Any, inbound: Inbound) -> None:
        inbound.release()
        if self.port.is_ended(rid):
            # Cancelled by the request's end: whatever a relay put was handing out when the
            # cancellation came (a credit just granted) is freed now, after the call is gone.
            self.port.release(rid)
        if self.running.get(rid) is task:
            del self.running[rid]
            self.inbounds.pop(rid, None)
            self.calls.pop(rid, None)
            self.streams.close(rid)

    async def _run(self, rid: int, call: CallState, ctx: StageContext, payload: Any, inbound: Inbound) -> None:
        request_id = ctx.request_id
        _REQUEST_ID.set(request_id)  # this call's log lines (bind_contextvars, at half the cost)
        started = None
        slots = self.slots
        meter = self.meter
        try:
            if slots.free > 0 and not slots.waiters:
                slots.free -= 1
            else:
                await slots.acquire()
            try:
                started = perf_counter()
                meter.started()
                traces = self.port.traces
                parent = traces.get(rid) if traces else None
                if parent:
                    with tracing.stage_span(self.name, request_id=request_id, parent=parent):
                        result = await self._call(payload, ctx)
                elif self.is_async:
                    result = await self.obj(payload, ctx)
                else:
                    result = await self._call(payload, ctx)
                meter.ended("ok", perf_counter() - started, request_id)
                started = None
                del payload
                call.end()
                if self.streams.sources:
                    self.finished.add(rid)
                if self.follower:  # only the TP leader's result goes downstream
                    self.streams.close(rid)
                    return
                lent = self._lent(rid, inbound)
                if lent:  # a result viewing received relay memory outlives the call
                    result = self.port.copy_out(result, lent)
                self.streams.close(rid)
                await self.port.finish(self, rid, request_id, result)
            finally:
                slots.release()
        except asyncio.CancelledError:
            if started is not None:
                meter.ended("aborted" if call.aborted else "error", perf_counter() - started, request_id)
            if not call.aborted:  # the stage's own code raised it: a failure, not an abort
                self.port.fail(rid, self.name, StageCancelled(
                    f"stage {self.name!r} raised asyncio.CancelledError without being aborted"))
        except BaseException as exc:  # noqa: B902 - SystemExit, KeyboardInterrupt too: this request only
            if started is not None:
                meter.ended("error", perf_counter() - started, request_id)
            self.port.fail(rid, self.name, exc)
        finally:
            call.end()
            if self.awaiting.get(rid) is call:  # returned without its payload: drop it when it comes
                self.awaiting[rid] = None
            inbound.release()
            self.streams.close(rid)

    async def _call(self, payload: Any, ctx: StageContext) -> Any:
        if self.is_async:
            return await self.obj(payload, ctx)
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self.executor, self.obj, payload, ctx)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def emit(self, rid: int, request_id: str, chunk: Any) -> None:
        if rid not in self.running:
            raise StreamClosed(f"stage {self.name!r} emitted a chunk outside of a running call")
        if not self.follower:  # only the TP leader's chunks go downstream
            lent = self._lent(rid, self.inbounds.get(rid))
            if lent:  # a chunk viewing received relay memory outlives this call where it goes
                chunk = self.port.copy_out(chunk, lent)
            self.meter.chunk()
            await self.port.emit(self, rid, request_id, chunk)

    # -- ending ----------------------------------------------------------------------------------

    def forget(self, rid: int) -> None:
        """Request ``rid`` ended elsewhere (abort, failure, done): cancel and free everything."""
        call = self.calls.get(rid)
        if call is not None:
            call.abort()
        task = self.running.get(rid)
        if task is not None:
            task.cancel()
        self.finished.discard(rid)
        self.awaiting.pop(rid, None)
        self.fan_in.drop(rid)
        self.streams.drop(rid)

    def _lent(self, rid: int, inbound: Inbound | None) -> set:
        """The relay memory request ``rid``'s call received and may still view."""
        lent = inbound.storages if inbound is not None else set()
        return lent | self.streams.storages(rid) if rid in self.streams else lent

    async def close(self) -> None:
        for rid in list(self.running):
            self.forget(rid)
        tasks = [t for t in self.running.values() if isinstance(t, asyncio.Task)]  # stand-ins only last a step
        if tasks:
            await asyncio.wait(tasks, timeout=2)
        self.fan_in.close()
        self.streams.drop_all()
        self.awaiting.clear()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        closer = getattr(self.obj, "close", None)
        if callable(closer):
            result = closer()
            if inspect.isawaitable(result):
                await result

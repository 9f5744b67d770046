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
import collections
import collections.abc
import contextlib
import contextvars
import inspect
import sys
from collections.abc import Awaitable, Callable, Container, Mapping
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter
from typing import Any

import attrs
from structlog.contextvars import bind_contextvars, reset_contextvars

from .. import metrics, tracing
from .._compat import EAGER_START, enter_task, leave_task
from ..config.schema import StageConfig
from ..errors import PluginError
from ..logs import get_logger
from .context import PENDING, StageContext
from .flow import Grant, StreamBuffer, StreamClosed
from .ordered import Resume
from .types import Inbound, StageFunctions, WiringError, chosen_names

__all__ = ["Inbound", "StageFunctions", "StagePort", "StageRuntime", "WiringError"]

log = get_logger()


def _request_id_var() -> Any:
    """structlog's context variable of ``request_id`` (what ``bind_contextvars(request_id=...)``
    sets and every log line reads): setting it directly costs half as much, once per call."""
    tokens = bind_contextvars(request_id=None)
    reset_contextvars(**tokens)
    return tokens["request_id"].var


_REQUEST_ID = _request_id_var()


class StageCancelled(Exception):
    """The stage's own code raised ``asyncio.CancelledError`` (not an abort of the request)."""


@attrs.define
class _FanIn:
    arrived: dict[str, Any] = attrs.Factory(dict)
    needed: list[str] | None = None
    started: bool = False
    inbound: Inbound = attrs.Factory(Inbound)


# -- eager start ---------------------------------------------------------------------------------
#
# A stage call runs at once, inside the callback that received its payload, up to its first
# suspension (what Python 3.12's eager tasks do); only a call that suspends gets a task, which
# resumes it from there. An ``Echo``-like stage so finishes its request, send included, without a
# task and a loop turn. The same mechanism serves every Python version (3.10 up): the first step
# runs in a fresh copy of the context, as a task's would, and ``asyncio.current_task()`` returns a
# stand-in for the task to come, so ``asyncio.timeout()`` and ``TaskGroup`` work from the first
# line; what is asked of the stand-in (a cancellation) passes to the task once there is one.
# Making the stand-in current uses asyncio internals (omni_core/_compat.py); on a Python without
# them, every call gets its task at once.

_current_task = asyncio.current_task
_TASK_CONTEXT = sys.version_info >= (3, 11)  # create_task(context=...)


class _Starting:
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


def _first_step(coro: collections.abc.Coroutine, stand_in: _Starting, loop: asyncio.AbstractEventLoop) -> Any:
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


class _Slots:
    """The stage's concurrency limit: a semaphore whose uncontended acquire is inline in the
    call (``free``, ``waiters``), first come first served."""

    __slots__ = ("free", "waiters")

    def __init__(self, n: int):
        self.free = n
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self) -> None:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await fut  # the slot is handed over by release()
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a slot, then cancelled: pass it on
                self.release()
            else:
                with contextlib.suppress(ValueError):
                    self.waiters.remove(fut)
            raise

    def release(self) -> None:
        waiters = self.waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


def _is_async_callable(obj: Any) -> bool:
    return inspect.iscoroutinefunction(obj) or inspect.iscoroutinefunction(type(obj).__call__)


@attrs.frozen
class StagePort:
    """What a stage uses of its process, handed to it by the host: fail a request (``fail(rid,
    stage, exc)``), whether a request ended (``is_ended``), free a request's relay memory
    (``release``), copy what views relay memory out of a result (``copy_out``), the trace
    context of requests (``traces``, read only), the router's ``finish`` (a call's result
    goes on) and ``emit`` (a stream chunk goes on), and the requests that came over the network
    (``networked``, read only: ``StageContext.from_network``)."""

    fail: Callable[[int, str, BaseException], None]
    is_ended: Callable[[int], bool]
    release: Callable[[int], None]
    copy_out: Callable[[Any, set], Any]
    traces: Mapping[int, str]
    finish: Callable[[StageRuntime, int, str, Any], Awaitable[None]]
    emit: Callable[[StageRuntime, int, str, Any], Awaitable[None]]
    networked: Container[int] = frozenset()


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
        self.is_async = _is_async_callable(obj)
        self.stream_buffer = stream_buffer
        self.meter = metrics.stage_meter(cfg.name)
        self.follower = follower
        # Tensor-parallel ranks run one call at a time, in the same order, so collectives match.
        concurrency = 1 if cfg.tp_size > 1 else cfg.max_concurrency
        self.slots = _Slots(concurrency)
        self.executor = None if self.is_async else ThreadPoolExecutor(concurrency, thread_name_prefix=f"stage-{cfg.name}")
        self.running: dict[int, asyncio.Task | _Starting] = {}  # a stand-in until the call suspends
        self.contexts: dict[int, StageContext] = {}
        self.inbounds: dict[int, Inbound] = {}  # what each running call received
        self.fan_in: dict[int, _FanIn] = {}
        self.streams: dict[int, dict[str, StreamBuffer]] = {}
        self.finished: set[int] = set()  # stream targets: requests whose call here has returned
        self.streaming_sources = streaming_sources
        #: can_accept_stream_before_payload: the call starts on the first chunk if it comes first
        self.starts_on_chunk = cfg.can_accept_stream_before_payload and bool(self.streaming_sources)
        #: calls started on a chunk whose payload has not come: their context, None once the
        #: call ended (a payload that comes then is dropped)
        self.awaiting: dict[int, StageContext | None] = {}
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
        state = self.fan_in.setdefault(rid, _FanIn())
        if state.started:  # a source outside the chosen wait_for subset: not needed any more
            inbound.release()
            return
        state.arrived[src] = payload
        state.inbound.merge(inbound)
        try:
            if self.fns.wait_for is not None and state.needed is None:
                state.needed = self._wait_for_subset(request_id, src, payload)
            needed = state.needed if state.needed is not None else list(self.cfg.wait_for)
            if not all(name in state.arrived for name in needed):
                return
            merge = self.fns.merge
            if merge is None:  # validation requires merge_fn with wait_for
                raise WiringError(f"stage {self.name!r} waits for several stages but has no merge_fn")
            merged = merge({name: state.arrived[name] for name in needed})
        except BaseException as exc:  # noqa: B902 - user code: fail the request, keep serving
            self._drop_fan_in(rid)
            self.port.fail(rid, self.name, exc)
            return
        state.started = True
        state.arrived.clear()
        inbound_all, state.inbound = state.inbound, Inbound()
        self._arrived(rid, request_id, src, merged, inbound_all)

    def _arrived(self, rid: int, request_id: str, src: str, payload: Any, inbound: Inbound) -> None:
        """The call's whole payload is here: start the call, or hand the payload to the call that
        started on a stream chunk."""
        if rid in self.awaiting:
            ctx = self.awaiting.pop(rid)
            if ctx is None:  # that call ended without it
                inbound.release()
            else:  # released with the rest of what the call received
                self.inbounds[rid].merge(inbound)
                ctx._arrive(payload)
            return
        if rid in self.running or rid in self.finished:
            inbound.release()
            self.port.fail(rid, self.name, WiringError(f"stage {self.name!r} received a second payload for the request (from {src!r})"))
            return
        self._start(rid, request_id, payload, inbound)

    def _wait_for_subset(self, request_id: str, src: str, payload: Any) -> list[str] | None:
        wait_for = self.fns.wait_for
        assert wait_for is not None  # asked only of a stage with a wait_for_fn
        answer = wait_for(request_id, src, payload)
        if answer is None:
            return None
        return chosen_names(answer, self.cfg.wait_for, f"wait_for_fn {self.cfg.wait_for_fn!r} of stage {self.name!r}")

    def on_chunk(self, rid: int, request_id: str, src: str, chunk: Any, inbound: Inbound | None, grant: Grant | None) -> None:
        """A stream chunk from ``src`` arrived for request ``rid``. ``grant`` gives its credit
        back to the producer once read (None on a TP follower: its leader's reads do). The first
        chunk starts the call of a stage that can accept a stream before its payload."""
        if src not in self.streaming_sources:
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
        buf = self._buffer(rid, src)
        if buf.grant is None and not self.follower:
            buf.grant = grant
        buf.put(chunk, inbound)
        if self.starts_on_chunk and rid not in self.running:
            self._start(rid, request_id, PENDING, Inbound())

    def on_stream_end(self, rid: int, src: str) -> None:
        if rid not in self.finished:
            self._buffer(rid, src).end()

    def _buffer(self, rid: int, src: str) -> StreamBuffer:
        per_request = self.streams.get(rid)
        if per_request is None:
            per_request = self.streams[rid] = {}
        buf = per_request.get(src)
        if buf is None:
            buf = per_request[src] = StreamBuffer(self.stream_buffer)
        return buf

    def stream_from(self, rid: int, src: str):
        if src not in self.streaming_sources:
            known = ", ".join(sorted(self.streaming_sources)) or "none"
            raise StreamClosed(f"stage {self.name!r} cannot stream_from({src!r}): that stage does not stream to it (sources: {known})")
        return self._buffer(rid, src).__aiter__()

    # -- running ---------------------------------------------------------------------------------

    def _start(self, rid: int, request_id: str, payload: Any, inbound: Inbound) -> None:
        self.inbounds[rid] = inbound
        loop = self.loop
        if loop is None:
            loop = self.loop = asyncio.get_running_loop()
        ctx = self.contexts[rid] = StageContext(self, rid, request_id, payload, loop, rid in self.port.networked)
        if payload is PENDING:
            self.awaiting[rid] = ctx
        stand_in = _Starting(loop)
        self.running[rid] = stand_in
        coro = self._run(rid, ctx, payload, inbound)
        context = contextvars.copy_context()
        resume: Any = coro  # without EAGER_START (see omni_core._compat), a task at once
        if EAGER_START:
            try:
                first = context.run(_first_step, coro, stand_in, loop)
            except StopIteration:  # finished without suspending: no task
                self._ended(rid, stand_in, inbound)
                return
            except BaseException:  # pragma: no cover - _run handles every exception itself
                log.exception("stage call failed", stage=self.name)
                self._ended(rid, stand_in, inbound)
                return
            resume = Resume(coro, first)
        task = (loop.create_task(resume, context=context) if _TASK_CONTEXT  # type: ignore[call-arg]  # 3.11+
                else context.run(loop.create_task, resume))
        stand_in.task = task
        if self.running.get(rid) is stand_in:
            self.running[rid] = task
        if stand_in._cancels:
            task.cancel()
        # A done callback runs even for a task cancelled before its next step (an abort right
        # after the call suspended), whose ``finally`` then runs at that step.
        task.add_done_callback(lambda _: self._ended(rid, task, inbound))

    def _ended(self, rid: int, task: Any, inbound: Inbound) -> None:
        inbound.release()
        if self.port.is_ended(rid):
            # Cancelled by the request's end: whatever a relay put was handing out when the
            # cancellation came (a credit just granted) is freed now, after the call is gone.
            self.port.release(rid)
        if self.running.get(rid) is task:
            del self.running[rid]
            self.inbounds.pop(rid, None)
            self.contexts.pop(rid, None)
            if rid in self.streams:
                self._close_streams(rid)

    async def _run(self, rid: int, ctx: StageContext, payload: Any, inbound: Inbound) -> None:
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
                ctx._end()
                if self.streaming_sources:
                    self.finished.add(rid)
                streams = rid in self.streams
                if not self.follower:
                    storages = inbound.storages | self._stream_storages(rid) if streams else inbound.storages
                    if storages:
                        result = self.port.copy_out(result, storages)
                if streams:
                    self._close_streams(rid)
                if self.follower:  # only the TP leader's result goes downstream
                    return
                await self.port.finish(self, rid, request_id, result)
            finally:
                slots.release()
        except asyncio.CancelledError:
            if started is not None:
                meter.ended("aborted" if ctx._aborted else "error", perf_counter() - started, request_id)
            if not ctx._aborted:  # the stage's own code raised it: a failure, not an abort
                self.port.fail(rid, self.name, StageCancelled(
                    f"stage {self.name!r} raised asyncio.CancelledError without being aborted"))
        except BaseException as exc:  # noqa: B902 - SystemExit, KeyboardInterrupt too: this request only
            if started is not None:
                meter.ended("error", perf_counter() - started, request_id)
            self.port.fail(rid, self.name, exc)
        finally:
            ctx._end()
            if self.awaiting.get(rid) is ctx:  # returned without its payload: drop it when it comes
                self.awaiting[rid] = None
            inbound.release()
            if rid in self.streams:
                self._close_streams(rid)

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
            inbound = self.inbounds.get(rid)
            lent = inbound.storages if inbound is not None else set()
            if rid in self.streams:
                lent = lent | self._stream_storages(rid)
            if lent:  # a chunk viewing received relay memory outlives this call where it goes
                chunk = self.port.copy_out(chunk, lent)
            self.meter.chunk()
            await self.port.emit(self, rid, request_id, chunk)

    # -- ending ----------------------------------------------------------------------------------

    def forget(self, rid: int) -> None:
        """Request ``rid`` ended elsewhere (abort, failure, done): cancel and free everything."""
        ctx = self.contexts.get(rid)
        if ctx is not None:
            ctx._aborted = True
        task = self.running.get(rid)
        if task is not None:
            task.cancel()
        self.finished.discard(rid)
        self.awaiting.pop(rid, None)
        self._drop_fan_in(rid)
        self._drop_streams(rid)

    def _drop_fan_in(self, rid: int) -> None:
        state = self.fan_in.pop(rid, None)
        if state is not None:
            state.inbound.release()

    def _stream_storages(self, rid: int) -> set:
        """Relay memory the request's unreleased stream chunks still view."""
        out: set = set()
        for buf in self.streams.get(rid, {}).values():
            out |= buf.storages()
        return out

    def _close_streams(self, rid: int) -> None:
        """The call ended: its streams read no more (the producers are told)."""
        for buf in self.streams.pop(rid, {}).values():
            buf.close()

    def _drop_streams(self, rid: int) -> None:
        for buf in self.streams.pop(rid, {}).values():
            buf.grant = None  # the request is over everywhere: nobody to tell
            buf.close()

    async def close(self) -> None:
        for rid in list(self.running):
            self.forget(rid)
        tasks = [t for t in self.running.values() if isinstance(t, asyncio.Task)]  # stand-ins only last a step
        if tasks:
            await asyncio.wait(tasks, timeout=2)
        for rid in list(self.fan_in):
            self._drop_fan_in(rid)
        for rid in list(self.streams):
            self._drop_streams(rid)
        self.awaiting.clear()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        closer = getattr(self.obj, "close", None)
        if callable(closer):
            result = closer()
            if inspect.isawaitable(result):
                await result

"""One stage inside its host process: runs requests concurrently and applies the stage's wiring.

Per request the stage receives a payload (or, for a fan-in stage, one per source until its
``wait_for`` set is complete), calls the user's stage object, and hands the result to the host's
router. Stream chunks for the request are buffered per source stage, with credits (see
:mod:`.flow`): chunks that arrive before the payload wait for it; chunks that arrive after the
call returned are dropped. Everything a request holds here (task, fan-in parts, buffered chunks,
relay buffers) is freed when it ends, however it ends.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import attrs
import structlog

from .. import metrics, tracing
from ..config.schema import StageConfig
from ..errors import PluginError
from .context import StageContext
from .flow import Grant, StreamBuffer, StreamClosed
from .types import Inbound, StageFunctions, WiringError

if TYPE_CHECKING:  # pragma: no cover
    from .host import Host

__all__ = ["Inbound", "StageFunctions", "StageRuntime", "WiringError"]


class StageCancelled(Exception):
    """The stage's own code raised ``asyncio.CancelledError`` (not an abort of the request)."""


@attrs.define
class _FanIn:
    arrived: dict[str, Any] = attrs.Factory(dict)
    needed: list[str] | None = None
    started: bool = False
    inbound: Inbound = attrs.Factory(Inbound)


def _is_async_callable(obj: Any) -> bool:
    return inspect.iscoroutinefunction(obj) or inspect.iscoroutinefunction(type(obj).__call__)


class StageRuntime:
    """Serves one stage of one process. Created by the host after the factory ran."""

    def __init__(self, host: Host, cfg: StageConfig, obj: Any, fns: StageFunctions, *, stream_buffer: int, follower: bool = False):
        if not callable(obj):
            raise PluginError(f"stage {cfg.name!r}: the factory returned {type(obj).__name__}, which is not callable")
        self.host = host
        self.cfg = cfg
        self.name = cfg.name
        self.obj = obj
        self.fns = fns
        self.is_async = _is_async_callable(obj)
        self.stream_buffer = stream_buffer
        self.follower = follower
        # Tensor-parallel ranks run one call at a time, in the same order, so collectives match.
        concurrency = 1 if cfg.tp_size > 1 else cfg.max_concurrency
        self.sem = asyncio.Semaphore(concurrency)
        self.executor = None if self.is_async else ThreadPoolExecutor(concurrency, thread_name_prefix=f"stage-{cfg.name}")
        self.running: dict[int, asyncio.Task] = {}
        self.contexts: dict[int, StageContext] = {}
        self.inbounds: dict[int, Inbound] = {}  # what each running call received
        self.fan_in: dict[int, _FanIn] = {}
        self.streams: dict[int, dict[str, StreamBuffer]] = {}
        self.finished: set[int] = set()  # stream targets: requests whose call here has returned
        self.streaming_sources = {s.name for s in host.config.stages if cfg.name in s.stream_to}

    def requests(self) -> set[int]:
        """Every request this stage holds state for."""
        return {*self.running, *self.fan_in, *self.streams, *self.finished}

    def state(self) -> dict[str, int]:
        prefix = f"stage.{self.name}."
        return {prefix + "running": len(self.running), prefix + "fan_in": len(self.fan_in),
                prefix + "streams": len(self.streams), prefix + "finished": len(self.finished)}

    # -- arrivals ------------------------------------------------------------------------------

    def on_payload(self, rid: int, request_id: str, src: str, payload: Any, inbound: Inbound) -> None:
        """A payload for request ``rid`` arrived from ``src`` (``""``: the caller)."""
        if not self.cfg.wait_for:
            if rid in self.running or rid in self.finished:
                inbound.release()
                self.host.fail(rid, self.name, WiringError(f"stage {self.name!r} received a second payload for the request (from {src!r})"))
                return
            self._start(rid, request_id, payload, inbound)
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
            merged = self.fns.merge({name: state.arrived[name] for name in needed})
        except BaseException as exc:  # noqa: B902 - user code: fail the request, keep serving
            self._drop_fan_in(rid)
            self.host.fail(rid, self.name, exc)
            return
        state.started = True
        state.arrived.clear()
        inbound_all, state.inbound = state.inbound, Inbound()
        self._start(rid, request_id, merged, inbound_all)

    def _wait_for_subset(self, request_id: str, src: str, payload: Any) -> list[str] | None:
        answer = self.fns.wait_for(request_id, src, payload)
        if answer is None:
            return None
        names = [answer] if isinstance(answer, str) else list(answer)
        unknown = [n for n in names if n not in self.cfg.wait_for]
        if unknown or not all(isinstance(n, str) for n in names):
            raise WiringError(
                f"wait_for_fn {self.cfg.wait_for_fn!r} of stage {self.name!r} returned {answer!r}; "
                f"it must return a subset of wait_for {list(self.cfg.wait_for)} or None"
            )
        return names

    def on_chunk(self, rid: int, src: str, chunk: Any, inbound: Inbound | None, grant: Grant | None) -> None:
        """A stream chunk from ``src`` arrived for request ``rid``. ``grant`` gives its credit
        back to the producer once read (None on a TP follower: its leader's reads do)."""
        if src not in self.streaming_sources:
            if inbound is not None:
                inbound.release()
            self.host.fail(rid, self.name, WiringError(f"stage {src!r} streamed to {self.name!r} but it is not in its stream_to"))
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
        task = self.running[rid] = asyncio.get_running_loop().create_task(self._run(rid, request_id, payload, inbound))
        # A done callback runs even for a task cancelled before it started (an abort right after
        # the payload arrived), whose body and its ``finally`` never run.
        self.inbounds[rid] = inbound
        task.add_done_callback(lambda _: self._ended(rid, task, inbound))

    def _ended(self, rid: int, task: asyncio.Task, inbound: Inbound) -> None:
        inbound.release()
        if self.host.is_ended(rid):
            # Cancelled by the request's end: whatever a relay put was handing out when the
            # cancellation came (a credit just granted) is freed now, after the call is gone.
            self.host.edges.cleanup(rid)
        if self.running.get(rid) is task:
            del self.running[rid]
            self.inbounds.pop(rid, None)
            self.contexts.pop(rid, None)
            self._close_streams(rid)

    async def _run(self, rid: int, request_id: str, payload: Any, inbound: Inbound) -> None:
        ctx = StageContext(self, rid, request_id)
        self.contexts[rid] = ctx
        structlog.contextvars.bind_contextvars(request_id=request_id)  # this task's log lines
        started = None
        try:
            async with self.sem:
                started = time.perf_counter()
                with tracing.stage_span(self.name, request_id=request_id, parent=self.host.traces.get(rid, "")):
                    result = await self._call(payload, ctx)
                metrics.stage_call(self.name, "ok", time.perf_counter() - started)
                started = None
                del payload
                if self.streaming_sources:
                    self.finished.add(rid)
                storages = inbound.storages | self._stream_storages(rid)
                if storages and not self.follower:
                    result = self.host.edges.copy_out(result, storages)
                self._close_streams(rid)
                if self.follower:  # only the TP leader's result goes downstream
                    return
                await self.host.router.finish(self, rid, request_id, result)
        except asyncio.CancelledError:
            if started is not None:
                metrics.stage_call(self.name, "aborted" if ctx._aborted else "error", time.perf_counter() - started)
            if not ctx._aborted:  # the stage's own code raised it: a failure, not an abort
                self.host.fail(rid, self.name, StageCancelled(
                    f"stage {self.name!r} raised asyncio.CancelledError without being aborted"))
        except BaseException as exc:  # noqa: B902 - SystemExit, KeyboardInterrupt too: this request only
            if started is not None:
                metrics.stage_call(self.name, "error", time.perf_counter() - started)
            self.host.fail(rid, self.name, exc)
        finally:
            inbound.release()
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
            lent = (inbound.storages if inbound is not None else set()) | self._stream_storages(rid)
            if lent:  # a chunk viewing received relay memory outlives this call where it goes
                chunk = self.host.edges.copy_out(chunk, lent)
            metrics.stream_chunk(self.name)
            await self.host.router.emit(self, rid, request_id, chunk)

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
        if self.running:
            await asyncio.wait(list(self.running.values()), timeout=2)
        for rid in list(self.fan_in):
            self._drop_fan_in(rid)
        for rid in list(self.streams):
            self._drop_streams(rid)
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        closer = getattr(self.obj, "close", None)
        if callable(closer):
            result = closer()
            if inspect.isawaitable(result):
                await result

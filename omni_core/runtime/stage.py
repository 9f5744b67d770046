"""One stage inside its host process: runs requests concurrently and applies the stage's wiring.

Per request the stage receives a payload (or, for a fan-in stage, one per source until its
``wait_for`` set is complete), calls the user's stage object, and hands the result to the host,
which routes it. Stream chunks for the request are buffered per source stage. Everything a request
holds here (task, fan-in parts, buffered chunks, relay buffers) is freed when it ends, however it
ends.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import attrs
import structlog

from .. import metrics, tracing
from ..config.schema import StageConfig
from ..errors import PluginError
from .context import StageContext, StreamBuffer, StreamClosed

if TYPE_CHECKING:  # pragma: no cover
    from .host import Host


class WiringError(Exception):
    """A user function broke its contract (returned an unknown stage, a wrong type, ...)."""


@attrs.define
class Inbound:
    """What a request brought into this stage: relay buffers to release when the call is done,
    and the storages of tensors that view relay memory (copied out if the result keeps them)."""

    releases: list[Callable[[], None]] = attrs.Factory(list)
    storages: set[int] = attrs.Factory(set)

    def merge(self, other: Inbound) -> None:
        self.releases += other.releases
        self.storages |= other.storages

    def release(self) -> None:
        releases, self.releases = self.releases, []
        for release in releases:
            release()


@attrs.define
class _FanIn:
    arrived: dict[str, Any] = attrs.Factory(dict)
    needed: list[str] | None = None
    started: bool = False
    inbound: Inbound = attrs.Factory(Inbound)


@attrs.define
class StageFunctions:
    """The stage's resolved wiring functions (None where the config sets none)."""

    route: Callable | None = None
    merge: Callable | None = None
    wait_for: Callable | None = None
    stream_done: Callable | None = None
    project: dict[str, Callable] = attrs.Factory(dict)


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
        self.fan_in: dict[int, _FanIn] = {}
        self.streams: dict[int, dict[str, StreamBuffer]] = {}
        self.stream_inbound: dict[int, Inbound] = {}
        self.streaming_sources = {s.name for s in host.config.stages if cfg.name in s.stream_to}

    # -- arrivals ------------------------------------------------------------------------------

    def on_payload(self, rid: int, request_id: str, src: str, payload: Any, inbound: Inbound) -> None:
        """A payload for request ``rid`` arrived from ``src`` (``""``: the caller)."""
        if not self.cfg.wait_for:
            if rid in self.running:
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
        except Exception as exc:
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

    def on_chunk(self, rid: int, src: str, chunk: Any, inbound: Inbound) -> None:
        """A stream chunk from ``src`` arrived for request ``rid``."""
        if src not in self.streaming_sources:
            inbound.release()
            self.host.fail(rid, self.name, WiringError(f"stage {src!r} streamed to {self.name!r} but it is not in its stream_to"))
            return
        if rid not in self.running and not self.cfg.can_accept_stream_before_payload:
            inbound.release()
            self.host.fail(rid, self.name, WiringError(
                f"stage {self.name!r} received a stream chunk from {src!r} before its payload; set "
                f"'can_accept_stream_before_payload: true' on stage {self.name!r} to buffer such chunks"
            ))
            return
        self.stream_inbound.setdefault(rid, Inbound()).merge(inbound)
        if not self._buffer(rid, src).put(chunk):
            self.host.fail(rid, self.name, StreamClosed(
                f"stage {self.name!r} has more than {self.stream_buffer} unread chunks from {src!r} "
                "(limits.stream_buffer); read them with ctx.stream_from() or raise the limit"
            ))

    def on_stream_end(self, rid: int, src: str) -> None:
        if rid in self.running or self.cfg.can_accept_stream_before_payload:
            self._buffer(rid, src).end()

    def _buffer(self, rid: int, src: str) -> StreamBuffer:
        per_request = self.streams.setdefault(rid, {})
        buf = per_request.get(src)
        if buf is None:
            buf = per_request[src] = StreamBuffer(self.stream_buffer)
        return buf

    def stream_from(self, rid: int, src: str) -> AsyncIterator[Any]:
        if src not in self.streaming_sources:
            known = ", ".join(sorted(self.streaming_sources)) or "none"
            raise StreamClosed(f"stage {self.name!r} cannot stream_from({src!r}): that stage does not stream to it (sources: {known})")
        return self._buffer(rid, src).__aiter__()

    # -- running ---------------------------------------------------------------------------------

    def _start(self, rid: int, request_id: str, payload: Any, inbound: Inbound) -> None:
        self.running[rid] = asyncio.get_running_loop().create_task(self._run(rid, request_id, payload, inbound))

    async def _run(self, rid: int, request_id: str, payload: Any, inbound: Inbound) -> None:
        ctx = StageContext(self, rid, request_id)
        self.contexts[rid] = ctx
        started = None
        structlog.contextvars.bind_contextvars(request_id=request_id)  # this task's log lines
        try:
            async with self.sem:
                started = time.perf_counter()
                with tracing.stage_span(self.name, request_id=request_id, parent=self.host.traces.get(rid, "")):
                    result = await self._call(payload, ctx)
                metrics.stage_call(self.name, "ok", time.perf_counter() - started)
                started = None
                del payload
                stream_inbound = self.stream_inbound.get(rid)
                if stream_inbound is not None:
                    inbound.merge(stream_inbound)
                if self.follower:  # only the TP leader's result goes downstream
                    return
                if inbound.storages:
                    result = self.host.copy_out(result, inbound.storages)
                await self.host.finish(self, rid, request_id, result)
        except asyncio.CancelledError:
            ctx._aborted = True
            if started is not None:
                metrics.stage_call(self.name, "aborted", time.perf_counter() - started)
        except Exception as exc:
            if started is not None:
                metrics.stage_call(self.name, "error", time.perf_counter() - started)
            self.host.fail(rid, self.name, exc)
        finally:
            inbound.release()
            self.contexts.pop(rid, None)
            self.running.pop(rid, None)
            self._drop_streams(rid)

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
            metrics.stream_chunk(self.name)
            await self.host.emit(self, rid, request_id, chunk)

    # -- ending ----------------------------------------------------------------------------------

    def forget(self, rid: int) -> None:
        """Request ``rid`` ended elsewhere (abort, failure, done): cancel and free everything."""
        ctx = self.contexts.get(rid)
        if ctx is not None:
            ctx._aborted = True
        task = self.running.get(rid)
        if task is not None:
            task.cancel()
        self._drop_fan_in(rid)
        self._drop_streams(rid)

    def _drop_fan_in(self, rid: int) -> None:
        state = self.fan_in.pop(rid, None)
        if state is not None:
            state.inbound.release()

    def _drop_streams(self, rid: int) -> None:
        self.streams.pop(rid, None)
        inbound = self.stream_inbound.pop(rid, None)
        if inbound is not None:
            inbound.release()

    async def close(self) -> None:
        for rid in list(self.running):
            self.forget(rid)
        if self.running:
            await asyncio.wait(list(self.running.values()), timeout=2)
        for rid in list(self.fan_in):
            self._drop_fan_in(rid)
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        closer = getattr(self.obj, "close", None)
        if callable(closer):
            result = closer()
            if inspect.isawaitable(result):
                await result

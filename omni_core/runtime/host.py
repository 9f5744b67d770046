"""The stage host: the runtime of one stage process.

``Host`` builds the process's stages with their factories, then serves: it receives through the
process's :class:`~.endpoint.Endpoint` (which fetches, orders and decodes data messages) and
hands payloads and chunks to its stages, fans them out to TP followers, fails a request whose
message cannot be used, and frees a request's state everywhere in the process when it ends. What
goes out is the router's job (:mod:`.routing`); the stages and the router get narrow ports, not
the host. The process's ``main`` is in :mod:`.child`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import traceback
from collections.abc import Callable
from typing import Any

from .. import files, metrics, tracing
from ..config.schema import PipelineConfig, StageConfig
from ..errors import ConfigError, InvalidInput
from ..logs import get_logger
from ..plan.topology import ProcessSpec
from ..plugins import signature_text
from ..registry import Registry
from ..relay.inline import inline_transfer
from ..relay.liveness import process_alive
from ..relay.payload import pack
from . import wire
from .endpoint import Endpoint
from .routing import COORDINATOR, Router
from .stage import StageRuntime
from .stage_port import StagePort
from .types import INLINE_RELAY, Bootstrap, Inbound, StageFunctions, WiringError

__all__ = ["Bootstrap", "Host"]


def _inject(factory: Any, spec: ProcessSpec, stage: StageConfig, tp_init_method: str | None) -> dict[str, Any]:
    injectable = spec.injected_args(stage.name, tp_init_method)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return dict(stage.args)
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in stage.args if k not in params and not accepts_any]
    if unknown:
        raise ConfigError(
            f"stages[{stage.name}].args: {', '.join(map(repr, unknown))} not accepted by factory "
            f"{stage.factory!r}, whose signature is {signature_text(factory)}"
        )
    kwargs = dict(stage.args)
    for key, value in injectable.items():
        if key in params and key not in kwargs:
            kwargs[key] = value
    return kwargs


def _functions(registry: Registry, stage: StageConfig) -> StageFunctions:
    def get(kind: str, ref: str | None):
        return None if ref is None else registry.resolve(kind, ref)

    return StageFunctions(
        route=get("route", stage.route_fn),
        merge=get("merge", stage.merge_fn),
        wait_for=get("wait_for", stage.wait_for_fn),
        stream_done=get("stream_done", stage.stream_done_to_fn),
        project={t: registry.resolve("project_payload", fn) for t, fn in stage.project_payload.items()},
        project_stream={t: registry.resolve("project_stream", fn) for t, fn in stage.project_stream.items()},
    )


#: Requests whose trace context a process remembers at most (only while tracing is on).
_TRACES_MEMORY = 10_000


class Host:
    """The runtime of one stage process (also usable in-process for tests): ``config`` is the
    pipeline's (``boot.config`` structured), ``endpoint`` the process's, opened for the run."""

    def __init__(self, boot: Bootstrap, config: PipelineConfig, registry: Registry, endpoint: Endpoint):
        self.boot = boot
        self.spec = boot.process
        self.name = boot.process.name
        self.config = config
        files.configure(config.serve.allow_local_files)  # the local-file rule of requests from the network
        self.registry = registry
        self.endpoint = endpoint
        self.log = get_logger(pipeline=self.config.name, process=self.spec.name)
        self.stages: dict[str, StageRuntime] = {}
        #: While :meth:`build_stages` runs: the stage being built and the part of its config at
        #: stake (``".factory"``, ``".args"``, ``""``: the factory itself), for a failed start.
        self.building: tuple[str, str] | None = None
        self.ended: set[int] = set(boot.ended)  # requests that ended at or above the floor
        #: rid → the request's W3C traceparent, only while tracing is on (omni_core.tracing).
        self.traces: dict[int, str] = {}
        #: The requests that came over the network (StageContext.from_network), until they end.
        self.networked: set[int] = set()
        self.floor = boot.floor  # every request below it has ended
        self.stopping: asyncio.Event | None = None
        self.allow_pickle = self.config.allow_pickle
        self._followers = list(boot.followers)
        self.router = Router(self.config, endpoint, routes=boot.routes, edge_relays=boot.edge_relays,
                             stages=self.stages, traces=self.traces, networked=self.networked)
        self._port = StagePort(fail=self.fail, is_ended=self.is_ended, release=endpoint.edges.cleanup,
                               copy_out=endpoint.edges.copy_out, traces=self.traces, finish=self.router.finish,
                               emit=self.router.emit, networked=self.networked)
        endpoint.on_data(self)
        handlers: dict[type, Callable[[Any], None]] = {
            wire.StreamEnd: self._on_stream_end_message, wire.Credit: self.router.on_credit,
            wire.Abort: self._on_end_message, wire.Forget: self._on_end_message,
            wire.StateQuery: self._on_state_query, wire.Shutdown: self._on_shutdown,
        }
        for kind, handler in handlers.items():
            endpoint.on(kind, handler)

    # -- building ------------------------------------------------------------------------------

    @property
    def tp_init_method(self) -> str | None:
        """Rendezvous of this process's tensor-parallel group: a file in the private runtime dir,
        fresh for every generation of the group (a restarted group never meets the old one)."""
        if self.spec.tp_size == 1:
            return None
        return f"file://{self.boot.runtime_dir}/tp-{self.spec.group}-{self.spec.replica}-g{self.boot.generation}"

    def join_tp_group(self) -> None:
        """Join the stage's torch.distributed group (gloo on CPU, nccl on GPU) before the
        factory runs, so stage code can use collectives directly."""
        import torch.distributed as dist

        dist.init_process_group(self.spec.tp_backend, init_method=self.tp_init_method, rank=self.spec.tp_rank, world_size=self.spec.tp_size)

    def build_stages(self) -> None:
        if self.spec.tp_size > 1:
            self.join_tp_group()
        for name in self.spec.stages:
            stage = self.config.stage(name)
            self.building = (name, ".factory")
            factory = self.registry.resolve("stage", stage.factory)
            self.building = (name, ".args")
            kwargs = _inject(factory, self.spec, stage, self.tp_init_method)
            self.building = (name, "")
            try:
                obj = factory(**kwargs)
            except TypeError as exc:
                if exc.__traceback__ is not None and exc.__traceback__.tb_next is None:
                    self.building = (name, ".args")  # the call itself: arguments the factory does not take
                raise
            self.stages[name] = StageRuntime(
                self._port, stage, obj, _functions(self.registry, stage),
                stream_buffer=self.config.limits.stream_buffer, follower=not self.spec.is_leader,
                streaming_sources=frozenset(s.name for s in self.config.stages if name in s.stream_to),
            )
        self.building = None

    # -- receiving ------------------------------------------------------------------------------

    def is_ended(self, rid: int) -> bool:
        return rid < self.floor or rid in self.ended

    def _on_stream_end_message(self, msg: wire.StreamEnd) -> None:
        if not self.is_ended(msg.rid):
            self.endpoint.in_order(msg.rid, lambda: self._on_stream_end(msg))

    def _on_end_message(self, msg: wire.Abort | wire.Forget) -> None:
        self.endpoint.post_all(self._followers, msg)
        if msg.rid:
            self.forget(msg.rid)
        if msg.floor > self.floor:
            self._raise_floor(msg.floor)

    def _on_state_query(self, msg: wire.StateQuery) -> None:
        self.endpoint.post(COORDINATOR, wire.StateReport(msg.token, self.name, self.state()))

    def _on_shutdown(self, msg: wire.Shutdown) -> None:
        if self.stopping is not None:
            self.stopping.set()

    # The endpoint's DataReceiver: payloads and chunks for this process's stages.

    def wanted(self, rid: int) -> bool:
        return not self.is_ended(rid)

    def accept(self, msg: wire.Data) -> bool:
        rid = msg.rid
        if rid < self.floor or rid in self.ended:  # is_ended, inline: once per message
            return False
        if msg.stage not in self.stages:
            self.fail(msg.rid, msg.stage or "?", WiringError(
                f"process {self.name!r} received data for stage {msg.stage!r}, which it does not host "
                f"(it hosts {', '.join(self.stages)})"))
            return False
        if msg.kind not in ("work", "chunk"):
            self.fail(msg.rid, msg.stage, ValueError(f"a message for stage {msg.stage!r} has the unknown kind {msg.kind!r}"))
            return False
        return True

    def reject(self, msg: wire.Data, exc: BaseException) -> None:
        self.fail(msg.rid, msg.stage, exc)

    def deliver(self, msg: wire.Data, payload: Any, held: Inbound | None) -> None:
        rid = msg.rid
        if msg.trace and rid not in self.traces:  # tracing: remember the request's context
            self.traces[rid] = msg.trace
            if len(self.traces) > _TRACES_MEMORY:
                self.traces.pop(next(iter(self.traces)))
        if msg.from_network:
            self.networked.add(rid)
        if self._followers:
            self._to_followers(msg, payload)
        stage = self.stages[msg.stage]
        if msg.kind == "work":
            stage.on_payload(rid, msg.request_id, msg.src, payload, held if held is not None else Inbound())
        else:
            stage.on_chunk(rid, msg.request_id, msg.src, payload, held, self._granter(msg))

    def _granter(self, msg: wire.Data) -> Callable[[int, bool], None] | None:
        origin = msg.origin
        if not origin or origin not in self.endpoint.addresses:
            return None
        rid, stage, src, post = msg.rid, msg.stage, msg.src, self.endpoint.post

        def grant(n: int, closed: bool) -> None:
            post(origin, wire.Credit(rid, stage, src, n, closed))

        return grant

    def _on_stream_end(self, msg: wire.StreamEnd) -> None:
        self.endpoint.post_all(self._followers, msg)
        stage = self.stages.get(msg.stage)
        if stage is not None:
            stage.on_stream_end(msg.rid, msg.src)

    def _to_followers(self, msg: wire.Data, payload: Any) -> None:
        """A TP leader hands every payload and chunk to its followers, in arrival order, so all
        ranks run the same calls in the same order (their collectives must match)."""
        skeleton, tensors = pack(payload, allow_pickle=self.allow_pickle)
        transfer = inline_transfer(tensors)
        relay = INLINE_RELAY if tensors else ""  # inline_transfer's frames
        copy_msg = wire.Data(msg.kind, msg.rid, msg.request_id, msg.stage, msg.src, skeleton, relay,
                             transfer.handle, len(transfer.frames), "", msg.trace, msg.from_network)
        for follower in self._followers:
            self.endpoint.post(follower, copy_msg, transfer.frames)
        # The leader's call may start at once (eagerly) and wait in a collective for its
        # followers: they must have their copy before it does, not at the end of the drain.
        self.endpoint.flush()

    # -- ending ----------------------------------------------------------------------------------

    def forget(self, rid: int) -> None:
        """Request ``rid`` ended: cancel what runs for it and free everything it holds here."""
        if rid in self.ended:
            return
        if rid >= self.floor:
            self.ended.add(rid)
        self._clean(rid)

    def _clean(self, rid: int) -> None:
        self.traces.pop(rid, None)
        self.networked.discard(rid)
        self.endpoint.forget(rid)
        for stage in self.stages.values():
            stage.forget(rid)
        self.router.forget(rid)
        self.endpoint.edges.cleanup(rid)

    def _raise_floor(self, floor: int) -> None:
        """Every request below ``floor`` has ended: forget having seen them end, and free any
        state still held for one of them (its ``Forget`` may come later, from a TP leader)."""
        self.floor = floor
        self.ended = {rid for rid in self.ended if rid >= floor}
        if self.networked:
            self.networked.difference_update([rid for rid in self.networked if rid < floor])
        stale = {rid for stage in self.stages.values() for rid in stage.requests() if rid < floor}
        stale.update(rid for rid in (*self.endpoint.ordered.keys(), *self.router.windows.requests()) if rid < floor)
        self.endpoint.edges.cleanup_below(floor)
        for rid in stale:
            self._clean(rid)

    def fail(self, rid: int, stage: str, exc: BaseException) -> None:
        """Fail request ``rid`` because of ``exc`` in ``stage``; this process keeps serving."""
        if self.is_ended(rid):
            return
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        invalid = isinstance(exc, InvalidInput)  # the caller's mistake (omni serve: 400 naming the field)
        field = (exc.field or "") if isinstance(exc, InvalidInput) else ""
        self.endpoint.post(COORDINATOR, wire.Failed(rid, stage, type(exc).__name__, str(exc), tb, invalid, field))
        self.forget(rid)

    def state(self) -> dict[str, int]:
        """How many entries each per-request table of this process holds."""
        endpoint = self.endpoint.state()
        out = {"ended": len(self.ended), "ordered": endpoint.pop("ordered"), "windows": len(self.router.windows)}
        for stage in self.stages.values():
            out.update(stage.state())
        out.update(endpoint)
        return out

    # -- lifecycle -------------------------------------------------------------------------------

    async def serve(self) -> None:
        profile_dir = os.environ.get("OMNI_PROFILE_DIR")  # bench.hot_quick --profile: cProfile each process
        if not profile_dir:
            await self._serve()
            return
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            await self._serve()
        finally:
            profiler.disable()
            profiler.dump_stats(os.path.join(profile_dir, f"{self.spec.name}.prof"))

    async def _serve(self) -> None:
        self.stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        self.endpoint.listen()
        exporter = metrics.Exporter(self.boot.runtime_dir, self.spec.name).start()
        tracing.setup_process(self.spec.name)
        await self.endpoint.send(COORDINATOR, wire.Ready(self.spec.name, os.getpid()))
        await self.stopping.wait()
        # Orphaned (the parent was killed): nobody reads the metrics; leave nothing in the runtime dir.
        exporter.close(remove=not process_alive(self.boot.parent_pid))
        await self.close()
        tracing.shutdown()

    async def close(self) -> None:
        endpoint = self.endpoint
        endpoint.close_inbox()
        for stage in self.stages.values():
            try:
                await stage.close()
            except Exception:
                self.log.exception("stage close failed", stage=stage.name)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(endpoint.send(COORDINATOR, wire.Bye(self.spec.name)), 1.0)
        endpoint.close(linger_ms=1000)
        address = self.boot.addresses[self.spec.name]
        with contextlib.suppress(OSError):
            os.unlink(address.removeprefix("ipc://"))
        if not process_alive(self.boot.parent_pid):
            # Orphaned (the parent was killed): nobody else will remove the runtime dir.
            with contextlib.suppress(OSError):
                os.unlink(self.boot.addresses[COORDINATOR].removeprefix("ipc://"))
            with contextlib.suppress(OSError):
                os.rmdir(self.boot.runtime_dir)

"""The stage host: the ``main`` of every stage process.

It applies the process environment, loads plugins, builds the process's stages with their
factories, binds its inbox, reports ``Ready`` and then serves: payloads and chunks in, results and
chunks out, through the control plane and the edge relays. It exits when the coordinator says
``Shutdown`` (after answering ``Bye``) or when its parent dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ctypes
import inspect
import os
import signal
import sys
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import attrs
import msgspec
import torch
import zmq

from .. import metrics, tracing
from ..config.load import structure
from ..config.schema import PipelineConfig, StageConfig
from ..config.validate import INJECTED_ARGS
from ..errors import ConfigError, PluginError
from ..logs import configure_logging, get_logger
from ..plan.topology import OBJECT_RELAY, ProcessSpec
from ..plugins import get_registry, signature_text
from ..registry import Registry
from ..relay.base import Relay, RelayContext
from ..relay.inline import inline_transfer
from ..relay.liveness import process_alive
from ..relay.payload import pack, unpack
from . import wire
from .channel import Inbox, Outbox
from .stage import Inbound, StageFunctions, StageRuntime, WiringError

#: Relay used for the caller's edges (inputs to the entry stage, results and events back).
CALLER_RELAY = "inline"

#: Route/stream_done functions may return this to mean "every target".
ALL_TARGETS = "*"

_ENDED_MEMORY = 100_000
_TRACES_MEMORY = 10_000

#: The wire name of a message whose tensors went through two relays (see ``Host._put``).
SPLIT_RELAY = "+split"


class _Split(msgspec.Struct, array_like=True):
    relays: list[str]
    handles: list[bytes]
    counts: list[int]
    index: list[list[int]]


_encode_split = msgspec.msgpack.Encoder().encode
_decode_split = msgspec.msgpack.Decoder(_Split).decode


@attrs.frozen
class Bootstrap:
    """Everything a stage process needs, sent by the launcher (picklable)."""

    run_id: str
    runtime_dir: str
    config: dict[str, Any]
    process: ProcessSpec
    addresses: dict[str, str]
    routes: dict[str, list[str]]
    edge_relays: dict[tuple[str, str, str], str]
    env: dict[str, str]
    parent_pid: int
    followers: tuple[str, ...] = ()
    cwd: str | None = None


def relay_options(relay_cfg: Any, name: str) -> dict[str, Any]:
    """The options of relay ``name`` in a ``relay:`` config: its ``options`` when it names that
    backend; under ``auto``, the ``options`` entry named after the relay (``{shm: {slots: 8}}``)."""
    if relay_cfg.backend == name:
        return dict(relay_cfg.options)
    if relay_cfg.backend == "auto" and isinstance(relay_cfg.options.get(name), dict):
        return dict(relay_cfg.options[name])
    return {}


def _watch_parent(parent_pid: int) -> None:
    """Exit when the parent dies, even if it was SIGKILLed (no orphans)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: our direct parent (the forkserver) died

    def watch() -> None:
        while process_alive(parent_pid):
            time.sleep(0.25)
        os.kill(os.getpid(), signal.SIGTERM)  # a clean shutdown frees relay memory ...
        time.sleep(3)
        os._exit(1)  # ... unless user code blocks it

    threading.Thread(target=watch, name="omni-parent-watch", daemon=True).start()


def _inject(factory: Any, spec: ProcessSpec, stage: StageConfig, tp_init_method: str | None) -> dict[str, Any]:
    values = (stage.name, spec.device, None if spec.gpu is None else 0, spec.tp_rank, spec.tp_size, tp_init_method)
    injectable = dict(zip(INJECTED_ARGS, values, strict=True))
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
    )


def _names(answer: Any, allowed: tuple[str, ...], what: str) -> list[str]:
    """Normalise a route/stream_done answer to a list of names from ``allowed``."""
    if answer == ALL_TARGETS:
        return list(allowed)
    names = [answer] if isinstance(answer, str) else answer
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise WiringError(f"{what} returned {answer!r}; expected a stage name or a list of names from {list(allowed)}")
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise WiringError(f"{what} returned {unknown} which {'is' if len(unknown) == 1 else 'are'} not in {list(allowed)}")
    return list(dict.fromkeys(names))


class Host:
    """The runtime of one stage process (also usable in-process for tests)."""

    def __init__(self, boot: Bootstrap, registry: Registry):
        self.boot = boot
        self.spec = boot.process
        self.config: PipelineConfig = structure(boot.config)
        self.registry = registry
        self.log = get_logger(pipeline=self.config.name, process=self.spec.name)
        self.zctx = zmq.Context(io_threads=1)
        self.outbox = Outbox(self.zctx)
        self.coordinator = boot.addresses[""]
        self.relays: dict[str, Relay] = {}
        self.stages: dict[str, StageRuntime] = {}
        self.ended: OrderedDict[int, None] = OrderedDict()
        self.inbox: Inbox | None = None
        self.stopping: asyncio.Event | None = None
        self.allow_pickle = self.config.allow_pickle
        self._addresses_of: dict[str, list[str]] = {}
        #: rid → the request's W3C traceparent, only while tracing is on (omni_core.tracing).
        self.traces: OrderedDict[int, str] = OrderedDict()

    # -- building ------------------------------------------------------------------------------

    @property
    def tp_init_method(self) -> str | None:
        """Rendezvous of this process's tensor-parallel group: a file in the private runtime dir,
        so there is no port to pick and no bind-then-release race."""
        if self.spec.tp_size == 1:
            return None
        return f"file://{self.boot.runtime_dir}/tp-{self.spec.group}-{self.spec.replica}"

    def join_tp_group(self) -> None:
        """Join the stage's torch.distributed group (gloo on CPU, nccl on GPU) before the
        factory runs, so stage code can use collectives directly."""
        import torch.distributed as dist

        backend = "gloo" if self.spec.gpu is None else "nccl"
        dist.init_process_group(backend, init_method=self.tp_init_method, rank=self.spec.tp_rank, world_size=self.spec.tp_size)

    def build_stages(self) -> None:
        if self.spec.tp_size > 1:
            self.join_tp_group()
        for name in self.spec.stages:
            stage = self.config.stage(name)
            factory = self.registry.resolve("stage", stage.factory)
            kwargs = _inject(factory, self.spec, stage, self.tp_init_method)
            obj = factory(**kwargs)
            self.stages[name] = StageRuntime(
                self, stage, obj, _functions(self.registry, stage),
                stream_buffer=self.config.limits.stream_buffer, follower=not self.spec.is_leader,
            )

    def relay(self, name: str) -> Relay:
        relay = self.relays.get(name)
        if relay is None:
            cls = self.registry.resolve("relay", name)
            options = relay_options(self.config.relay, name)
            for stage in self.spec.stages:  # a stage's relay options apply to its own edges' relay
                own = self.config.stage(stage).relay
                if own is not None:
                    options.update(relay_options(own, name))
            relay = self.relays[name] = cls(RelayContext(self.boot.run_id, self.spec.name, self.boot.runtime_dir, options))
        return relay

    # -- receiving ------------------------------------------------------------------------------

    def on_message(self, msg: wire.Message, frames: list) -> None:
        if isinstance(msg, wire.Data):
            if msg.rid in self.ended:
                return
            if msg.stage not in self.stages:
                self.log.warning("dropped data for a stage this process does not host", stage=msg.stage)
                return
            if msg.nframes != len(frames):
                self.log.warning("dropped data with a wrong frame count", stage=msg.stage)
                return
            if msg.relay:
                asyncio.get_running_loop().create_task(self._receive(msg, frames))
            else:
                self._dispatch(msg, unpack(msg.skeleton, [], allow_pickle=self.allow_pickle), Inbound())
        elif isinstance(msg, wire.StreamEnd):
            for follower in self.boot.followers:
                self.outbox.post(self.boot.addresses[follower], msg)
            stage = self.stages.get(msg.stage)
            if stage is not None and msg.rid not in self.ended:
                stage.on_stream_end(msg.rid, msg.src)
        elif isinstance(msg, (wire.Abort, wire.Forget)):
            self.forget(msg.rid)
        elif isinstance(msg, wire.Shutdown):
            if self.stopping is not None:
                self.stopping.set()
        else:
            self.log.warning("dropped an unexpected control message", message=type(msg).__name__)

    async def _receive(self, msg: wire.Data, frames: list) -> None:
        try:
            tensors, inbound = await self._get(msg.relay, msg.handle, [f.buffer for f in frames])
        except Exception as exc:
            self.fail(msg.rid, msg.stage, exc)
            return
        if msg.rid in self.ended:
            inbound.release()
            return
        try:
            payload = unpack(msg.skeleton, tensors, allow_pickle=self.allow_pickle)
        except Exception as exc:
            inbound.release()
            self.fail(msg.rid, msg.stage, exc)
            return
        self._dispatch(msg, payload, inbound)

    # -- relays ---------------------------------------------------------------------------------

    async def _put(self, relay_name: str, rid: int, tensors: list, target: str) -> tuple[str, bytes, list]:
        """Put ``tensors`` through the edge's relay. Tensors on a device that relay cannot move
        (CPU tensors on a GPU-only relay) go through ``inline`` beside them, in one message."""
        metrics.relay_bytes(relay_name, self.spec.name, target, sum(t.numel() * t.element_size() for t in tensors))
        relay = self.relay(relay_name)
        devices = relay.capabilities.devices
        fits = [i for i, t in enumerate(tensors) if t.device.type in devices]
        if len(fits) == len(tensors):
            transfer = await relay.put(rid, tensors, target)
            return relay_name, transfer.handle, list(transfer.frames)
        rest = [i for i in range(len(tensors)) if i not in set(fits)]
        split = _Split([], [], [], [])
        frames: list = []
        for name, index in ((relay_name, fits), (CALLER_RELAY, rest)):
            if not index:
                continue
            transfer = await self.relay(name).put(rid, [tensors[i] for i in index], target)
            split.relays.append(name)
            split.handles.append(transfer.handle)
            split.counts.append(len(transfer.frames))
            split.index.append(index)
            frames += transfer.frames
        return SPLIT_RELAY, _encode_split(split), frames

    async def _get(self, relay_name: str, handle: bytes, frames: list) -> tuple[list, Inbound]:
        """The tensors of a received message, and what to release when the call is done."""
        inbound = Inbound()
        if relay_name != SPLIT_RELAY:
            return await self._get_one(relay_name, handle, frames, inbound), inbound
        split = _decode_split(handle)
        tensors: list = [None] * sum(len(index) for index in split.index)
        start = 0
        for name, sub, count, index in zip(split.relays, split.handles, split.counts, split.index, strict=True):
            part = await self._get_one(name, sub, frames[start:start + count], inbound)
            start += count
            for i, tensor in zip(index, part, strict=True):
                tensors[i] = tensor
        return tensors, inbound

    async def _get_one(self, relay_name: str, handle: bytes, frames: list, inbound: Inbound) -> list:
        relay = self.relay(relay_name)
        tensors = await relay.get(handle, frames)
        if type(relay).release is not Relay.release:
            inbound.releases.append(lambda: relay.release(handle))
            inbound.storages |= {t.untyped_storage().data_ptr() for t in tensors if t.numel() and t.device.type == "cpu"}
        return tensors

    def _dispatch(self, msg: wire.Data, payload: Any, inbound: Inbound) -> None:
        stage = self.stages[msg.stage]
        if msg.trace and msg.rid not in self.traces:  # tracing: remember the request's context
            self.traces[msg.rid] = msg.trace
            if len(self.traces) > _TRACES_MEMORY:
                self.traces.popitem(last=False)
        if self.boot.followers:
            self._to_followers(msg, payload)
        if msg.kind == "work":
            stage.on_payload(msg.rid, msg.request_id, msg.src, payload, inbound)
        elif msg.kind == "chunk":
            stage.on_chunk(msg.rid, msg.src, payload, inbound)
        else:
            inbound.release()
            self.log.warning("dropped data of unknown kind", kind=msg.kind)

    def _to_followers(self, msg: wire.Data, payload: Any) -> None:
        """A TP leader hands every payload and chunk to its followers, in arrival order, so all
        ranks run the same calls in the same order (their collectives must match)."""
        skeleton, tensors = pack(payload, allow_pickle=self.allow_pickle)
        transfer = inline_transfer(tensors)
        relay = CALLER_RELAY if tensors else ""
        copy_msg = wire.Data(msg.kind, msg.rid, msg.request_id, msg.stage, msg.src, skeleton, relay, transfer.handle, len(transfer.frames), msg.trace)
        for follower in self.boot.followers:
            self.outbox.post(self.boot.addresses[follower], copy_msg, transfer.frames)

    def forget(self, rid: int) -> None:
        if rid in self.ended:
            return
        self.ended[rid] = None
        if len(self.ended) > _ENDED_MEMORY:
            self.ended.popitem(last=False)
        self.traces.pop(rid, None)
        for stage in self.stages.values():
            stage.forget(rid)
        for relay in self.relays.values():
            try:
                relay.cleanup(rid)
            except Exception:
                self.log.exception("relay cleanup failed", relay=relay.name)

    # -- sending ---------------------------------------------------------------------------------

    def fail(self, rid: int, stage: str, exc: BaseException) -> None:
        """Fail request ``rid`` because of ``exc`` in ``stage``; this process keeps serving."""
        if rid in self.ended:
            return
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.outbox.post(self.coordinator, wire.Failed(rid, stage, type(exc).__name__, str(exc), tb))
        self.forget(rid)

    async def _send_data(self, kind: str, rid: int, request_id: str, src: str, dst: str,
                         address: str, relay_name: str, skeleton: bytes, tensors: list) -> None:
        if tensors:
            relay_name, handle, frames = await self._put(relay_name, rid, tensors, self._process_of(address))
            msg = wire.Data(kind, rid, request_id, dst, src, skeleton, relay_name, handle, len(frames), self.traces.get(rid, ""))
            await self.outbox.send(address, msg, frames)
        else:
            fut = self.outbox.post(address, wire.Data(kind, rid, request_id, dst, src, skeleton, trace=self.traces.get(rid, "")))
            if fut is not None:
                await fut

    def _process_of(self, address: str) -> str:
        for name, addr in self.boot.addresses.items():
            if addr == address:
                return name or "coordinator"
        return address

    def _target_address(self, stage: str, rid: int) -> str:
        addrs = self._addresses_of.get(stage)
        if addrs is None:
            addrs = self._addresses_of[stage] = [self.boot.addresses[p] for p in self.boot.routes[stage]]
        return addrs[rid % len(addrs)] if len(addrs) > 1 else addrs[0]

    async def _deliver(self, kind: str, stage: StageRuntime, rid: int, request_id: str,
                       targets: list[str], payloads: Mapping[str, Any]) -> None:
        """Send each target its payload: objects to stages of this process (a private copy for
        all but the last), packed once and relayed to the others."""
        edge_kind = "next" if kind == "work" else "stream"
        if len(targets) == 1:
            target = targets[0]
            relay_name = self.boot.edge_relays[(stage.name, target, edge_kind)]
            if relay_name != OBJECT_RELAY:
                skeleton, tensors = pack(payloads[target], allow_pickle=self.allow_pickle)
                await self._send_data(kind, rid, request_id, stage.name, target, self._target_address(target, rid),
                                      relay_name, skeleton, tensors)
                return
        local = [t for t in targets if self.boot.edge_relays[(stage.name, t, edge_kind)] == OBJECT_RELAY]
        remote = [t for t in targets if t not in local]
        packed: dict[int, tuple[bytes, list]] = {}
        for target in remote:
            payload = payloads[target]
            if id(payload) not in packed:
                packed[id(payload)] = pack(payload, allow_pickle=self.allow_pickle)
            skeleton, tensors = packed[id(payload)]
            edge_kind = "next" if kind == "work" else "stream"
            await self._send_data(kind, rid, request_id, stage.name, target, self._target_address(target, rid),
                                  self.boot.edge_relays[(stage.name, target, edge_kind)], skeleton, tensors)
        for i, target in enumerate(local):
            payload = payloads[target]
            shared = any(payloads[t] is payload for t in local[i + 1:])
            obj = copy.deepcopy(payload) if shared else payload
            if kind == "work":
                self.stages[target].on_payload(rid, request_id, stage.name, obj, Inbound())
            else:
                self.stages[target].on_chunk(rid, stage.name, obj, Inbound())

    async def finish(self, stage: StageRuntime, rid: int, request_id: str, result: Any) -> None:
        """Hand a finished call's result on. Every user function (route, projections,
        stream_done) runs before anything is sent, so a failing one fails the request without
        half of its outputs already downstream. Then: the result to the coordinator when the
        stage is terminal, the payloads to ``next``, the end of its streams."""
        cfg = stage.cfg
        targets = list(cfg.next)
        if stage.fns.route is not None:
            targets = _names(stage.fns.route(request_id, result), cfg.next, f"route_fn {cfg.route_fn!r} of stage {cfg.name!r}")
        project = stage.fns.project
        payloads = {t: (project[t](result) if t in project else result) for t in targets} if project else dict.fromkeys(targets, result)
        done_to = list(cfg.stream_to)
        if cfg.stream_to and stage.fns.stream_done is not None:
            answer = stage.fns.stream_done(request_id, result)
            done_to = [] if answer is None else _names(answer, cfg.stream_to, f"stream_done_to_fn {cfg.stream_done_to_fn!r} of stage {cfg.name!r}")
        if cfg.terminal:
            skeleton, tensors = pack(result, allow_pickle=self.allow_pickle)
            await self._send_data("result", rid, request_id, cfg.name, cfg.name, self.coordinator, CALLER_RELAY, skeleton, tensors)
        dropped = [t for t in cfg.next if t not in targets] if stage.fns.route is not None else None
        if dropped:
            await self.outbox.send(self.coordinator, wire.Dropped(rid, cfg.name, dropped))
        if targets:
            await self._deliver("work", stage, rid, request_id, targets, payloads)
        for target in done_to:
            if self.boot.edge_relays[(cfg.name, target, "stream")] == OBJECT_RELAY:
                self.stages[target].on_stream_end(rid, cfg.name)
            else:
                await self.outbox.send(self._target_address(target, rid), wire.StreamEnd(rid, target, cfg.name))

    async def emit(self, stage: StageRuntime, rid: int, request_id: str, chunk: Any) -> None:
        """A chunk goes to every ``stream_to`` stage and, when the stage is terminal, to the
        caller too."""
        cfg = stage.cfg
        if not cfg.stream_to and not cfg.terminal:
            raise WiringError(f"stage {cfg.name!r} emitted a chunk but has no stream_to and is not terminal")
        if cfg.stream_to:
            await self._deliver("chunk", stage, rid, request_id, list(cfg.stream_to), dict.fromkeys(cfg.stream_to, chunk))
        if cfg.terminal:
            skeleton, tensors = pack(chunk, allow_pickle=self.allow_pickle)
            await self._send_data("event", rid, request_id, cfg.name, cfg.name, self.coordinator, CALLER_RELAY, skeleton, tensors)

    @staticmethod
    def copy_out(result: Any, storages: set[int]) -> Any:
        """Clone tensors of ``result`` that view relay memory about to be released."""

        def walk(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                return obj.clone() if obj.numel() and obj.untyped_storage().data_ptr() in storages else obj
            if isinstance(obj, dict):
                return {k: walk(v) for k, v in obj.items()}
            if isinstance(obj, list):
                return [walk(v) for v in obj]
            if isinstance(obj, tuple):
                return tuple(walk(v) for v in obj)
            return obj

        return walk(result)

    # -- lifecycle -------------------------------------------------------------------------------

    async def serve(self) -> None:
        self.stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        self.inbox = Inbox(self.zctx, self.boot.addresses[self.spec.name], self.on_message, name=self.spec.name)
        self.inbox.start()
        exporter = metrics.Exporter(self.boot.runtime_dir, self.spec.name).start()
        tracing.setup_process(self.spec.name)
        await self.outbox.send(self.coordinator, wire.Ready(self.spec.name, os.getpid()))
        await self.stopping.wait()
        await self.close()
        exporter.close()
        tracing.shutdown()

    async def close(self) -> None:
        for stage in self.stages.values():
            try:
                await stage.close()
            except Exception:
                self.log.exception("stage close failed", stage=stage.name)
        for relay in self.relays.values():
            try:
                relay.close()
            except Exception:
                self.log.exception("relay close failed", relay=relay.name)
        if self.inbox is not None:
            self.inbox.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.outbox.send(self.coordinator, wire.Bye(self.spec.name)), 1.0)
        self.outbox.close(linger_ms=1000)
        self.zctx.term()
        address = self.boot.addresses[self.spec.name]
        with contextlib.suppress(OSError):
            os.unlink(address.removeprefix("ipc://"))
        if not process_alive(self.boot.parent_pid):
            # Orphaned (the parent was killed): nobody else will remove the runtime dir.
            with contextlib.suppress(OSError):
                os.unlink(self.coordinator.removeprefix("ipc://"))
            with contextlib.suppress(OSError):
                os.rmdir(self.boot.runtime_dir)


def _apply_env(boot: Bootstrap) -> None:
    """The process's environment and working directory are the caller's at start (a forkserver
    child would otherwise inherit the forkserver's), plus the plan's variables."""
    os.environ.clear()
    os.environ.update(boot.env)
    if boot.cwd:
        with contextlib.suppress(OSError):
            os.chdir(boot.cwd)
    torch.set_num_threads(max(1, boot.process.threads))


def main(boot: Bootstrap) -> None:
    """Entry point of a stage process (called by the launcher in the child)."""
    _watch_parent(boot.parent_pid)
    _apply_env(boot)
    configure_logging(force=True)
    host: Host | None = None

    async def run() -> None:
        nonlocal host
        try:
            host = Host(boot, get_registry())
            host.build_stages()
        except BaseException as exc:
            await _report_start_failure(boot, exc)
            raise SystemExit(1) from None
        await host.serve()

    try:
        asyncio.run(run())
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


async def _report_start_failure(boot: Bootstrap, exc: BaseException) -> None:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (ConfigError, PluginError)):
        message = str(exc)
    ctx = zmq.Context(io_threads=1)
    outbox = Outbox(ctx)
    try:
        await asyncio.wait_for(outbox.send(boot.addresses[""], wire.StartFailed(boot.process.name, os.getpid(), message, tb)), 2.0)
    finally:
        outbox.close(linger_ms=2000)
        ctx.term()

"""Where a stage's outputs go: route functions, per-target projections, fan-out, streams.

``Router.finish`` hands a finished call's result on (to the caller when the stage is terminal, to
``next``, and the end of its streams); ``Router.emit`` sends a stream chunk to every ``stream_to``
stage and, for a terminal stage or one with ``caller`` in its ``stream_to``, to the caller, taking
one credit of each stream's window first
(:mod:`.flow`). Targets in this process get objects; the others get the payload packed once and
relayed.
"""

from __future__ import annotations

import copy
from collections.abc import Container, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..config.schema import CALLER_STAGE, PipelineConfig
from ..plan.topology import OBJECT_RELAY, replica_index
from ..relay.payload import pack
from . import wire
from .endpoint import Endpoint
from .flow import Windows
from .types import CALLER, Inbound, WiringError, chosen_names

if TYPE_CHECKING:  # pragma: no cover
    from .stage import StageRuntime

#: The coordinator's process name on the wire (the caller's: ``CALLER``, the consumer name of its
#: stream in a window key too).
COORDINATOR = CALLER


class Router:
    """Sends what the stages of one process produce, through the process's ``endpoint``:
    ``routes`` (stage → the processes serving it, one per replica), ``edge_relays`` (the relay
    of every edge), the process's ``stages`` (targets here get objects) and the requests'
    ``traces`` (read only)."""

    def __init__(self, config: PipelineConfig, endpoint: Endpoint, *, routes: Mapping[str, Sequence[str]],
                 edge_relays: Mapping[tuple[str, str, str], str], stages: Mapping[str, StageRuntime],
                 traces: Mapping[int, str], networked: Container[int] = frozenset()):
        self.endpoint = endpoint
        self.networked = networked  # the requests that came over the network (read only)
        self.edge_relays = edge_relays
        self.stages = stages
        self.traces = traces
        self.allow_pickle = config.allow_pickle
        self.windows = Windows(config.limits.stream_buffer)
        self.stall_timeout = config.limits.stream_stall_timeout
        self._processes_of = {stage: list(procs) for stage, procs in routes.items()}

    def process(self, stage: str, rid: int) -> str:
        """The process that serves ``stage`` for request ``rid``."""
        procs = self._processes_of[stage]
        return procs[replica_index(rid, len(procs))] if len(procs) > 1 else procs[0]

    def _trace(self, rid: int) -> str:
        traces = self.traces
        return traces.get(rid, "") if traces else ""

    async def _deliver(self, kind: str, stage: StageRuntime, rid: int, request_id: str,
                       targets: Sequence[str], payloads: Mapping[str, Any] | None, value: Any = None) -> None:
        """Send each target its payload (``payloads[target]``, or ``value`` for all when
        ``payloads`` is None): objects to stages of this process (a private copy for all but the
        last), packed once and relayed to the others."""
        edge_kind = "next" if kind == "work" else "stream"
        edge_relays = self.edge_relays
        name = stage.name
        local: list[str] = []
        packed: dict[int, tuple[bytes, list]] = {}
        for target in targets:
            relay = edge_relays[(name, target, edge_kind)]
            if relay == OBJECT_RELAY:
                local.append(target)
                continue
            payload = value if payloads is None else payloads[target]
            entry = packed.get(id(payload))
            if entry is None:
                entry = packed[id(payload)] = pack(payload, allow_pickle=self.allow_pickle)
            skeleton, tensors = entry
            procs = self._processes_of[target]
            to = procs[replica_index(rid, len(procs))] if len(procs) > 1 else procs[0]
            await self.endpoint.send_data(to, wire.Data(kind, rid, request_id, target, name, skeleton,
                                                        trace=self.traces.get(rid, "") if self.traces else "",
                                                        from_network=rid in self.networked), tensors, relay)
        if not local:
            return
        stages = self.stages
        for i, target in enumerate(local):
            payload = value if payloads is None else payloads[target]
            shared = any((value if payloads is None else payloads[t]) is payload for t in local[i + 1:])
            obj = copy.deepcopy(payload) if shared else payload
            if kind == "work":
                stages[target].on_payload(rid, request_id, name, obj, Inbound())
            else:
                window = self.windows.get(rid, name, target)
                stages[target].on_chunk(rid, request_id, name, obj, None, window.grant)

    async def finish(self, stage: StageRuntime, rid: int, request_id: str, result: Any) -> None:
        """Hand a finished call's result on. Every user function (route, projections,
        stream_done) runs before anything is sent, so a failing one fails the request without
        half of its outputs already downstream. Then: the result to the coordinator when the
        stage is terminal, the payloads to ``next``, the end of its streams."""
        cfg = stage.cfg
        fns = stage.fns
        if fns.route is None and not fns.project and not cfg.stream_to:
            # A plain stage: the result goes to the caller (terminal) and to every next stage.
            if cfg.terminal:
                skeleton, tensors = pack(result, allow_pickle=self.allow_pickle)
                await self.endpoint.send_data(COORDINATOR, wire.Data("result", rid, request_id, cfg.name, cfg.name, skeleton,
                                                                     trace=self.traces.get(rid, "") if self.traces else ""),
                                              tensors, self.edge_relays[(cfg.name, COORDINATOR, "result")])
            if cfg.next:
                await self._deliver("work", stage, rid, request_id, cfg.next, None, result)
            self.windows.drop(rid, cfg.name)
            return
        targets = list(cfg.next)
        if fns.route is not None:
            targets = chosen_names(fns.route(request_id, result), cfg.next, f"route_fn {cfg.route_fn!r} of stage {cfg.name!r}")
        project = fns.project
        payloads = {t: (project[t](result) if t in project else result) for t in targets} if project else None
        done_to = [t for t in cfg.stream_to if t != CALLER_STAGE]
        if done_to and fns.stream_done is not None:
            answer = fns.stream_done(request_id, result)
            done_to = [] if answer is None else chosen_names(answer, done_to, f"stream_done_to_fn {cfg.stream_done_to_fn!r} of stage {cfg.name!r}")
        endpoint = self.endpoint
        if cfg.terminal:
            skeleton, tensors = pack(result, allow_pickle=self.allow_pickle)
            await endpoint.send_data(COORDINATOR, wire.Data("result", rid, request_id, cfg.name, cfg.name, skeleton,
                                                            trace=self._trace(rid)), tensors, self.edge_relays[(cfg.name, COORDINATOR, "result")])
        if fns.route is not None:
            dropped = [t for t in cfg.next if t not in targets]
            if dropped:
                await endpoint.send(COORDINATOR, wire.Dropped(rid, cfg.name, dropped))
        if targets:
            await self._deliver("work", stage, rid, request_id, targets, payloads, result)
        for target in done_to:
            if self.edge_relays[(cfg.name, target, "stream")] == OBJECT_RELAY:
                self.stages[target].on_stream_end(rid, cfg.name)
            else:
                await endpoint.send(self.process(target, rid), wire.StreamEnd(rid, target, cfg.name))
        if not cfg.terminal and CALLER_STAGE in cfg.stream_to:
            # The caller's stream ended: after its last chunk on the same connection, so the
            # request completes only once the caller has every chunk.
            await endpoint.send(COORDINATOR, wire.StreamEnd(rid, CALLER_STAGE, cfg.name))
        self.windows.drop(rid, cfg.name)

    async def emit(self, stage: StageRuntime, rid: int, request_id: str, chunk: Any) -> None:
        """A chunk goes to every ``stream_to`` stage and, when the stage is terminal or streams to
        ``caller``, to the caller too, each target's ``project_stream`` function applied to it
        first; each consumer's window gives a credit first (waiting for one if needed)."""
        cfg = stage.cfg
        if not cfg.stream_to and not cfg.terminal:
            raise WiringError(f"stage {cfg.name!r} emitted a chunk but has no stream_to and is not terminal")
        targets = []
        windows = self.windows
        to_caller = cfg.terminal
        for target in cfg.stream_to:
            if target == CALLER_STAGE:
                to_caller = True
                continue
            window = windows.get(rid, cfg.name, target)
            if window.credits > 0 and not window.closed:  # the common case, without a coroutine
                window.credits -= 1
                targets.append(target)
            elif await self._credit(rid, cfg.name, target):
                targets.append(target)
        project = stage.fns.project_stream
        if targets:
            payloads = {t: (project[t](chunk) if t in project else chunk) for t in targets} if project else None
            await self._deliver("chunk", stage, rid, request_id, targets, payloads, chunk)
        if to_caller and await self._credit(rid, cfg.name, CALLER):
            if CALLER_STAGE in project:  # e.g. the text of a chunk whose tensors are for the next stage
                chunk = project[CALLER_STAGE](chunk)
            skeleton, tensors = pack(chunk, allow_pickle=self.allow_pickle)
            await self.endpoint.send_data(COORDINATOR, wire.Data("event", rid, request_id, cfg.name, cfg.name, skeleton,
                                                                 trace=self._trace(rid)), tensors, self.edge_relays[(cfg.name, COORDINATOR, "stream")])

    async def _credit(self, rid: int, src: str, dst: str) -> bool:
        window = self.windows.get(rid, src, dst)
        if window.credits > 0 and not window.closed:
            window.credits -= 1
            return True
        reader = "the caller" if dst == CALLER else f"stage {dst!r}"
        return await window.acquire(self.stall_timeout, lambda: f"the stream from stage {src!r} to {reader}")

    def on_credit(self, msg: wire.Credit) -> None:
        self.windows.grant(msg.rid, msg.src, msg.stage, msg.n, msg.closed)

    def forget(self, rid: int) -> None:
        self.windows.drop(rid)

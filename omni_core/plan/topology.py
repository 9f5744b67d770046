"""From a validated config and a placement to the process topology: pure functions, no I/O.

The runtime consumes only what is here: one :class:`ProcessSpec` per OS process and one
:class:`EdgeSpec` per connection between stages, gathered in a :class:`Plan`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import attrs

from ..config.schema import PipelineConfig, RelayConfig, StageConfig
from ..registry import Registry
from .placement import Device, Placement, detect_devices, place, simulated_devices

#: The pseudo-relay of edges inside one process: payloads pass as Python objects.
OBJECT_RELAY = "object"


@attrs.frozen
class ProcessSpec:
    """One OS process: the stages it hosts, where it runs, and its environment.

    ``name`` is unique in the plan (``group``, plus ``#r`` for a replica, plus ``.rank`` for TP
    ranks). ``env`` holds defaults the operator's environment overrides; ``forced_env`` holds what
    placement requires (device visibility) and wins. ``leader`` is set on TP followers.
    """

    name: str
    group: str
    stages: tuple[str, ...]
    replica: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    gpu: int | None = None
    env: dict[str, str] = attrs.field(factory=dict)
    forced_env: dict[str, str] = attrs.field(factory=dict)
    threads: int = 1
    leader: str | None = None

    @property
    def is_leader(self) -> bool:
        return self.leader is None

    @property
    def device(self) -> str:
        return "cpu" if self.gpu is None else "cuda:0"


@attrs.frozen
class EdgeSpec:
    """A connection from stage ``src`` to stage ``dst``: ``kind`` is ``next`` (payloads) or
    ``stream`` (chunks); ``relay`` is the backend that moves its tensors (``object`` inside one
    process)."""

    src: str
    dst: str
    kind: str
    relay: str
    local: bool


@attrs.frozen
class Plan:
    """Everything the runtime needs to start a pipeline."""

    config: PipelineConfig
    processes: tuple[ProcessSpec, ...]
    edges: tuple[EdgeSpec, ...]
    placement: Placement
    devices: tuple[Device, ...]
    warnings: tuple[str, ...] = ()

    def process(self, name: str) -> ProcessSpec:
        for proc in self.processes:
            if proc.name == name:
                return proc
        raise KeyError(name)

    def leaders(self) -> list[ProcessSpec]:
        return [p for p in self.processes if p.is_leader]

    def processes_of(self, stage: str) -> list[str]:
        """Leader processes hosting ``stage`` (one per replica), in replica order."""
        return [p.name for p in self.processes if p.is_leader and stage in p.stages]

    def edge(self, src: str, dst: str, kind: str = "next") -> EdgeSpec:
        for edge in self.edges:
            if (edge.src, edge.dst, edge.kind) == (src, dst, kind):
                return edge
        raise KeyError((src, dst, kind))


def _groups(cfg: PipelineConfig) -> dict[str, list[StageConfig]]:
    groups: dict[str, list[StageConfig]] = {}
    for stage in cfg.stages:
        groups.setdefault(stage.process or stage.name, []).append(stage)
    return groups


def _default_threads(process_count: int, cores: int) -> int:
    return max(1, cores // max(1, process_count))


def build_processes(cfg: PipelineConfig, placement: Placement, *, cores: int | None = None) -> list[ProcessSpec]:
    """One spec per process: shared-process groups, replicas, and one process per TP rank."""
    cores = cores or os.cpu_count() or 1
    groups = _groups(cfg)
    count = sum(s[0].replicas * s[0].tp_size for s in groups.values())
    procs: list[ProcessSpec] = []
    for group, stages in groups.items():
        head = stages[0]
        threads = head.threads or _default_threads(count, cores)
        env = {
            **{k: str(v) for k, v in cfg.env_defaults.items()},
            "OMP_WAIT_POLICY": "PASSIVE",
            "OMP_NUM_THREADS": str(threads),
            **head.env,
        }
        for replica in range(head.replicas):
            base = group if head.replicas == 1 else f"{group}#{replica}"
            leader = None
            for rank in range(head.tp_size):
                gpu = placement[head.name][rank]
                name = base if head.tp_size == 1 else f"{base}.{rank}"
                forced = {} if gpu is None else {"OMNI_GPU_ID": str(gpu)}
                procs.append(
                    ProcessSpec(
                        name=name,
                        group=group,
                        stages=tuple(s.name for s in stages),
                        replica=replica,
                        tp_rank=rank,
                        tp_size=head.tp_size,
                        gpu=gpu,
                        env=env,
                        forced_env=forced,
                        threads=threads,
                        leader=leader,
                    )
                )
                leader = leader or name
    return procs


def _relay_for(cfg: PipelineConfig, src: StageConfig, registry: Registry) -> RelayConfig:
    return src.relay or cfg.relay


def choose_relay(cfg: PipelineConfig, src: StageConfig, registry: Registry, *, local: bool) -> str:
    """The relay of an edge leaving ``src``: ``object`` inside one process; the stage's or the
    pipeline's forced backend; else (``auto``) the highest-priority registered relay that can
    move host tensors between processes of one node."""
    if local:
        return OBJECT_RELAY
    relay_cfg = _relay_for(cfg, src, registry)
    if relay_cfg.backend != "auto":
        return relay_cfg.backend
    best: tuple[int, str] | None = None
    for entry in registry.entries("relay"):
        caps = getattr(entry.load(), "capabilities", None)
        if caps is None or "cpu" not in caps.devices or "node" not in caps.scopes:
            continue
        if best is None or caps.priority > best[0]:
            best = (caps.priority, entry.name)
    if best is None:
        raise LookupError("no installed relay can move tensors between processes; is omni-core installed correctly?")
    return best[1]


def build_edges(cfg: PipelineConfig, processes: Sequence[ProcessSpec], registry: Registry) -> list[EdgeSpec]:
    home = {}
    for proc in processes:
        for stage in proc.stages:
            home.setdefault(stage, set()).add(proc.group)
    edges = []
    for stage in cfg.stages:
        for kind, targets in (("next", stage.next), ("stream", stage.stream_to)):
            for dst in targets:
                dst_cfg = cfg.stage(dst)
                local = (
                    stage.process is not None
                    and stage.process == dst_cfg.process
                    and stage.tp_size == 1
                    and stage.replicas == 1
                )
                edges.append(EdgeSpec(stage.name, dst, kind, choose_relay(cfg, stage, registry, local=local), local))
    return edges


def build_plan(
    cfg: PipelineConfig,
    registry: Registry,
    *,
    gpus: int | None = None,
    devices: Sequence[Device] | None = None,
    cores: int | None = None,
) -> Plan:
    """The whole plan. ``gpus`` simulates that many devices (else ``placement.gpus``, else what
    torch sees); ``devices`` gives them explicitly (tests)."""
    if devices is None:
        count = gpus if gpus is not None else cfg.placement.gpus
        devices = (
            simulated_devices(count, cfg.placement.memory_per_gpu)
            if count is not None
            else detect_devices(cfg.placement.memory_per_gpu)
        )
    placement = place(cfg, registry, devices)
    processes = build_processes(cfg, placement, cores=cores)
    edges = build_edges(cfg, processes, registry)
    return Plan(config=cfg, processes=tuple(processes), edges=tuple(edges), placement=placement, devices=tuple(devices))


def endpoints(plan: Plan, runtime_dir: str) -> Mapping[str, str]:
    """The zmq address each process (and the coordinator, key ``""``) binds its inbox to."""
    out = {"": f"ipc://{runtime_dir}/coordinator"}
    for i, proc in enumerate(plan.processes):
        out[proc.name] = f"ipc://{runtime_dir}/p{i}"
    return out

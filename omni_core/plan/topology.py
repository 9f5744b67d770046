"""From a validated config and a placement to the process topology: pure functions, no I/O.

The runtime consumes only what is here: one :class:`ProcessSpec` per OS process and one
:class:`EdgeSpec` per connection between stages, gathered in a :class:`Plan`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import attrs

from ..capabilities import relay_capabilities
from ..config.schema import CALLER_STAGE, INJECTED_ARGS, PipelineConfig, StageConfig
from ..errors import ConfigError, ConfigIssue
from ..registry import Registry
from .placement import (
    Device,
    GpuLoad,
    Placement,
    detect_devices,
    gpu_loads,
    place,
    placement_warnings,
    request_from_config,
    simulated_devices,
)

#: The pseudo-relay of edges inside one process: payloads pass as Python objects.
OBJECT_RELAY = "object"

#: The torch.distributed backend of a tensor-parallel group, by the device type of its ranks.
TP_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl"}

#: The address a process is given for a peer on another node it never sends to (zmq refuses it).
UNREACHABLE = "unreachable://"


@attrs.frozen
class ProcessSpec:
    """One OS process: the stages it hosts, where it runs, and its environment.

    ``name`` is unique in the plan (``group``, plus ``#r`` for a replica, plus ``.rank`` for TP
    ranks). ``env`` holds what the config asks for, which the operator's environment overrides:
    ``env_defaults``, thread settings, then the stage's ``env``. ``forced_env`` holds what
    placement requires (``CUDA_VISIBLE_DEVICES``, ``OMNI_GPU_ID``) and wins over both. ``leader``
    is set on TP followers (the name of rank 0).

    ``gpu`` is the placement id (an index into the operator's ``CUDA_VISIBLE_DEVICES`` when it is
    set); ``physical_gpu`` is the entry the process is given as its only visible device, so it
    always uses ``cuda:0``. A process on the CPU gets ``CUDA_VISIBLE_DEVICES=""``.
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
    physical_gpu: str | None = None

    @property
    def is_leader(self) -> bool:
        return self.leader is None

    @property
    def device(self) -> str:
        return "cpu" if self.gpu is None else "cuda:0"

    @property
    def tp_backend(self) -> str:
        """The torch.distributed backend of this process's TP group (:data:`TP_BACKENDS`)."""
        return TP_BACKENDS[self.device.partition(":")[0]]

    def injected_args(self, stage_name: str, tp_init_method: str | None = None) -> dict[str, object]:
        """The values the runtime passes to a stage factory of this process that declares them
        by name (:data:`~omni_core.config.schema.INJECTED_ARGS`): ``stage_name``, ``device``
        (``cuda:0`` or ``cpu``), ``gpu_id`` (the torch index of the process's GPU, so 0, or None
        on the CPU), ``tp_rank``, ``tp_size`` and ``tp_init_method`` (the TP group's rendezvous,
        None without TP)."""
        values = (stage_name, self.device, None if self.gpu is None else 0, self.tp_rank, self.tp_size,
                  tp_init_method)
        return dict(zip(INJECTED_ARGS, values, strict=True))

    def environment(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The complete environment of the process: ``env`` under the operator's ``environ``
        under ``forced_env``."""
        return {**self.env, **environ, **self.forced_env}


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
    #: Whether the two ends run on different nodes (known once a multi-node launcher placed them).
    crosses_nodes: bool = False
    #: For an edge across nodes: the milliseconds per MiB its relay's benchmark measured between
    #: two nodes (the relay's ``capabilities.ms_per_mib``), None when it declares none.
    ms_per_mib: float | None = None


def replica_index(rid: int, replicas: int) -> int:
    """Which of a stage's ``replicas`` serves request ``rid``: the one rule every process (the
    coordinator and each stage's router) spreads requests by, so all agree without asking."""
    return rid % replicas if replicas > 1 else 0


@attrs.frozen
class Plan:
    """Everything the runtime needs to start a pipeline.

    ``placement`` has one GPU id (or None) per replica and rank of each stage, replica-major;
    ``loads`` what each GPU holds; ``simulated`` whether the devices were simulated
    (``--gpus`` / ``placement.gpus``) rather than detected or given."""

    config: PipelineConfig
    processes: tuple[ProcessSpec, ...]
    edges: tuple[EdgeSpec, ...]
    placement: Placement
    devices: tuple[Device, ...]
    warnings: tuple[str, ...] = ()
    loads: tuple[GpuLoad, ...] = ()
    simulated: bool = False
    #: Process name (``""``: the coordinator) → node, once a multi-node launcher placed them.
    nodes: dict[str, str] = attrs.field(factory=dict)

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

    def replica(self, stage: str, rid: int) -> str:
        """The leader process of ``stage`` that serves request ``rid`` (:func:`replica_index`)."""
        leaders = self.processes_of(stage)
        return leaders[replica_index(rid, len(leaders))]

    def followers(self, leader: str) -> list[str]:
        """The TP followers of process ``leader`` (ranks 1 up of its replica), in rank order."""
        return [p.name for p in self.processes if p.leader == leader]

    def group(self, name: str) -> list[ProcessSpec]:
        """Every process of the process group ``name`` (replicas and TP ranks), in order."""
        return [p for p in self.processes if p.group == name]

    @property
    def groups(self) -> list[str]:
        """Process group names in config order."""
        return list(dict.fromkeys(p.group for p in self.processes))

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


def visible_devices(environ: Mapping[str, str]) -> list[str] | None:
    """The entries of the operator's ``CUDA_VISIBLE_DEVICES`` (ids, ``GPU-…``/``MIG-…`` UUIDs),
    or None when it is not set."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def physical_gpu(gpu: int, visible: Sequence[str] | None, *, stage: str, path: str) -> str:
    """What a process placed on ``gpu`` gets as its ``CUDA_VISIBLE_DEVICES``: the ``gpu``-th
    entry of the operator's list, else ``gpu`` itself. A ConfigError when the list is shorter."""
    if visible is None:
        return str(gpu)
    if gpu < len(visible):
        return visible[gpu]
    raise ConfigError([ConfigIssue(
        path,
        f"stage {stage!r} is placed on GPU {gpu}, but CUDA_VISIBLE_DEVICES={','.join(visible)!r} makes only "
        f"{len(visible)} GPU{'s' if len(visible) != 1 else ''} visible",
        "placement ids index into CUDA_VISIBLE_DEVICES; widen it, or plan with fewer GPUs",
    )])


def config_env(cfg: PipelineConfig, head: StageConfig, threads: int) -> dict[str, str]:
    """What the config asks for, in increasing precedence: ``env_defaults``, thread settings
    (``OMP_WAIT_POLICY=PASSIVE``, ``OMP_NUM_THREADS``), the stage's ``env``. The operator's
    environment overrides all of it."""
    return {
        **{k: str(v) for k, v in cfg.env_defaults.items()},
        "OMP_WAIT_POLICY": "PASSIVE",
        "OMP_NUM_THREADS": str(threads),
        **head.env,
    }


def forced_env(gpu: int | None, physical: str | None) -> dict[str, str]:
    """What placement requires whatever the environment says: the process sees only its GPU
    (``OMNI_GPU_ID`` is the placement id), or no GPU at all on the CPU."""
    if gpu is None:
        return {"CUDA_VISIBLE_DEVICES": ""}
    return {"CUDA_VISIBLE_DEVICES": physical or str(gpu), "OMNI_GPU_ID": str(gpu)}


def _gpu_of(placement: Placement, stage: StageConfig, replica: int, rank: int) -> int | None:
    ids = placement[stage.name]
    return ids[rank] if len(ids) == stage.tp_size else ids[replica * stage.tp_size + rank]


def build_processes(
    cfg: PipelineConfig,
    placement: Placement,
    *,
    cores: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[ProcessSpec]:
    """One spec per process: shared-process groups, replicas, and one process per TP rank.

    ``environ`` is the operator's environment (only ``CUDA_VISIBLE_DEVICES`` is read; None: an
    empty one). ``cores`` defaults to this machine's CPU count; each process gets
    ``cores // processes`` threads unless its stage sets ``threads``."""
    cores = cores or os.cpu_count() or 1
    visible = visible_devices(environ or {})
    groups = _groups(cfg)
    count = sum(s[0].replicas * s[0].tp_size for s in groups.values())
    procs: list[ProcessSpec] = []
    for group, stages in groups.items():
        head = stages[0]
        threads = head.threads or _default_threads(count, cores)
        env = config_env(cfg, head, threads)
        path = f"stages[{cfg.stage_names.index(head.name)}].gpu"
        for replica in range(head.replicas):
            base = group if head.replicas == 1 else f"{group}#{replica}"
            leader = None
            for rank in range(head.tp_size):
                gpu = _gpu_of(placement, head, replica, rank)
                physical = None if gpu is None else physical_gpu(gpu, visible, stage=head.name, path=path)
                name = base if head.tp_size == 1 else f"{base}.{rank}"
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
                        forced_env=forced_env(gpu, physical),
                        threads=threads,
                        leader=leader,
                        physical_gpu=physical,
                    )
                )
                leader = leader or name
    return procs


def _best_relay(registry: Registry, device: str) -> tuple[int, str] | None:
    """``(priority, name)`` of the highest-priority registered relay that moves ``device``
    tensors between processes of one node (ties: the first name in order).

    Decided from the capabilities each relay declared when it was registered: no relay module
    is imported (a relay registered lazily without capabilities is never chosen by ``auto``)."""
    best: tuple[int, str] | None = None
    for entry in registry.entries("relay"):
        caps = entry.capabilities
        if caps is None or device not in caps.devices or "node" not in caps.scopes:
            continue
        if best is None or caps.priority > best[0]:
            best = (caps.priority, entry.name)
    return best


def choose_relay(cfg: PipelineConfig, src: StageConfig, registry: Registry, *, local: bool,
                 gpus: tuple[bool, bool] = (False, False)) -> str:
    """The relay of an edge leaving ``src``.

    ``object`` inside one process; else the stage's or the pipeline's forced backend; else
    (``auto``): when both ends run on GPUs, the best relay for CUDA tensors that is better than
    staging through host memory (e.g. ``cuda_ipc``, ``nccl`` when installed); otherwise the best
    relay for host tensors (``shm``, else ``inline``). ``gpus`` says whether the source and the
    target are placed on a GPU."""
    if local:
        return OBJECT_RELAY
    relay_cfg = src.relay or cfg.relay
    if relay_cfg.backend != "auto":
        return relay_cfg.backend
    host = _best_relay(registry, "cpu")
    if host is None:
        raise LookupError("no installed relay can move tensors between processes; is omni-core installed correctly?")
    if all(gpus):
        device = _best_relay(registry, "cuda")
        if device is not None and device[0] > host[0]:
            return device[1]
    return host[1]


def build_edges(cfg: PipelineConfig, processes: Sequence[ProcessSpec], registry: Registry) -> list[EdgeSpec]:
    on_gpu = {stage: proc.gpu is not None for proc in processes if proc.is_leader for stage in proc.stages}
    edges = []
    for stage in cfg.stages:
        for kind, targets in (("next", stage.next), ("stream", stage.stream_to)):
            for dst in targets:
                if kind == "stream" and dst == CALLER_STAGE:  # the caller's stream: no edge between stages
                    continue
                dst_cfg = cfg.stage(dst)
                local = (
                    stage.process is not None
                    and stage.process == dst_cfg.process
                    and stage.tp_size == 1
                    and stage.replicas == 1
                )
                gpus = (on_gpu.get(stage.name, False), on_gpu.get(dst, False))
                edges.append(EdgeSpec(stage.name, dst, kind, choose_relay(cfg, stage, registry, local=local, gpus=gpus), local))
    return edges


def resolve_devices(
    cfg: PipelineConfig, *, gpus: int | None = None, devices: Sequence[Device] | None = None
) -> tuple[tuple[Device, ...], bool]:
    """The devices to plan for and whether they are simulated: ``devices`` when given, else
    ``gpus`` simulated ones, else ``placement.gpus`` simulated ones, else what torch sees.
    Simulated devices have ``placement.memory_per_gpu`` bytes (None: unknown)."""
    if devices is not None:
        return tuple(devices), False
    count = gpus if gpus is not None else cfg.placement.gpus
    if count is not None:
        return simulated_devices(count, cfg.placement.memory_per_gpu), True
    return detect_devices(cfg.placement.memory_per_gpu), False


def build_plan(
    cfg: PipelineConfig,
    registry: Registry,
    *,
    gpus: int | None = None,
    devices: Sequence[Device] | None = None,
    cores: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Plan:
    """The whole plan of a validated config. ``gpus`` simulates that many devices (else
    ``placement.gpus``, else what torch sees); ``devices`` gives them explicitly (tests).
    ``environ`` is the operator's environment, read for ``CUDA_VISIBLE_DEVICES`` (None: this
    process's ``os.environ``). Raises ConfigError when the placement is invalid."""
    devices, simulated = resolve_devices(cfg, gpus=gpus, devices=devices)
    placement = place(cfg, registry, devices)
    request = request_from_config(cfg, devices)
    environ = os.environ if environ is None else environ
    processes = build_processes(cfg, placement, cores=cores, environ=environ)
    edges = build_edges(cfg, processes, registry)
    return Plan(
        config=cfg,
        processes=tuple(processes),
        edges=tuple(edges),
        placement=placement,
        devices=devices,
        warnings=tuple(placement_warnings(request, placement)),
        loads=gpu_loads(request, placement),
        simulated=simulated,
    )


def endpoints(plan: Plan, runtime_dir: str) -> Mapping[str, str]:
    """The zmq address each process (and the coordinator, key ``""``) binds its inbox to."""
    out = {"": f"ipc://{runtime_dir}/coordinator"}
    for i, proc in enumerate(plan.processes):
        out[proc.name] = f"ipc://{runtime_dir}/p{i}"
    return out


# -- many machines -----------------------------------------------------------------------------------


def senders(plan: Plan) -> dict[str, set[str]]:
    """Who sends control messages to whom: receiver → the processes (``""``: the coordinator)
    that may send to it. The coordinator talks to every process and hears from every process;
    the processes at the two ends of an edge talk both ways (payloads and chunks one way,
    stream credits back); a TP leader and its followers talk both ways."""
    out: dict[str, set[str]] = {"": {p.name for p in plan.processes}}
    for proc in plan.processes:
        out[proc.name] = {""}
    for edge in plan.edges:
        if edge.local:
            continue
        for dst in plan.processes_of(edge.dst):
            for src in plan.processes_of(edge.src):
                if src != dst:
                    out[dst].add(src)
                    out[src].add(dst)
    for proc in plan.processes:
        if proc.leader is not None:
            out[proc.name].add(proc.leader)
            out[proc.leader].add(proc.name)
    return out


def tcp_receivers(plan: Plan, nodes: Mapping[str, str]) -> set[str]:
    """The inboxes that need a tcp endpoint: those with a sender on another node. ``nodes`` maps
    every process name, and ``""`` for the coordinator, to its node."""
    return {r for r, s in senders(plan).items() if any(nodes[x] != nodes[r] for x in s)}


def endpoint_views(plan: Plan, runtime_dir: str, nodes: Mapping[str, str],
                   tcp: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """The address map each process (and the coordinator, ``""``) uses: a peer on its own node by
    ipc, a peer on another node by that peer's tcp address (``tcp``, from :func:`tcp_receivers`'
    inboxes). Processes on one node keep ipc even in a run that spans machines."""
    ipc = endpoints(plan, runtime_dir)
    views: dict[str, dict[str, str]] = {}
    for viewer in ipc:
        view = {}
        for name, address in ipc.items():
            if nodes[name] == nodes[viewer]:
                view[name] = address
            elif name in tcp:
                view[name] = tcp[name]
            else:
                # This viewer never sends to it (see senders()): an address that fails loudly if used.
                view[name] = f"{UNREACHABLE}{name}"
        views[viewer] = view
    return views


def cross_node_relay(cfg: PipelineConfig, src: StageConfig, registry: Registry) -> str:
    """The relay of an edge whose ends run on different nodes: the stage's or the pipeline's
    forced backend when it declares the ``cluster`` scope (a ConfigError otherwise); under
    ``auto``, the highest-priority installed relay that declares it (``inline``, zmq frames over
    the tcp control plane, unless a network relay plugin ranks higher)."""
    relay_cfg = src.relay or cfg.relay
    if relay_cfg.backend != "auto":
        caps = relay_capabilities(registry, relay_cfg.backend)  # registration's word, else class's
        if caps is None or "cluster" not in caps.scopes:
            path = f"stages[{cfg.stage_names.index(src.name)}].relay" if src.relay else "relay"
            raise ConfigError([ConfigIssue(
                path, f"relay {relay_cfg.backend!r} cannot cross nodes, but stage {src.name!r} sends to a stage on another node",
                "use 'relay: auto' (inline across nodes), a relay that declares the 'cluster' scope, or pin both stages to one node")])
        return relay_cfg.backend
    best: tuple[int, str] | None = None
    for entry in registry.entries("relay"):  # registration metadata: no relay module is imported
        caps = entry.capabilities
        if caps is not None and "cluster" in caps.scopes and (best is None or caps.priority > best[0]):
            best = (caps.priority, entry.name)
    return best[1] if best else "inline"


def _cost(registry: Registry, relay: str) -> float | None:
    """The measured cost per MiB across nodes that ``relay`` declared at registration."""
    caps = relay_capabilities(registry, relay)
    return None if caps is None else caps.ms_per_mib


def place_on_nodes(plan: Plan, nodes: Mapping[str, str], registry: Registry) -> Plan:
    """``plan`` once its processes are on ``nodes`` (process name → node; ``""`` the
    coordinator's): every edge between processes on different nodes is marked and takes
    :func:`cross_node_relay`."""
    edges = []
    for edge in plan.edges:
        ends = {nodes[p] for p in plan.processes_of(edge.src) + plan.processes_of(edge.dst)}
        if edge.local or len(ends) == 1:
            edges.append(edge)
            continue
        relay = cross_node_relay(plan.config, plan.config.stage(edge.src), registry)
        edges.append(attrs.evolve(edge, relay=relay, crosses_nodes=True, ms_per_mib=_cost(registry, relay)))
    return attrs.evolve(plan, edges=tuple(edges), nodes=dict(nodes))

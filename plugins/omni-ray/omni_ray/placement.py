"""Placement ``ray``: processes to the nodes (and GPUs) of a Ray cluster.

Two halves:

- :func:`ray_placement`, the registered strategy, gives every stage and rank its GPU id exactly as
  ``pack`` does (fill a GPU up to its memory budget before the next; TP ranks on distinct GPUs),
  so the plan's memory checks and warnings are the usual ones.
- :func:`assign_nodes` puts every process on a node of an :class:`Inventory` (the live cluster's,
  or a described one from a ``cluster.yaml``) with the same memory model per node GPU: processes
  that share a ``process`` are one process; the ranks of a TP replica land on one node (distinct
  GPUs); replicas of a stage are spread over the nodes that can hold them (round robin from a
  different node each); a stage's ``launch.resources`` restrict it to nodes that have them;
  CPU processes need ``num_cpus`` free logical CPUs. The ``ray`` launcher pins each actor to its
  node when the config uses this strategy; ``omni plan --launcher ray --cluster cluster.yaml``
  shows the result without a cluster.

A ``cluster.yaml``::

    nodes:
      - {name: head, cpus: 8}
      - {name: gpu-a, cpus: 32, gpus: 4, gpu_memory: 85899345920, resources: {node_a: 1}}
      - {name: gpu-b, cpus: 32, gpus: 4, gpu_memory: 85899345920, resources: {node_b: 1}}
    driver: head        # where the coordinator runs (default: the first node)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from omni_core.errors import ConfigError, ConfigIssue
from omni_core.plan.placement import PlacementRequest, pack

DEFAULT_GPU_SHARE = 0.9  # what a GPU stage without ``memory`` counts as on a node GPU (like pack)


def ray_placement(request: PlacementRequest):
    """GPU ids per stage and rank, as ``pack`` (see the module docstring)."""
    return pack(request)


@attrs.frozen
class Node:
    """One node: logical CPUs, GPUs (each ``gpu_memory`` bytes; None: unknown), custom resources."""

    name: str
    cpus: float = 1
    gpus: int = 0
    gpu_memory: float | None = None
    resources: dict[str, float] = attrs.field(factory=dict)
    node_id: str | None = None


@attrs.frozen
class Inventory:
    nodes: tuple[Node, ...]
    driver: str

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)


_NODE_KEYS = {"name", "cpus", "gpus", "gpu_memory", "resources"}


def load_inventory(source: str | Mapping[str, Any]) -> Inventory:
    """An inventory from a ``cluster.yaml`` path or the same mapping (see the module docstring)."""
    path = source if isinstance(source, str) else "cluster"
    if isinstance(source, str):
        import yaml

        with open(source) as f:
            source = yaml.safe_load(f) or {}
    issues = []
    if not isinstance(source, Mapping) or not isinstance(source.get("nodes"), list) or not source["nodes"]:
        raise ConfigError([ConfigIssue(f"{path}: nodes", "expected a non-empty list of nodes",
                                       "e.g. 'nodes: [{name: head, cpus: 8}, {name: a, gpus: 2, resources: {node_a: 1}}]'")])
    nodes = []
    for i, raw in enumerate(source["nodes"]):
        where = f"{path}: nodes[{i}]"
        if not isinstance(raw, Mapping) or "name" not in raw:
            issues.append(ConfigIssue(where, "a node needs at least a name"))
            continue
        unknown = sorted(set(raw) - _NODE_KEYS)
        if unknown:
            issues.append(ConfigIssue(f"{where}.{unknown[0]}", f"unknown node field(s) {', '.join(unknown)}",
                                      f"known: {', '.join(sorted(_NODE_KEYS))}"))
            continue
        nodes.append(Node(str(raw["name"]), float(raw.get("cpus", 1)), int(raw.get("gpus", 0)),
                          raw.get("gpu_memory"), {str(k): float(v) for k, v in (raw.get("resources") or {}).items()}))
    if issues:
        raise ConfigError(issues)
    driver = str(source.get("driver", nodes[0].name))
    if driver not in {n.name for n in nodes}:
        raise ConfigError([ConfigIssue(f"{path}: driver", f"names no node: {driver!r}")])
    return Inventory(tuple(nodes), driver)


def live_inventory() -> Inventory:
    """The alive nodes of the Ray cluster this process is connected to; the driver's node first
    (named by IP; several nodes on one IP get ``#n``)."""
    import ray

    me = ray.get_runtime_context().get_node_id()
    nodes, seen = [], {}
    for raw in sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeID"] != me):
        res = dict(raw["Resources"])
        ip = raw["NodeManagerAddress"]
        seen[ip] = seen.get(ip, 0) + 1
        name = ip if seen[ip] == 1 else f"{ip}#{seen[ip]}"
        custom = {k: v for k, v in res.items() if k not in ("CPU", "GPU", "memory", "object_store_memory")
                  and not k.startswith(("node:", "accelerator_type:"))}
        nodes.append(Node(name, res.get("CPU", 0), int(res.get("GPU", 0)), None, custom, raw["NodeID"]))
    return Inventory(tuple(nodes), nodes[0].name)


@attrs.frozen
class ActorRequest:
    """What one process asks Ray for (from its placement and its stage's ``launch:``)."""

    num_cpus: float
    num_gpus: float
    resources: dict[str, float]


def actor_request(plan: Any, spec: Any) -> ActorRequest:
    """CPU processes ask for ``num_cpus`` = their thread count; GPU processes for one GPU. A
    stage's ``launch:`` overrides both and adds custom resources (for a TP stage, on rank 0 only:
    the placement group keeps the ranks together)."""
    launch = plan.config.stage(spec.stages[0]).launch
    cpus = float(launch.get("num_cpus", spec.threads if spec.gpu is None else 1))
    gpus = float(launch.get("num_gpus", 0 if spec.gpu is None else 1))
    resources = dict(launch.get("resources", {})) if spec.tp_rank == 0 else {}
    return ActorRequest(cpus, gpus, {k: float(v) for k, v in resources.items()})


@attrs.define
class _Free:
    cpus: float
    gpus: list[float]  # free share of each GPU (1.0 = empty)
    resources: dict[str, float]


def _demand(plan: Any, spec: Any) -> tuple[float, float, dict[str, float]]:
    stage = plan.config.stage(spec.stages[0])
    req = actor_request(plan, spec)
    share = 0.0
    if spec.gpu is not None:
        memory = stage.memory
        share = DEFAULT_GPU_SHARE if memory is None else (memory if memory <= 1 else None)
    return req.num_cpus, share, dict(req.resources) if spec.tp_rank == 0 else {}


def assign_nodes(plan: Any, inventory: Inventory) -> dict[str, str]:
    """Process name → node name (``""`` → the driver's node). A ConfigError names each process
    that fits nowhere and what it asks for."""
    free = {n.name: _Free(n.cpus, [1.0] * n.gpus, dict(n.resources)) for n in inventory.nodes}
    gpu_bytes = {n.name: n.gpu_memory for n in inventory.nodes}
    order = [n.name for n in inventory.nodes]
    out: dict[str, str] = {"": inventory.driver}
    issues = []
    units: dict[tuple[str, int], list[Any]] = {}
    for spec in plan.processes:
        units.setdefault((spec.group, spec.replica), []).append(spec)
    for (group, replica), ranks in units.items():
        start = replica % len(order)
        rotated = order[start:] + order[:start]
        # Spread replicas: nodes holding fewer replicas of this group first.
        hosted = [out.get(s.name) for (g, _), specs in units.items() if g == group for s in specs[:1]]
        rotated.sort(key=lambda node: hosted.count(node))
        chosen = None
        for node in rotated:
            plan_for = _fit(plan, ranks, free[node], gpu_bytes[node])
            if plan_for is not None:
                chosen = node
                _take(free[node], plan_for)
                break
        if chosen is None:
            wants = [_demand(plan, s) for s in ranks]
            path = f"stages[{plan.config.stage_names.index(ranks[0].stages[0])}].launch"
            issues.append(ConfigIssue(path, f"process group {group!r} replica {replica} ({len(ranks)} process(es): "
                                            f"cpus {sum(w[0] for w in wants):g}, gpus {sum(1 for w in wants if w[1])}, "
                                            f"resources {wants[0][2] or '{}'}) fits on no node of the cluster",
                                      "add a node, lower launch.num_cpus or the stage's memory, or check launch.resources"))
            continue
        for spec in ranks:
            out[spec.name] = chosen
    if issues:
        raise ConfigError(issues)
    return out


def _fit(plan: Any, ranks: Sequence[Any], free: _Free, gpu_bytes: float | None) -> list[tuple[float, int | None, float, dict]] | None:
    """How the processes of one unit would take resources on a node (None: they do not fit)."""
    cpus = free.cpus
    gpus = list(free.gpus)
    resources = dict(free.resources)
    takes = []
    for spec in ranks:
        need_cpus, share, res = _demand(plan, spec)
        if share is None:  # memory in bytes
            memory = plan.config.stage(spec.stages[0]).memory
            share = memory / gpu_bytes if gpu_bytes else DEFAULT_GPU_SHARE
        if need_cpus > cpus + 1e-9 or any(resources.get(k, 0) + 1e-9 < v for k, v in res.items()):
            return None
        gpu = None
        if spec.gpu is not None:
            used = {t[1] for t in takes if t[1] is not None}
            gpu = next((i for i, left in enumerate(gpus) if i not in used and left + 1e-9 >= share), None)
            if gpu is None:
                return None
            gpus[gpu] -= share
        cpus -= need_cpus
        for k, v in res.items():
            resources[k] -= v
        takes.append((need_cpus, gpu, share, res))
    return takes


def _take(free: _Free, takes: list[tuple[float, int | None, float, dict]]) -> None:
    for cpus, gpu, share, res in takes:
        free.cpus -= cpus
        if gpu is not None:
            free.gpus[gpu] -= share
        for k, v in res.items():
            free.resources[k] -= v

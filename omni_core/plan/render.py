"""A plan as people read it: plain data (JSON), a text report, a mermaid or graphviz graph.

Pure functions of a :class:`~omni_core.plan.topology.Plan`; what ``omni plan`` prints. Endpoints
are shown under :data:`RUNTIME_DIR`, a placeholder for the private directory a run creates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..config.schema import CALLER_STAGE
from .placement import GpuLoad, amount_text, default_memory, gib, percent
from .topology import OBJECT_RELAY, EdgeSpec, Plan, ProcessSpec, endpoints

#: Stands for the run's private runtime directory in printed endpoints.
RUNTIME_DIR = "<runtime_dir>"

#: How reports name the coordinator's endpoint (key ``""`` of :func:`endpoints`).
COORDINATOR = "coordinator"


def _endpoints(plan: Plan) -> tuple[str, dict[str, str]]:
    """The coordinator's address and each process's, under :data:`RUNTIME_DIR`."""
    addresses = dict(endpoints(plan, RUNTIME_DIR))
    return addresses.pop(""), addresses


def _share(plan: Plan, stage: str, gpu: int | None) -> tuple[float, bool] | None:
    load = next((ld for ld in plan.loads if ld.device.index == gpu), None)
    holder = next((h for h in load.holders if h.stage == stage), None) if load else None
    return None if holder is None else (holder.share, holder.declared)


def _process_of(plan: Plan, stage: str, replica: int, rank: int) -> ProcessSpec:
    return next(
        p for p in plan.processes if stage in p.stages and p.replica == replica and p.tp_rank == rank
    )


def placement_rows(plan: Plan) -> list[dict[str, Any]]:
    """One row per stage, replica and rank: its GPU (None: CPU), its share of that GPU, whether
    the stage declared it, and the process that runs it."""
    rows = []
    for stage in plan.config.stages:
        for replica in range(stage.replicas):
            for rank in range(stage.tp_size):
                proc = _process_of(plan, stage.name, replica, rank)
                share = _share(plan, stage.name, proc.gpu)
                rows.append({
                    "stage": stage.name,
                    "replica": replica,
                    "rank": rank,
                    "gpu": proc.gpu,
                    "memory": None if share is None else round(share[0], 6),
                    "memory_declared": None if share is None else share[1],
                    "process": proc.name,
                })
    return rows


def _device_dict(plan: Plan, load: GpuLoad) -> dict[str, Any]:
    return {
        "id": load.device.index,
        "memory": load.device.memory,
        "used": round(load.total, 6),
        "declared": round(load.declared, 6),
        "stages": [{"label": h.label, "stage": h.stage, "memory": round(h.share, 6), "declared": h.declared}
                   for h in load.holders],
    }


def _process_dict(proc: ProcessSpec, endpoint: str) -> dict[str, Any]:
    return {
        "name": proc.name,
        "group": proc.group,
        "stages": list(proc.stages),
        "replica": proc.replica,
        "tp_rank": proc.tp_rank,
        "tp_size": proc.tp_size,
        "leader": proc.leader,
        "gpu": proc.gpu,
        "device": proc.device,
        "cuda_visible_devices": proc.forced_env.get("CUDA_VISIBLE_DEVICES"),
        "threads": proc.threads,
        "env": dict(proc.env),
        "forced_env": dict(proc.forced_env),
        "endpoint": endpoint,
    }


def plan_dict(plan: Plan) -> dict[str, Any]:
    """The plan as JSON-ready data (the shape of ``omni plan --json``)."""
    coordinator, addresses = _endpoints(plan)
    cfg = plan.config
    return {
        "pipeline": cfg.name,
        "strategy": cfg.placement.strategy,
        "devices": {"count": len(plan.devices), "simulated": plan.simulated,
                    "gpus": [_device_dict(plan, load) for load in plan.loads]},
        "placement": placement_rows(plan),
        "process_groups": [
            {"name": g, "stages": list(plan.group(g)[0].stages), "processes": [p.name for p in plan.group(g)]}
            for g in plan.groups
        ],
        "processes": [_process_dict(p, addresses[p.name]) for p in plan.processes],
        "edges": [{"src": e.src, "dst": e.dst, "kind": e.kind, "relay": e.relay, "local": e.local}
                  for e in plan.edges],
        "caller_streams": _caller_streams(plan),
        "endpoints": {COORDINATOR: coordinator, "processes": addresses},
        "warnings": list(plan.warnings),
        **_nodes_dict(plan),
    }


def _nodes_dict(plan: Plan) -> dict[str, Any]:
    """With a multi-node launcher: the node of each process and the edges that cross nodes."""
    if not plan.nodes:
        return {}
    return {"nodes": {COORDINATOR if k == "" else k: v for k, v in plan.nodes.items()},
            "crossing_edges": [{"src": e.src, "dst": e.dst, "kind": e.kind, "relay": e.relay,
                                "ms_per_mib": e.ms_per_mib}
                               for e in plan.edges if e.crosses_nodes]}


# -- text ----------------------------------------------------------------------------------------


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> list[str]:
    """Left-aligned columns, two spaces apart; None shows as ``-``."""
    cells = [list(header)] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]


def _devices_line(plan: Plan) -> str:
    count = len(plan.devices)
    if not count:
        return "no GPU (every stage on the CPU)"
    memories = {d.memory for d in plan.devices}
    only = next(iter(memories)) if len(memories) == 1 else None
    size = "memory unknown" if memories == {None} else (f"{gib(only)} each" if only is not None else "memory varies")
    how = "simulated" if plan.simulated else "detected"
    return f"{count} GPU{'s' if count != 1 else ''} ({how}, {size})"


def _memory_cell(row: dict[str, Any]) -> str | None:
    if row["memory"] is None:
        return None
    return percent(row["memory"]) + ("" if row["memory_declared"] else "*")


def _gpu_line(load: GpuLoad) -> list[Any]:
    parts = ", ".join(f"{h.label} {percent(h.share)}{'' if h.declared else '*'}" for h in load.holders)
    return [f"GPU {load.device.index}", percent(load.total), parts or "(idle)"]


def _relay_text(edge: EdgeSpec) -> str:
    return f"{OBJECT_RELAY} (same process)" if edge.relay == OBJECT_RELAY else edge.relay


def render_text(plan: Plan) -> str:
    """The report ``omni plan`` prints: placement, GPUs, process groups, processes, edges,
    endpoints, warnings."""
    cfg = plan.config
    rows = placement_rows(plan)
    lines = [f"pipeline {cfg.name!r}: strategy {cfg.placement.strategy}, {_devices_line(plan)}", "", "placement"]
    lines += table(["stage", "replica", "rank", "gpu", "memory", "process"],
                   [[r["stage"], r["replica"], r["rank"], r["gpu"], _memory_cell(r), r["process"]] for r in rows])
    if any(r["memory_declared"] is False for r in rows):
        default = amount_text(default_memory(cfg.placement.options))
        lines.append(f"  * no memory set: counted as the default share ({default})")
    if plan.loads:
        lines += ["", "gpus"] + table(["gpu", "used", "stages"], [_gpu_line(ld) for ld in plan.loads])
    lines += ["", "process groups"] + table(
        ["group", "stages", "processes"],
        [[g, ", ".join(plan.group(g)[0].stages), ", ".join(p.name for p in plan.group(g))] for g in plan.groups])
    lines += ["", "processes"] + table(
        ["process", "gpu", "device", "CUDA_VISIBLE_DEVICES", "threads", "leader"],
        [[p.name, p.gpu, p.device, repr(p.forced_env.get("CUDA_VISIBLE_DEVICES", "")), p.threads, p.leader]
         for p in plan.processes])
    if plan.nodes:
        return _render_nodes(plan, lines)
    lines += ["", "edges"] + table(
        ["from", "to", "kind", "relay"], [[e.src, e.dst, e.kind, _relay_text(e)] for e in plan.edges]
        + [[s, f"({CALLER_STAGE})", "stream", "to the caller"] for s in _caller_streams(plan)])
    coordinator, addresses = _endpoints(plan)
    lines += ["", "endpoints"] + table(["process", "address"], [[f"({COORDINATOR})", coordinator], *addresses.items()])
    lines += ["", "warnings"] + ([f"  - {w}" for w in plan.warnings] or ["  (none)"])
    return "\n".join(lines) + "\n"


def _cost_text(edge: EdgeSpec) -> str | None:
    if not edge.crosses_nodes:
        return None
    return "not measured" if edge.ms_per_mib is None else f"{edge.ms_per_mib:g} ms"


def _render_nodes(plan: Plan, lines: list[str]) -> str:
    """The end of the report for a plan on several nodes: nodes, edges (crossing or not) and
    which endpoints are tcp."""
    from .topology import tcp_receivers

    nodes = plan.nodes
    tcp = tcp_receivers(plan, nodes)
    lines += ["", "nodes"] + table(["process", "node"], [[f"({COORDINATOR})", nodes[""]], *[[p.name, nodes[p.name]] for p in plan.processes]])
    lines += ["", "edges"] + table(
        ["from", "to", "kind", "relay", "crosses nodes", "cost per MiB (bench)"],
        [[e.src, e.dst, e.kind, _relay_text(e), "yes" if e.crosses_nodes else "no", _cost_text(e)]
         for e in plan.edges])
    if any(e.crosses_nodes for e in plan.edges):
        lines.append("  cost: what the relay's benchmark measured between two nodes (docs/performance/relays.md); "
                     "'not measured' when the relay declares none")
    coordinator, addresses = _endpoints(plan)
    rows = [[f"({COORDINATOR})", coordinator, "tcp + CurveZMQ (port chosen at start)" if "" in tcp else "-"]]
    rows += [[n, a, "tcp + CurveZMQ (port chosen at start)" if n in tcp else "-"] for n, a in addresses.items()]
    lines += ["", "endpoints (ipc on the node; tcp for senders on other nodes)"] + table(["process", "ipc", "tcp"], rows)
    lines += ["", "warnings"] + ([f"  - {w}" for w in plan.warnings] or ["  (none)"])
    return "\n".join(lines) + "\n"


# -- graphs --------------------------------------------------------------------------------------


def group_label(plan: Plan, group: str) -> str:
    """``thinker · tp 2 · GPU 0, 1``: a process group with what sets it apart and where it runs."""
    procs = plan.group(group)
    head = procs[0]
    parts = [group]
    if head.tp_size > 1:
        parts.append(f"tp {head.tp_size}")
    replicas = len({p.replica for p in procs})
    if replicas > 1:
        parts.append(f"{replicas} replicas")
    gpus = list(dict.fromkeys(p.gpu for p in procs if p.gpu is not None))
    parts.append(("GPU " if len(gpus) == 1 else "GPUs ") + ", ".join(map(str, gpus)) if gpus else "CPU")
    return " · ".join(parts)


def _edge_label(edge: EdgeSpec) -> str:
    return edge.relay if edge.kind == "next" else f"stream: {edge.relay}"


def render_mermaid(plan: Plan) -> str:
    """A mermaid flowchart: one subgraph per process group, one node per stage, edges labelled
    with their relay (stream edges dotted); the caller's input and outputs as round nodes."""
    ids = {name: f"s{i}" for i, name in enumerate(plan.config.stage_names)}
    lines = ["flowchart LR", '  input(["input"])', '  output(["output"])']
    for i, group in enumerate(plan.groups):
        lines.append(f'  subgraph g{i}["{mermaid_text(group_label(plan, group))}"]')
        lines += [f'    {ids[s]}["{mermaid_text(s)}"]' for s in plan.group(group)[0].stages]
        lines.append("  end")
    lines.append(f"  input --> {ids[plan.config.entry]}")
    for edge in plan.edges:
        arrow = "-->" if edge.kind == "next" else "-.->"
        lines.append(f"  {ids[edge.src]} {arrow}|{mermaid_text(_edge_label(edge))}| {ids[edge.dst]}")
    lines += [f"  {ids[s]} --> output" for s in plan.config.terminal_stages]
    lines += [f"  {ids[s]} -.->|stream| output" for s in _caller_streams(plan)]
    return "\n".join(lines) + "\n"


def _caller_streams(plan: Plan) -> list[str]:
    """The non-terminal stages streaming to the caller (``stream_to: [caller]``)."""
    return [s.name for s in plan.config.stages if not s.terminal and CALLER_STAGE in s.stream_to]


def mermaid_text(text: str) -> str:
    return text.replace('"', "#quot;").replace("|", "#124;")


def render_dot(plan: Plan) -> str:
    """A graphviz digraph: one cluster per process group, edges labelled with their relay
    (stream edges dashed); the caller's input and outputs as ellipses."""
    q = dot_text
    ids = {name: f"s{i}" for i, name in enumerate(plan.config.stage_names)}
    lines = [f"digraph {q(plan.config.name)} {{", "  rankdir=LR;", "  node [shape=box];",
             "  input [shape=ellipse];", "  output [shape=ellipse];"]
    for i, group in enumerate(plan.groups):
        lines.append(f"  subgraph cluster_{i} {{")
        lines.append(f"    label={q(group_label(plan, group))};")
        lines += [f"    {ids[s]} [label={q(s)}];" for s in plan.group(group)[0].stages]
        lines.append("  }")
    lines.append(f"  input -> {ids[plan.config.entry]};")
    for edge in plan.edges:
        style = "" if edge.kind == "next" else ", style=dashed"
        lines.append(f"  {ids[edge.src]} -> {ids[edge.dst]} [label={q(_edge_label(edge))}{style}];")
    lines += [f"  {ids[s]} -> output;" for s in plan.config.terminal_stages]
    lines.append("}")
    return "\n".join(lines) + "\n"


def dot_text(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

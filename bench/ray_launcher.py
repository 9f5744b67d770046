"""ray: the cost of the ``ray`` launcher (plugin omni-ray), side by side with the local launcher.

One local Ray cluster (``ray.cluster_utils.Cluster``: a head and one worker node, each its own
raylet, on this machine) serves the whole scenario:

- hop and throughput of the 4-stage ``Echo`` chain, every stage on the head, under the ``ray``
  launcher vs the ``local`` launcher (ratio ray / local; one request at a time for the hop, 64 in
  flight for throughput). Same node, so both use ipc and ``shm``: the difference is where the
  processes come from (Ray actors vs forkserver children).
- a 64 MiB tensor from a stage on the head to a stage on the worker "node" (``inline``: zero-copy
  zmq frames over tcp with CurveZMQ) vs the same two stages on one node (``shm``), both under the
  ``ray`` launcher (ratio of request times).

Run ``python -m bench --scenario ray`` (needs ``pip install ./plugins/omni-ray``).
"""

from __future__ import annotations

import time
from typing import Any

from . import common
from .stages import chain, source_sink

NAME = "ray"
PAYLOAD = {"text": "hello world", "x": 1, "ids": [1, 2, 3, 4]}
SIZES = {
    "quick": {"n": 4, "warmup": 20, "requests": 100, "rounds": 2, "in_flight": 64, "batches": 3,
              "nbytes": 64 * 2**20, "transfers": 5},
    "full": {"n": 4, "warmup": 100, "requests": 400, "rounds": 4, "in_flight": 64, "batches": 10,
             "nbytes": 64 * 2**20, "transfers": 20},
}
STORE = 100 * 2**20


def _pinned(cfg: dict[str, Any], resources: list[str], launcher: str) -> dict[str, Any]:
    cfg = {**cfg, "launcher": launcher}
    if launcher == "ray":
        cfg["stages"] = [{**s, "launch": {"resources": {r: 1}}} for s, r in zip(cfg["stages"], resources, strict=True)]
    return cfg


async def _hop(pipeline: Any, count: int, into: list[float] | None) -> None:
    for _ in range(count):
        t0 = time.perf_counter()
        await pipeline.submit(PAYLOAD)
        if into is not None:
            into.append(time.perf_counter() - t0)


async def _throughput(pipeline: Any, in_flight: int, batches: int) -> float:
    import asyncio

    t0 = time.perf_counter()
    for _ in range(batches):
        await asyncio.gather(*(pipeline.submit(PAYLOAD) for _ in range(in_flight)))
    return in_flight * batches / (time.perf_counter() - t0)


async def _transfer(pipeline: Any, nbytes: int, count: int, into: list[float] | None) -> None:
    for _ in range(count):
        t0 = time.perf_counter()
        out = await pipeline.submit({"nbytes": nbytes})
        if into is not None:
            into.append(time.perf_counter() - t0)
        if out["n"] != nbytes or out["last"] != 1:
            raise AssertionError(f"the tensor did not arrive whole: {out}")


def measure(params: dict[str, Any], loop: common.Loop) -> dict[str, Any]:
    from omni_core import Pipeline

    n = params["n"]
    pipes: dict[str, Any] = {}
    out: dict[str, Any] = {"rows": [], "edges": {}}
    try:
        for launcher in ("local", "ray"):
            cfg = _pinned(chain(n, name=f"bench-ray-{launcher}"), ["head"] * n, launcher)
            pipes[launcher] = Pipeline(cfg)
            loop.run(pipes[launcher].start())
            loop.run(_hop(pipes[launcher], params["warmup"], None))
        hop: dict[str, list[float]] = {k: [] for k in pipes}
        rps: dict[str, list[float]] = {k: [] for k in pipes}
        for order in common.rounds(list(pipes), params["rounds"]):
            for name in order:
                loop.run(_hop(pipes[name], params["requests"] // params["rounds"], hop[name]))
                rps[name].append(loop.run(_throughput(pipes[name], params["in_flight"], params["batches"])))
        for name in pipes:
            out["rows"].append({"case": f"chain of {n}", "launcher": name,
                                "hop_us": common.summarize(hop[name], 1e6 / (n + 1)),
                                "requests_per_s": max(rps[name])})
    finally:
        for p in pipes.values():
            loop.run(p.stop())
    pipes = {}
    try:
        for label, nodes in (("inline over tcp (across nodes)", ["head", "node_a"]), ("shm (one node)", ["head", "head"])):
            pipes[label] = p = Pipeline(_pinned(source_sink(name="bench-ray-tensor"), nodes, "ray"))
            loop.run(p.start())
            out["edges"][label] = [(e.relay, e.crosses_nodes) for e in p.plan.edges]
            loop.run(_transfer(p, params["nbytes"], 2, None))
        times: dict[str, list[float]] = {k: [] for k in pipes}
        for order in common.rounds(list(pipes), params["rounds"]):
            for name in order:
                loop.run(_transfer(pipes[name], params["nbytes"], max(1, params["transfers"] // params["rounds"]), times[name]))
        for name, t in times.items():
            s = common.summarize(t, 1e3)
            out["rows"].append({"case": f"{common.human_bytes(params['nbytes'])} tensor", "launcher": "ray", "edge": name,
                                "request_ms": s, "gb_per_s": params["nbytes"] / (s["median"] / 1e3) / 1e9})
    finally:
        for p in pipes.values():
            loop.run(p.stop())
    return out


def run(params: dict[str, Any], *, quick: bool, ray: bool) -> dict[str, Any]:
    import importlib.util
    import os
    from pathlib import Path

    doc = common.result(NAME, quick=quick, parameters={**params, "payload": PAYLOAD})
    doc["rows"], doc["ratios"], doc["checks"] = [], {}, {}
    if importlib.util.find_spec("omni_ray") is None:
        doc["notes"].append("skipped: omni-ray is not installed (pip install ./plugins/omni-ray)")
        return doc
    import ray as ray_module
    from ray.cluster_utils import Cluster

    root = str(Path(__file__).resolve().parent.parent)  # the actors import bench.stages
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 8, "resources": {"head": 16}, "object_store_memory": STORE, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=4, resources={"node_a": 4}, object_store_memory=STORE)
        cluster.wait_for_nodes()
        ray_module.init(address=cluster.address, namespace="omni-bench", log_to_driver=False)
        with common.Loop() as loop:
            measured = measure(params, loop)
    finally:
        ray_module.shutdown()
        cluster.shutdown()
    doc["rows"] = measured["rows"]
    doc["notes"].append(f"edges (relay, crosses nodes): {measured['edges']}")
    rows = {(r.get("edge") or r["launcher"]): r for r in doc["rows"]}
    local, on_ray = rows["local"], rows["ray"]
    cross, shm = rows["inline over tcp (across nodes)"], rows["shm (one node)"]
    doc["ratios"] = {
        "hop_median_ray_over_local": common.ratio(on_ray["hop_us"]["median"], local["hop_us"]["median"]),
        "throughput_ray_over_local": common.ratio(on_ray["requests_per_s"], local["requests_per_s"]),
        "tensor_request_time_cross_node_over_shm": common.ratio(cross["request_ms"]["median"], shm["request_ms"]["median"]),
    }
    doc["checks"] = {
        "the 64 MiB edge across nodes went inline": measured["edges"]["inline over tcp (across nodes)"] == [("inline", True)],
        "the 64 MiB edge on one node went through shm": measured["edges"]["shm (one node)"] == [("shm", False)],
    }
    return doc


def summary(doc: dict[str, Any]) -> str:
    if not doc["rows"]:
        return "(not run)"
    lines = []
    for r in doc["rows"]:
        if "hop_us" in r:
            lines.append([r["case"], r["launcher"], f"hop {common.fmt(r['hop_us']['median'])} µs",
                          f"{common.fmt(r['requests_per_s'])} req/s"])
        else:
            lines.append([r["case"], r["edge"], f"{common.fmt(r['request_ms']['median'])} ms", f"{common.fmt(r['gb_per_s'])} GB/s"])
    text = common.table(["case", "launcher / edge", "latency", "rate"], lines)
    return text + "\nratios: " + ", ".join(f"{k} {common.fmt(v)}" for k, v in doc["ratios"].items())


def plot(doc: dict[str, Any], path: str, plt: Any) -> None:
    if not doc["ratios"]:
        return
    fig, ax = plt.subplots(figsize=(6, 3))
    names = list(doc["ratios"])
    ax.barh(names, [doc["ratios"][k] or 0 for k in names])
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("ratio")
    ax.set_title("ray launcher vs local; cross-node inline vs shm")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

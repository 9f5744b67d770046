"""scale: latency and memory as the requests in flight and the payloads grow.

One ``Pipeline``, ``Source`` → ``Sink`` in two processes (default relay: shm). ``Source`` makes a
new tensor of the requested size at every call (a model returning new outputs), ``Sink`` reads it
and returns a few numbers. For each point a closed loop keeps ``inflight`` requests in flight for
``duration_s``; we record every request's latency and sample the memory of the whole process tree
(this process, the forkserver, the stage processes) every 50 ms: RSS summed, and PSS summed
(shared pages such as the shm pool and torch's libraries split among their users, so they count
once). Growth = peak during the point − idle before it.

Memory must stay bounded: it may grow with what the configuration bounds (stage
``max_concurrency`` outputs alive at once, the relay's credit pool) but not with the number of
requests in flight. The check compares growth at the stress point with ``inflight × payload``,
what holding every request's payload would take.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

from . import common
from .common import KiB, MiB

NAME = "scale"
SIZES = {
    "quick": {"points": [[1, 4 * KiB], [100, 4 * KiB], [1000, 4 * KiB], [16, 1 * MiB], [16, 64 * MiB], [1000, 1 * MiB]],
              "duration_s": 1.0, "warmup_s": 0.3},
    "full": {"points": [[1, 4 * KiB], [10, 4 * KiB], [100, 4 * KiB], [1000, 4 * KiB],
                        [16, 1 * MiB], [16, 16 * MiB], [16, 64 * MiB], [1000, 1 * MiB]],
             "duration_s": 4.0, "warmup_s": 1.0},
}
BOUND_FRACTION = 0.5


def _closed_loop(pipeline: Any, payload: dict, inflight: int, duration: float, into: list[float] | None) -> asyncio.Future:
    async def worker(end: float) -> None:
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            await pipeline.submit(payload)
            if into is not None:
                into.append(time.perf_counter() - t0)

    async def go() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(t0 + duration) for _ in range(inflight)))
        return time.perf_counter() - t0

    return go()


def run(params: dict[str, Any], *, quick: bool, ray: bool) -> dict[str, Any]:
    from omni_core import Pipeline

    from .stages import source_sink

    doc = common.result(NAME, quick=quick, parameters=params)
    pipeline = Pipeline(source_sink(fresh=True, name="bench-scale"))
    max_concurrency = 64  # StageConfig default, what bounds the outputs alive in Source
    with common.Loop() as loop, common.MemorySampler(0.05) as mem:
        loop.run(pipeline.start())
        try:
            settle = params.get("settle_s", 0.3)  # let memory settle before reading "idle"
            time.sleep(settle)
            start_idle = common.tree_memory()
            for inflight, nbytes in params["points"]:
                common.log(f"scale: {inflight} in flight, {common.human_bytes(nbytes)} payloads")
                payload = {"nbytes": nbytes}
                loop.run(_closed_loop(pipeline, payload, min(inflight, 64), params["warmup_s"], None))
                gc.collect()
                time.sleep(settle)
                idle = common.tree_memory()
                mem.reset()
                lat: list[float] = []
                elapsed = loop.run(_closed_loop(pipeline, payload, inflight, params["duration_s"], lat))
                peak = mem.peak()
                held = inflight * nbytes
                doc["rows"].append({
                    "inflight": inflight, "bytes": nbytes, "requests": len(lat), "rps": len(lat) / elapsed,
                    "latency_ms": common.summarize(lat, 1e3),
                    "idle": idle, "peak": peak,
                    "growth_rss": peak["rss"] - idle["rss"], "growth_pss": peak["pss"] - idle["pss"],
                    "unbounded_bytes": held,
                    "growth_vs_unbounded": (peak["pss"] - idle["pss"]) / held,
                })
            gc.collect()
            time.sleep(settle)
            end_idle = common.tree_memory()
            doc["memory"] = {"start": start_idle, "end": end_idle, "retained_pss": end_idle["pss"] - start_idle["pss"]}
        finally:
            loop.run(pipeline.stop())
    base = next((r for r in doc["rows"] if r["inflight"] == 1), None)
    for r in doc["rows"]:
        key = f"{r['inflight']} x {common.human_bytes(r['bytes'])}"
        doc["ratios"][key] = {"p50 latency / 1 in flight": common.ratio(r["latency_ms"]["median"], base["latency_ms"]["median"]) if base else None,
                              "growth / (in flight x payload)": r["growth_vs_unbounded"]}
    stress = [r for r in doc["rows"] if r["inflight"] > max_concurrency and r["bytes"] >= MiB]
    for r in stress:
        doc["checks"][f"memory bounded at {r['inflight']} x {common.human_bytes(r['bytes'])}: growth < {BOUND_FRACTION} x in flight x payload"] = (
            r["growth_vs_unbounded"] < BOUND_FRACTION)
    return doc


def summary(doc: dict[str, Any]) -> str:
    headers = ["in flight", "payload", "req/s", "p50 ms", "p99 ms", "peak RSS MiB", "peak PSS MiB", "PSS growth MiB", "growth / (in flight × payload)"]
    # The ratio only says something where in flight x payload is large against the noise of
    # sampling a tree of processes (a few MiB).
    rows = [[r["inflight"], common.human_bytes(r["bytes"]), r["rps"], r["latency_ms"]["median"], r["latency_ms"]["p99"],
             r["peak"]["rss"] / MiB, r["peak"]["pss"] / MiB, r["growth_pss"] / MiB,
             r["growth_vs_unbounded"] if r["unbounded_bytes"] >= 64 * MiB else None] for r in doc["rows"]]
    text = "latency and memory (whole process tree) under load; closed loop per point\n" + common.table(headers, rows)
    if "memory" in doc:
        text += f"\nmemory retained after the sweep (PSS): {doc['memory']['retained_pss'] / MiB:.1f} MiB"
    return text


def plot(doc: dict[str, Any], path: str, plt: Any) -> None:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
    small = sorted((r for r in doc["rows"] if r["bytes"] == min(x["bytes"] for x in doc["rows"])), key=lambda r: r["inflight"])
    if small:
        xs = [r["inflight"] for r in small]
        a1.plot(xs, [r["latency_ms"]["median"] for r in small], "o-", label="p50 latency (ms)")
        a1.plot(xs, [r["latency_ms"]["p99"] for r in small], "o:", label="p99 latency (ms)")
        a1.plot(xs, [r["peak"]["pss"] / MiB for r in small], "s-", label="peak PSS of the tree (MiB)")
        a1.set_xscale("log")
        a1.set_yscale("log")
        a1.set_xlabel(f"requests in flight ({common.human_bytes(small[0]['bytes'])} payloads)")
        a1.set_title("scale: in flight")
        a1.grid(True, which="both", alpha=0.3)
        a1.legend(fontsize=8)
    big = sorted((r for r in doc["rows"] if r["bytes"] >= MiB), key=lambda r: (r["bytes"], r["inflight"]))
    if big:
        labels = [f"{r['inflight']}×{common.human_bytes(r['bytes']).replace(' ', '')}" for r in big]
        xs = range(len(big))
        a2.bar([x - 0.2 for x in xs], [r["growth_pss"] / MiB for r in big], 0.4, label="PSS growth (MiB)")
        a2.bar([x + 0.2 for x in xs], [r["unbounded_bytes"] / MiB for r in big], 0.4, label="in flight × payload (MiB)")
        a2.set_xticks(list(xs), labels, fontsize=8)
        a2.set_yscale("log")
        a2.set_title("scale: memory growth vs. holding every payload")
        a2.grid(True, axis="y", alpha=0.3)
        a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""throughput: requests/s of a 3-stage trivial pipeline at a fixed number of requests in flight.

Closed loop: ``concurrency`` requests are kept in flight for ``duration_s`` (a new one is sent as
soon as one completes), then the last ones drain; rate = completed / elapsed. omni (``Pipeline``
of 3 ``Echo`` stages, ``concurrency`` tasks calling ``submit``) runs side by side with the raw
pyzmq chain and the ``multiprocessing.Queue`` chain, pipelined to the same depth, in shuffled
rounds; the Ray Compiled Graph chain (optional peer) runs after them in its own process. CPU µs
per message of every process is read around every measured round (``bench/cpu.py``).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from . import common
from .baselines import QueueChain, ZmqChain
from .cpu import CpuAccount, CpuWindow, cpu_table
from .hop import LABELS, PAYLOAD

NAME = "throughput"
SIZES = {
    "quick": {"stages": 3, "concurrency": [1, 16, 64, 256], "warmup_s": 0.3, "duration_s": 1.0, "rounds": 2},
    "full": {"stages": 3, "concurrency": [1, 16, 64, 256], "warmup_s": 1.0, "duration_s": 3.0, "rounds": 4},
}
TARGET_AT_64 = 0.2  # x raw pyzmq
TARGET_AT_64_MPQ = 1.0  # x mp.Queue
TARGET_CPU_US = 20.0  # omni CPU per message per stage at 64 in flight


class OmniPipelined:
    def __init__(self, n: int, loop: common.Loop):
        from omni_core import Pipeline

        from .stages import chain

        self.loop = loop
        self.pipeline = Pipeline(chain(n, name=f"bench-throughput-{n}"))
        loop.run(self.pipeline.start())

    def pids(self) -> dict[str, int | None]:
        return self.pipeline.pids()

    def pipelined(self, payload: Any, concurrency: int, duration: float) -> tuple[int, float]:
        submit = self.pipeline.submit
        done = 0

        async def worker(end: float) -> None:
            nonlocal done
            while True:
                await submit(payload)
                done += 1
                if time.perf_counter() >= end:
                    return

        async def go() -> float:
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(t0 + duration) for _ in range(concurrency)))
            return time.perf_counter() - t0

        elapsed = self.loop.run(go())
        return done, elapsed

    def close(self) -> None:
        self.loop.run(self.pipeline.stop())


def measure(params: dict[str, Any], loop: common.Loop) -> list[dict[str, Any]]:
    n = params["stages"]
    chains: dict[str, Any] = {}
    rows = []
    try:
        chains["omni"] = OmniPipelined(n, loop)
        chains["zmq"] = ZmqChain(n)
        chains["mpq"] = QueueChain(n)
        for c in params["concurrency"]:
            common.log(f"throughput: {c} in flight")
            rates: dict[str, list[float]] = {k: [] for k in chains}
            cpu = {k: CpuAccount() for k in chains}
            for name in chains:
                chains[name].pipelined(PAYLOAD, c, params["warmup_s"])
            for order in common.rounds(list(chains), params["rounds"], seed=c):
                for name in order:
                    with CpuWindow({"caller": os.getpid(), **chains[name].pids()}) as window:
                        done, elapsed = chains[name].pipelined(PAYLOAD, c, params["duration_s"])
                    cpu[name].add(window, done)  # every process handles each request once
                    rates[name].append(done / elapsed)
            rows += [{"concurrency": c, "impl": name, "rps": common.summarize(r), "cpu": cpu[name].report()}
                     for name, r in rates.items()]
    finally:
        for chain in chains.values():
            chain.close()
    return rows


def run(params: dict[str, Any], *, quick: bool, ray: bool) -> dict[str, Any]:
    doc = common.result(NAME, quick=quick, parameters={**params, "payload": PAYLOAD})
    with common.Loop() as loop:
        doc["rows"] = measure(params, loop)
    if ray:
        common.log("throughput: Ray Compiled Graph peer")
        from . import ray_peer

        spec = {"mode": "throughput", "payload": PAYLOAD, **params}
        peer = ray_peer.run(spec, timeout=180 + 4 * len(params["concurrency"]) * params["rounds"] * (params["duration_s"] + 1))
        doc["ray"] = {k: v for k, v in peer.items() if not k.isdigit()}
        if "skipped" in peer:
            doc["notes"].append(f"Ray peer skipped: {peer['skipped']}")
        if "error" in peer:
            doc["notes"].append(f"Ray peer failed: {peer['error']}")
        for c in params["concurrency"]:
            got = peer.get(str(c))
            if got:
                doc["rows"].append({"concurrency": c, "impl": "ray", **got["ray"]})
                doc["rows"].append({"concurrency": c, "impl": "zmq@ray", **got["zmq"]})
    else:
        doc["notes"].append("Ray peer not run (--no-ray, or a quick run without --ray)")
    _ratios(doc, params["concurrency"])
    return doc


def row(doc: dict[str, Any], c: int, impl: str) -> dict[str, Any] | None:
    return next((r for r in doc["rows"] if r["concurrency"] == c and r["impl"] == impl), None)


def _ratios(doc: dict[str, Any], concurrency: list[int]) -> None:
    for c in concurrency:
        omni = row(doc, c, "omni")
        if omni is None:
            continue
        entry = {}
        for other in ("zmq", "mpq", "ray"):
            r = row(doc, c, other)
            if r is not None:
                entry[f"omni/{other}"] = common.ratio(omni["rps"]["median"], r["rps"]["median"])
            if r is not None and omni.get("cpu") and r.get("cpu"):
                entry[f"omni/{other} cpu per message per stage"] = common.ratio(
                    omni["cpu"]["stage_us_per_message"], r["cpu"]["stage_us_per_message"])
        ray_row, zmq_at_ray = row(doc, c, "ray"), row(doc, c, "zmq@ray")
        if ray_row and zmq_at_ray:
            entry["ray/zmq (same phase)"] = common.ratio(ray_row["rps"]["median"], zmq_at_ray["rps"]["median"])
        doc["ratios"][str(c)] = entry
        if c == 64:
            doc["checks"][f"concurrency 64: omni >= {TARGET_AT_64} x raw pyzmq"] = (
                entry.get("omni/zmq") is not None and entry["omni/zmq"] >= TARGET_AT_64)
            doc["checks"][f"concurrency 64: omni >= {TARGET_AT_64_MPQ} x mp.Queue"] = (
                entry.get("omni/mpq") is not None and entry["omni/mpq"] >= TARGET_AT_64_MPQ)
            stage_cpu = (omni.get("cpu") or {}).get("stage_us_per_message")
            doc["checks"][f"concurrency 64: omni CPU per message per stage <= {TARGET_CPU_US:g} µs"] = (
                stage_cpu is not None and stage_cpu <= TARGET_CPU_US)


def _rps(doc: dict[str, Any], c: int, impl: str) -> float | None:
    return (row(doc, c, impl) or {}).get("rps", {}).get("median")


def summary(doc: dict[str, Any]) -> str:
    cs = sorted({r["concurrency"] for r in doc["rows"]})
    has_ray = any(r["impl"] == "ray" for r in doc["rows"])
    headers = ["in flight", "omni req/s", "pyzmq", "mp.Queue"] + (["Ray"] if has_ray else [])
    headers += ["omni/pyzmq", "omni/mp.Queue"] + (["omni/Ray"] if has_ray else [])
    rows = []
    for c in cs:
        ratios = doc["ratios"].get(str(c), {})
        line = [c, _rps(doc, c, "omni"), _rps(doc, c, "zmq"), _rps(doc, c, "mpq")] + ([_rps(doc, c, "ray")] if has_ray else [])
        line += [ratios.get("omni/zmq"), ratios.get("omni/mpq")] + ([ratios.get("omni/ray")] if has_ray else [])
        rows.append(line)
    stages = doc["parameters"].get("stages", 3)
    text = f"throughput of a {stages}-stage chain, closed loop (median requests/s; ratio > 1 means omni is faster)\n" + common.table(headers, rows)
    return text + "\n\n" + cpu_table("in flight", cs, lambda c, impl: row(doc, c, impl))


def plot(doc: dict[str, Any], path: str, plt: Any) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    cs = sorted({r["concurrency"] for r in doc["rows"]})
    for impl, style in (("omni", "o-"), ("zmq", "s-"), ("mpq", "^-"), ("ray", "d-")):
        pts = [(c, row(doc, c, impl)) for c in cs if row(doc, c, impl)]
        if pts:
            ax.plot([c for c, _ in pts], [r["rps"]["median"] for _, r in pts], style, label=LABELS[impl])
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_yscale("log")
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("requests / s (median)")
    ax.set_title(f"throughput: {doc['parameters'].get('stages', 3)}-stage trivial chain")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""hop: per-hop latency of a small payload through a chain of N stage processes.

One request in flight at a time. A request makes ``N + 1`` hops (caller → s0 → … → s(N-1) →
caller), so per-hop latency = round-trip time / (N + 1). omni (a real ``Pipeline`` of N ``Echo``
stages, each in its own process) runs side by side with the raw pyzmq chain (the floor) and the
``multiprocessing.Queue`` chain (the naive alternative), in shuffled rounds so all three see the
same machine noise; the Ray Compiled Graph chain (optional peer) runs after them in its own
process. Around every measured round the CPU time of every process of the implementation (the
caller and each stage) is read (``bench/cpu.py``): CPU µs per message per stage.
"""

from __future__ import annotations

import os
import time
from typing import Any

from . import common
from .baselines import QueueChain, ZmqChain
from .cpu import CpuAccount, CpuWindow, cpu_table

NAME = "hop"
PAYLOAD = {"text": "hello world", "x": 1, "ids": [1, 2, 3, 4]}
SIZES = {
    "quick": {"ns": [1, 2, 4, 8], "warmup": 30, "requests": 100, "rounds": 3},
    "full": {"ns": [1, 2, 4, 8], "warmup": 200, "requests": 400, "rounds": 8},
}
IMPLS = ("omni", "zmq", "mpq")
LABELS = {"omni": "omni", "zmq": "raw pyzmq", "mpq": "mp.Queue", "ray": "Ray CG"}
TARGET_VS_ZMQ = 2.0


class OmniChain:
    label = "omni"

    def __init__(self, n: int, loop: common.Loop):
        from omni_core import Pipeline

        from .stages import chain

        self.loop = loop
        self.pipeline = Pipeline(chain(n, name=f"bench-hop-{n}"))
        loop.run(self.pipeline.start())

    def pids(self) -> dict[str, int | None]:
        return self.pipeline.pids()

    def block(self, payload: Any, count: int, samples: list[float] | None) -> None:
        async def go() -> None:
            submit = self.pipeline.submit
            for _ in range(count):
                t0 = time.perf_counter()
                await submit(payload)
                if samples is not None:
                    samples.append(time.perf_counter() - t0)

        self.loop.run(go())

    def close(self) -> None:
        self.loop.run(self.pipeline.stop())


def _block(chain: Any, count: int, samples: list[float] | None) -> None:
    """``count`` sequential requests through ``chain``, their times appended to ``samples``."""
    if isinstance(chain, OmniChain):
        chain.block(PAYLOAD, count, samples)
        return
    request, payload = chain.request, PAYLOAD
    for _ in range(count):
        t0 = time.perf_counter()
        request(payload)
        if samples is not None:
            samples.append(time.perf_counter() - t0)


def measure(params: dict[str, Any], loop: common.Loop) -> list[dict[str, Any]]:
    rows = []
    for n in params["ns"]:
        common.log(f"hop: chain of {n}")
        chains: dict[str, Any] = {}
        try:
            chains["omni"] = OmniChain(n, loop)
            chains["zmq"] = ZmqChain(n)
            chains["mpq"] = QueueChain(n)
            samples: dict[str, list[float]] = {k: [] for k in chains}
            cpu = {k: CpuAccount() for k in chains}

            for name in chains:
                _block(chains[name], params["warmup"], None)
            for order in common.rounds(list(chains), params["rounds"], seed=n):
                for name in order:
                    with CpuWindow({"caller": os.getpid(), **chains[name].pids()}) as window:
                        _block(chains[name], params["requests"], samples[name])
                    cpu[name].add(window, params["requests"])  # every process handles each request once
        finally:
            for chain in chains.values():
                chain.close()
        for name, s in samples.items():
            rows.append({"n": n, "impl": name, "rtt_us": common.summarize(s, 1e6), "hop_us": common.summarize(s, 1e6 / (n + 1)),
                         "cpu": cpu[name].report() if cpu[name].windows else None})
    return rows


def run(params: dict[str, Any], *, quick: bool, ray: bool) -> dict[str, Any]:
    doc = common.result(NAME, quick=quick, parameters={**params, "payload": PAYLOAD})
    with common.Loop() as loop:
        doc["rows"] = measure(params, loop)
    if ray:
        common.log("hop: Ray Compiled Graph peer")
        peer = _ray(params)
        doc["ray"] = {k: v for k, v in peer.items() if not k.isdigit()}
        if "skipped" in peer:
            doc["notes"].append(f"Ray peer skipped: {peer['skipped']}")
        for n in params["ns"]:
            got = peer.get(str(n))
            if not got:
                continue
            if "error" in got:
                doc["notes"].append(f"Ray peer, chain of {n}: {got['error']}")
                continue
            doc["rows"].append({"n": n, "impl": "ray", **got["ray"]})
            doc["rows"].append({"n": n, "impl": "zmq@ray", **got["zmq"]})
    else:
        doc["notes"].append("Ray peer not run (--no-ray, or a quick run without --ray)")
    _ratios(doc, params["ns"])
    return doc


def _ray(params: dict[str, Any]) -> dict[str, Any]:
    from . import ray_peer

    spec = {"mode": "hop", "payload": PAYLOAD, **{k: params[k] for k in ("ns", "warmup", "requests", "rounds")}}
    return ray_peer.run(spec, timeout=120 + 60 * len(params["ns"]))


def row(doc: dict[str, Any], n: int, impl: str) -> dict[str, Any] | None:
    return next((r for r in doc["rows"] if r["n"] == n and r["impl"] == impl), None)


def _ratios(doc: dict[str, Any], ns: list[int]) -> None:
    for n in ns:
        omni = row(doc, n, "omni")
        if omni is None:
            continue
        entry = {}
        for other in ("zmq", "mpq", "ray"):
            r = row(doc, n, other)
            if r is None:
                continue
            for stat in ("median", "p99"):
                entry[f"omni/{other} {stat}"] = common.ratio(omni["hop_us"][stat], r["hop_us"][stat])
        for other in ("zmq", "mpq"):
            r = row(doc, n, other)
            if r is not None and omni.get("cpu") and r.get("cpu"):
                entry[f"omni/{other} cpu per message per stage"] = common.ratio(omni["cpu"]["stage_us_per_message"], r["cpu"]["stage_us_per_message"])
        ray_row, zmq_at_ray = row(doc, n, "ray"), row(doc, n, "zmq@ray")
        if ray_row and zmq_at_ray:
            entry["ray/zmq median (same phase)"] = common.ratio(ray_row["hop_us"]["median"], zmq_at_ray["hop_us"]["median"])
        doc["ratios"][str(n)] = entry
        doc["checks"][f"n={n}: omni hop median <= {TARGET_VS_ZMQ} x raw pyzmq"] = (
            entry.get("omni/zmq median") is not None and entry["omni/zmq median"] <= TARGET_VS_ZMQ)
        doc["checks"][f"n={n}: omni hop median < mp.Queue"] = (
            entry.get("omni/mpq median") is not None and entry["omni/mpq median"] < 1.0)


def _hop(doc: dict[str, Any], n: int, impl: str, stat: str) -> float | None:
    return (row(doc, n, impl) or {}).get("hop_us", {}).get(stat)


def summary(doc: dict[str, Any]) -> str:
    ns = sorted({r["n"] for r in doc["rows"]})
    has_ray = any(r["impl"] == "ray" for r in doc["rows"])
    headers = ["stages", "omni p50 µs", "omni p99", "pyzmq p50", "pyzmq p99", "mp.Queue p50"]
    headers += ["Ray p50"] if has_ray else []
    headers += ["omni/pyzmq", "omni/mp.Queue"] + (["omni/Ray"] if has_ray else [])
    rows = []
    for n in ns:
        ratios = doc["ratios"].get(str(n), {})
        line = [n, _hop(doc, n, "omni", "median"), _hop(doc, n, "omni", "p99"), _hop(doc, n, "zmq", "median"),
                _hop(doc, n, "zmq", "p99"), _hop(doc, n, "mpq", "median")]
        line += [_hop(doc, n, "ray", "median")] if has_ray else []
        line += [ratios.get("omni/zmq median"), ratios.get("omni/mpq median")]
        line += [ratios.get("omni/ray median")] if has_ray else []
        rows.append(line)
    text = "per-hop latency, one request in flight (µs; ratio < 1 means omni is faster)\n" + common.table(headers, rows)
    return text + "\n\n" + cpu_table("stages", ns, lambda n, impl: row(doc, n, impl))


def plot(doc: dict[str, Any], path: str, plt: Any) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ns = sorted({r["n"] for r in doc["rows"]})
    for impl, style in (("omni", "o-"), ("zmq", "s-"), ("mpq", "^-"), ("ray", "d-")):
        pts = [(n, row(doc, n, impl)) for n in ns if row(doc, n, impl)]
        if not pts:
            continue
        xs = [n for n, _ in pts]
        line, = ax.plot(xs, [r["hop_us"]["median"] for _, r in pts], style, label=f"{LABELS[impl]} p50")
        ax.plot(xs, [r["hop_us"]["p99"] for _, r in pts], ":", color=line.get_color(), label=f"{LABELS[impl]} p99")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_yscale("log")
    ax.set_xlabel("stages in the chain (one process each)")
    ax.set_ylabel("latency per hop (µs)")
    ax.set_title("hop: per-hop latency, one request in flight")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

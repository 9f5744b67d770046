"""relay: GB/s of each installed relay between two stage processes, against memcpy.

A real 2-stage ``Pipeline``: ``Source`` returns a warm uint8 tensor of the requested size (made
once per size, so the stage's own cost is nil), the edge's relay moves it to ``Sink`` in the other
process, which reads its last byte and returns a few numbers to the caller. Requests run one after
another; GB/s = bytes / median request time (so the per-request cost of the control plane is
included: it dominates small sizes). The baseline, measured in the same run and interleaved with
the relay in short alternating blocks (memory bandwidth on a shared machine drifts by several
times within seconds), is a single-threaded ``dst.copy_(src)`` of the same size into a warm buffer
(``torch.set_num_threads(1)``): what one copy of the data costs on this machine. The shm relay's
default pool (32 slots of 4 MiB) is measured as configured out of the box, and again with a pool
large enough for the biggest tensor (transfers larger than the pool take a one-off segment).
"""

from __future__ import annotations

import time
from typing import Any

from . import common
from .common import KiB, MiB

NAME = "relay"
SIZES = {
    "quick": {"sizes": [4 * KiB, 1 * MiB, 16 * MiB, 64 * MiB], "target_s": 0.25, "min_reps": 10, "max_reps": 200, "rounds": 10},
    "full": {"sizes": [4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB], "target_s": 1.0,
             "min_reps": 20, "max_reps": 2000, "rounds": 20},
}
BIG_POOL = {"slot_bytes": 16 * MiB, "slots": 32}  # 512 MiB: every size of the full run fits
TARGET_SHM = 0.7
TARGET_FROM = 16 * MiB


def variants(sizes: list[int]) -> list[dict[str, Any]]:
    """Every installed relay that can move CPU tensors within a node, plus the big-pool shm."""
    from omni_core.plugins import get_registry

    registry = get_registry()
    out = []
    for name in registry.names("relay"):
        try:
            cls = registry.resolve("relay", name)
            caps = cls.capabilities
        except Exception as exc:
            out.append({"label": name, "relay": name, "options": {}, "sizes": [], "error": f"{type(exc).__name__}: {exc}"})
            continue
        if "cpu" not in caps.devices or "node" not in caps.scopes:
            continue
        out.append({"label": name, "relay": name, "options": {}, "sizes": list(sizes)})
        if name == "shm":
            big = [s for s in sizes if s >= TARGET_FROM]
            if big:
                pool = BIG_POOL["slot_bytes"] * BIG_POOL["slots"]
                out.append({"label": f"shm ({pool // MiB} MiB pool)", "relay": "shm", "options": dict(BIG_POOL), "sizes": big})
    return out


class Memcpy:
    """Single-threaded copy into a warm buffer (the baseline)."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        self.buffers: dict[int, tuple[Any, Any]] = {}

    def once(self, nbytes: int) -> float:
        pair = self.buffers.get(nbytes)
        if pair is None:
            src = self.torch.ones(nbytes, dtype=self.torch.uint8)
            dst = self.torch.empty(nbytes, dtype=self.torch.uint8)
            dst.copy_(src)
            pair = self.buffers[nbytes] = (src, dst)
        src, dst = pair
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    def drop(self) -> None:
        self.buffers.clear()


def _reps(estimate: float, params: dict[str, Any]) -> int:
    return int(min(params["max_reps"], max(params["min_reps"], params["target_s"] / max(estimate, 1e-7))))


async def _requests(pipeline: Any, label: str, nbytes: int, count: int, into: list[float]) -> None:
    payload = {"nbytes": nbytes}
    for _ in range(count):
        t0 = time.perf_counter()
        out = await pipeline.submit(payload)
        into.append(time.perf_counter() - t0)
        if out["n"] != nbytes or out["last"] != 1:
            raise AssertionError(f"relay {label} delivered {out} for {nbytes} bytes")


def measure_variant(variant: dict[str, Any], params: dict[str, Any], loop: common.Loop, memcpy: Memcpy) -> list[dict[str, Any]]:
    from omni_core import Pipeline

    from .stages import source_sink

    rows = []
    pipeline = Pipeline(source_sink(relay=variant["relay"], options=variant["options"], name="bench-relay"))
    loop.run(pipeline.start())
    try:
        for nbytes in variant["sizes"]:
            common.log(f"relay: {variant['label']} {common.human_bytes(nbytes)}")
            warm: list[float] = []
            loop.run(_requests(pipeline, variant["label"], nbytes, 3, warm))
            copies = [memcpy.once(nbytes) for _ in range(3)]
            relay_reps, copy_reps = _reps(min(warm), params), _reps(min(copies), params)
            relay_t: list[float] = []
            copy_t: list[float] = []
            for order in common.rounds(["relay", "memcpy"], params["rounds"], seed=nbytes):
                for what in order:
                    if what == "relay":
                        loop.run(_requests(pipeline, variant["label"], nbytes, max(1, relay_reps // params["rounds"]), relay_t))
                    else:
                        copy_t += [memcpy.once(nbytes) for _ in range(max(1, copy_reps // params["rounds"]))]
            relay_s, copy_s = common.summarize(relay_t), common.summarize(copy_t)
            relay_gbps = nbytes / relay_s["median"] / 1e9
            copy_gbps = nbytes / copy_s["median"] / 1e9
            rows.append({
                "relay": variant["label"], "backend": variant["relay"], "options": variant["options"], "bytes": nbytes,
                "request_us": common.summarize(relay_t, 1e6), "memcpy_us": common.summarize(copy_t, 1e6),
                "gbps": relay_gbps, "memcpy_gbps": copy_gbps, "ratio": relay_gbps / copy_gbps,
            })
            memcpy.drop()
    finally:
        loop.run(pipeline.stop())
    return rows


def run(params: dict[str, Any], *, quick: bool, ray: bool) -> dict[str, Any]:
    doc = common.result(NAME, quick=quick, parameters=params)
    memcpy = Memcpy()
    doc["parameters"]["variants"] = vs = variants(params["sizes"])
    with common.Loop() as loop:
        for variant in vs:
            if variant.get("error"):
                doc["notes"].append(f"relay {variant['label']} cannot load: {variant['error']}")
                continue
            doc["rows"] += measure_variant(variant, params, loop, memcpy)
    if not any(v["relay"] == "nccl" for v in vs):
        doc["notes"].append("relay nccl is not installed (plugins/omni-nccl): not measured")
    for r in doc["rows"]:
        doc["ratios"][f"{r['relay']} {common.human_bytes(r['bytes'])}"] = r["ratio"]
    for r in doc["rows"]:
        if r["backend"] == "shm" and r["bytes"] >= TARGET_FROM:
            doc["checks"][f"{r['relay']} {common.human_bytes(r['bytes'])}: >= {TARGET_SHM} x memcpy"] = r["ratio"] >= TARGET_SHM
    return doc


def summary(doc: dict[str, Any]) -> str:
    rows = [[r["relay"], common.human_bytes(r["bytes"]), r["request_us"]["median"], r["gbps"], r["memcpy_gbps"], r["ratio"]]
            for r in doc["rows"]]
    headers = ["relay", "size", "request p50 µs", "relay GB/s", "memcpy GB/s", "relay/memcpy"]
    return "relay bandwidth between two stage processes, one request at a time (ratio 1 = as fast as one memcpy)\n" + common.table(headers, rows)


def plot(doc: dict[str, Any], path: str, plt: Any) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = list(dict.fromkeys(r["relay"] for r in doc["rows"]))
    for label, style in zip(labels, ("o-", "s-", "d-", "v-", "x-", "+-"), strict=False):
        pts = sorted((r["bytes"], r["gbps"]) for r in doc["rows"] if r["relay"] == label)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    copies: dict[int, list[float]] = {}
    for r in doc["rows"]:
        copies.setdefault(r["bytes"], []).append(r["memcpy_gbps"])
    xs = sorted(copies)
    ax.plot(xs, [sorted(copies[x])[len(copies[x]) // 2] for x in xs], "k--", label="memcpy (1 thread, warm)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [common.human_bytes(x).replace(" ", "") for x in xs])
    ax.set_xlabel("tensor size")
    ax.set_ylabel("GB/s (bytes / median request time)")
    ax.set_title("relay: bandwidth between two stage processes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

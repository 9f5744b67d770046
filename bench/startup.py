"""startup: time until N stage processes are ready, against N bare torch-importing processes.

- omni warm: ``Pipeline.start()`` of a chain of N ``Echo`` stages (one process each) while the
  local launcher's forkserver already runs (a previous pipeline in the same process started it).
- omni cold: the same in a fresh Python process whose forkserver is not running yet (the
  forkserver starts and imports torch first). Timed inside that process, from ``start()`` to
  ready; its interpreter start and imports are reported apart (``process_s``).
- baseline: N ``python -c "import torch"`` processes started at once; time until each printed
  that it imported torch.

"Ready" for omni means every process built its stages, bound its inbox and reported ``Ready``.
Rounds are interleaved so all three see the same machine load.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

from . import common
from .baselines import bare_torch_processes

NAME = "startup"
SIZES = {
    "quick": {"processes": [1, 8], "rounds": 1, "cold": True},
    "full": {"processes": [1, 4, 8], "rounds": 7, "cold": True},
}
IMPLS = {"warm": "omni warm forkserver", "cold": "omni cold", "bare": "bare torch processes"}


def _omni_start(n: int, loop: common.Loop) -> dict[str, float]:
    from omni_core import Pipeline

    from .stages import chain

    pipeline = Pipeline(chain(n, name=f"bench-startup-{n}"))
    t0 = time.perf_counter()
    loop.run(pipeline.start())
    ready = time.perf_counter() - t0
    t1 = time.perf_counter()
    loop.run(pipeline.stop())
    return {"ready_s": ready, "stop_s": time.perf_counter() - t1}


def _cold(n: int) -> dict[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "bench.startup", str(n)], cwd=common.ROOT,
                          capture_output=True, text=True, timeout=300)
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"cold start probe failed: {proc.stderr.strip()[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**out, "total_s": total}


def run(params: dict[str, Any], *, quick: bool, ray: bool) -> dict[str, Any]:
    doc = common.result(NAME, quick=quick, parameters=params)
    impls = ["warm", "bare"] + (["cold"] if params.get("cold", True) else [])
    samples: dict[tuple[int, str], list[dict[str, float]]] = {}
    with common.Loop() as loop:
        _omni_start(1, loop)  # starts the forkserver: "warm" from here on
        for i, order in enumerate(common.rounds(impls, params["rounds"])):
            for n in params["processes"]:
                for impl in order:
                    common.log(f"startup: round {i + 1}, {n} process(es), {IMPLS[impl]}")
                    if impl == "warm":
                        got = _omni_start(n, loop)
                    elif impl == "cold":
                        got = _cold(n)
                    else:
                        got = {"ready_s": bare_torch_processes(n)}
                    samples.setdefault((n, impl), []).append(got)
    for (n, impl), got in sorted(samples.items()):
        row = {"processes": n, "impl": impl, "ready_s": common.summarize(g["ready_s"] for g in got)}
        for extra in ("stop_s", "process_s", "total_s"):
            if extra in got[0]:
                row[extra] = common.summarize(g[extra] for g in got)
        doc["rows"].append(row)
    for n in params["processes"]:
        bare = _get(doc, n, "bare")
        entry = {}
        for impl in ("warm", "cold"):
            r = _get(doc, n, impl)
            if r and bare:
                entry[f"omni {impl}/bare"] = common.ratio(r["ready_s"]["median"], bare["ready_s"]["median"])
        doc["ratios"][str(n)] = entry
    top = max(params["processes"])
    for impl in ("warm", "cold"):
        key = f"omni {impl}/bare"
        if key in doc["ratios"].get(str(top), {}):
            doc["checks"][f"{top} processes: omni {impl} start faster than {top} bare torch processes"] = doc["ratios"][str(top)][key] < 1.0
    return doc


def _get(doc: dict[str, Any], n: int, impl: str) -> dict[str, Any] | None:
    return next((r for r in doc["rows"] if r["processes"] == n and r["impl"] == impl), None)


def _ready(doc: dict[str, Any], n: int, impl: str) -> float | None:
    return (_get(doc, n, impl) or {}).get("ready_s", {}).get("median")


def summary(doc: dict[str, Any]) -> str:
    ns = sorted({r["processes"] for r in doc["rows"]})
    headers = ["processes", "omni warm s", "omni cold s", "bare torch s", "warm/bare", "cold/bare", "omni stop s"]
    rows = []
    for n in ns:
        ratios = doc["ratios"].get(str(n), {})
        stop = (_get(doc, n, "warm") or {}).get("stop_s", {}).get("median")
        rows.append([n, _ready(doc, n, "warm"), _ready(doc, n, "cold"), _ready(doc, n, "bare"),
                     ratios.get("omni warm/bare"), ratios.get("omni cold/bare"), stop])
    return "time to ready (median seconds; ratio < 1 means omni is faster)\n" + common.table(headers, rows)


def plot(doc: dict[str, Any], path: str, plt: Any) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ns = sorted({r["processes"] for r in doc["rows"]})
    width = 0.27
    for k, (impl, label) in enumerate(IMPLS.items()):
        pts = [(i + (k - 1) * width, _ready(doc, n, impl)) for i, n in enumerate(ns)]
        pts = [(x, v) for x, v in pts if v is not None]
        ax.bar([x for x, _ in pts], [v for _, v in pts], width, label=label)
    ax.set_xticks(range(len(ns)), [str(n) for n in ns])
    ax.set_xlabel("processes")
    ax.set_yscale("log")
    ax.set_ylabel("seconds to ready (median, log scale)")
    ax.set_title("startup: time until every process is ready")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _probe(n: int) -> None:
    """Cold start in this fresh process: no forkserver runs yet."""
    t0 = time.perf_counter()
    import asyncio

    from omni_core import Pipeline

    from .stages import chain

    pipeline = Pipeline(chain(n, name=f"bench-startup-{n}"))
    imported = time.perf_counter() - t0

    async def go() -> float:
        t1 = time.perf_counter()
        await pipeline.start()
        ready = time.perf_counter() - t1
        await pipeline.stop()
        return ready

    ready = asyncio.run(go())
    print(json.dumps({"ready_s": ready, "process_s": imported}))


if __name__ == "__main__":
    _probe(int(sys.argv[1]))

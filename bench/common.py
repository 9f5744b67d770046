"""What every scenario shares: statistics, machine facts, result files, tables, memory sampling,
and a persistent event loop for driving a :class:`omni_core.Pipeline` from synchronous code.

Nothing here imports torch or omni at module level: the baseline worker processes import this
module too and must start as bare Python processes.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SCHEMA = 1

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# -- statistics ---------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, by linear interpolation."""
    if not sorted_values:
        return math.nan
    k = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    if lo == hi:
        return float(sorted_values[lo])
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo))


def summarize(values: Iterable[float], scale: float = 1.0) -> dict[str, float]:
    """``n``, ``median`` (= ``p50``), ``p99``, ``mean``, ``min``, ``max`` of ``values`` × ``scale``."""
    xs = sorted(v * scale for v in values)
    if not xs:
        return {"n": 0, "median": math.nan, "p50": math.nan, "p99": math.nan, "mean": math.nan, "min": math.nan, "max": math.nan}
    med = percentile(xs, 50)
    return {
        "n": len(xs),
        "median": med,
        "p50": med,
        "p99": percentile(xs, 99),
        "mean": sum(xs) / len(xs),
        "min": xs[0],
        "max": xs[-1],
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either side is missing."""
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


# -- machine facts ------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def _git() -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on (stored in every result file)."""
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": _mem_total(),
        "load_average": load_average(),
        "versions": {name: _version(name) for name in ("omni-core", "torch", "pyzmq", "msgspec", "ray")},
        "git": _git(),
    }


# -- results ------------------------------------------------------------------------------------


def result(scenario: str, *, quick: bool, parameters: dict[str, Any]) -> dict[str, Any]:
    """A fresh result document; scenarios fill ``rows``, ``ratios``, ``checks`` and ``notes``."""
    return {
        "schema": SCHEMA,
        "scenario": scenario,
        "quick": quick,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "parameters": parameters,
        "rows": [],
        "ratios": {},
        "checks": {},
        "notes": [],
    }


def write_result(doc: dict[str, Any], out_dir: Path) -> Path:
    """Write ``<out_dir>/<scenario>.json`` (and a timestamped copy) and return the main path."""
    doc["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    doc["machine"]["load_average_end"] = load_average()
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if doc["quick"] else ""
    path = out_dir / f"{doc['scenario']}{suffix}.json"
    text = json.dumps(doc, indent=2, default=_json_default, allow_nan=False)
    path.write_text(text + "\n")
    stamp = doc["started"].replace(":", "").replace("-", "").replace("+0000", "Z")
    (out_dir / "history").mkdir(exist_ok=True)
    (out_dir / "history" / f"{doc['scenario']}{suffix}-{stamp}.json").write_text(text + "\n")
    return path


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot store a {type(obj).__name__} in a result file")


def clean_nans(obj: Any) -> Any:
    """JSON has no NaN: replace NaN/inf by None, recursively."""
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {k: clean_nans(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_nans(v) for v in obj]
    return obj


# -- tables -------------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value == 0:
            return "0"
        mag = abs(value)
        if mag >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{max(0, digits - 1 - int(math.floor(math.log10(mag))))}f}" if mag >= 0.001 else f"{value:.2e}"
    return str(value)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain text table (also valid GitHub markdown)."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda row: "| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))) + " |"  # noqa: E731
    sep = "|" + "|".join(("-" * (w + 1) + ":") if i else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


# -- processes and memory -----------------------------------------------------------------------

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def descendants(root: int | None = None) -> list[int]:
    """Pids of every live descendant of ``root`` (default: this process)."""
    root = root or os.getpid()
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def pss_bytes(pid: int) -> int:
    """Proportional set size: shared pages (torch's libraries, shm pools) split among their users,
    so the sum over processes does not count them several times."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_memory(root: int | None = None) -> dict[str, int]:
    """RSS and PSS summed over ``root`` (default: this process) and all its descendants."""
    pids = [root or os.getpid(), *descendants(root)]
    return {"rss": sum(rss_bytes(p) for p in pids), "pss": sum(pss_bytes(p) for p in pids), "processes": len(pids)}


class MemorySampler:
    """Samples :func:`tree_memory` every ``interval`` seconds in a thread; ``peak()`` since the
    last ``reset()``."""

    def __init__(self, interval: float = 0.1):
        self.interval = interval
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._peak = {"rss": 0, "pss": 0}
        self._thread = threading.Thread(target=self._run, name="bench-memory", daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> dict[str, int]:
        now = tree_memory()
        with self._lock:
            for key in ("rss", "pss"):
                self._peak[key] = max(self._peak[key], now[key])
        return now

    def reset(self) -> None:
        with self._lock:
            self._peak = {"rss": 0, "pss": 0}
        self.sample()

    def peak(self) -> dict[str, int]:
        self.sample()
        with self._lock:
            return dict(self._peak)


def shm_entries(prefix: str = "omni") -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    except OSError:
        return set()


# -- driving a Pipeline from synchronous code ---------------------------------------------------


class Loop:
    """One event loop kept for a whole scenario, so a Pipeline started in it can be used between
    synchronous baseline measurements (``loop.run(coro)``)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()

    def __enter__(self) -> Loop:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def rounds(names: Sequence[str], count: int, seed: int = 0) -> list[list[str]]:
    """``count`` rounds, each visiting every name once in a shuffled order: implementations
    measured side by side see the same machine noise."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        order = list(names)
        rng.shuffle(order)
        out.append(order)
    return out


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)

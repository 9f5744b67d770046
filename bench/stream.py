"""stream: chunks per second and per-chunk latency through a stage→stage ``stream_to`` edge.

A real ``Pipeline`` of three processes: ``head`` (``Echo``) hands its payload to ``src`` and
``sink``; ``src`` (``ChunkSource``, not terminal: its result goes to ``done`` in its own process)
emits ``chunks`` chunks, each a ``[1, 1, 2048]`` bfloat16
hidden state (4 KiB), a token id and its emit time, to ``sink`` (``ChunkSink``, ``stream_to``),
which reads them while they are produced, checks their order and content, and returns each
chunk's latency (emit → read, one monotonic clock). A thinker emitting a token and its hidden
state per step to the talker, with ``concurrency`` requests streaming at once.

Closed loop: ``concurrency`` streams are kept in flight for ``duration_s`` (a new one as soon as
one ends), then the last ones drain; chunks/s = chunks of the completed streams / elapsed. The
baseline, in shuffled rounds with omni, is a raw pyzmq stream of the same bytes
(:class:`bench.baselines.ZmqStream`: source process → sink process, the same 4 KiB and header per
chunk, one result per stream to the driver). CPU per chunk is read from every process of both
(``bench/cpu.py``).

Every round has a deadline (``deadline_s``): a stream that stalls or deadlocks ends that point
with ``status: "timeout"`` (or ``"error"`` and the message) in its row, the pipeline is stopped
and a fresh one serves the next point; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from . import common
from .baselines import ZmqStream
from .cpu import CpuAccount, CpuWindow, per_message

NAME = "stream"
HIDDEN = 2048  # elements of the bfloat16 hidden state per chunk: [1, 1, 2048] = 4 KiB
SIZES = {
    "quick": {"relays": ["auto", "inline"], "concurrency": [1, 16, 64], "chunks": 16, "warmup_s": 0.2, "duration_s": 1.0,
              "rounds": 2, "deadline_s": 20.0},
    "full": {"relays": ["auto", "inline"], "concurrency": [1, 16, 64], "chunks": 128, "warmup_s": 1.0,
             "duration_s": 3.0, "rounds": 4, "deadline_s": 60.0},
}
IMPLS = ("omni", "zmq")
LABELS = {"omni": "omni", "zmq": "raw pyzmq"}
TARGET_AT_16 = 0.3


class OmniStream:
    """The omni side: one pipeline, ``concurrency`` tasks calling ``submit`` in a closed loop."""

    def __init__(self, relay: str, loop: common.Loop, deadline_s: float):
        from omni_core import Pipeline

        from .stages import stream_pair

        self.loop = loop
        limits = {"request_timeout": deadline_s, "stop_timeout": 10.0}
        self.pipeline = Pipeline(stream_pair(relay=relay, hidden=HIDDEN, name="bench-stream", limits=limits))
        loop.run(asyncio.wait_for(self.pipeline.start(), 120))

    def pids(self) -> dict[str, int | None]:
        return self.pipeline.pids()

    def streams(self, chunks: int, concurrency: int, duration: float, deadline: float,
                results: list[dict] | None) -> tuple[int, float]:
        submit = self.pipeline.submit
        payload = {"chunks": chunks}
        done = 0

        async def worker(end: float) -> None:
            nonlocal done
            while True:
                out = await submit(payload)
                if results is not None:
                    results.append(out["sink"])
                done += 1
                if time.perf_counter() >= end:
                    return

        async def go() -> float:
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(t0 + duration) for _ in range(concurrency)))
            return time.perf_counter() - t0

        try:
            elapsed = self.loop.run(asyncio.wait_for(go(), max(0.1, deadline - time.monotonic())))
        except asyncio.TimeoutError:
            raise TimeoutError(f"omni stream: streams still in flight at the deadline ({done} completed)") from None
        return done, elapsed

    def close(self) -> None:
        self.loop.run(asyncio.wait_for(self.pipeline.stop(), 60))


class _Point:
    """What one implementation measured at one (relay, concurrency) point."""

    def __init__(self) -> None:
        self.rates: list[float] = []
        self.latencies: list[float] = []
        self.streams = 0
        self.chunks = 0
        self.sent = 0
        self.bad = 0
        self.short = 0
        self.cpu = CpuAccount()
        self.status = "ok"
        self.error: str | None = None

    def fail(self, exc: BaseException) -> None:
        self.status = "timeout" if isinstance(exc, TimeoutError) or type(exc).__name__ == "RequestTimeout" else "error"
        self.error = f"{type(exc).__name__}: {exc}"[:2000]


def _open(impl: str, relay: str, loop: common.Loop, params: dict[str, Any]) -> Any:
    return OmniStream(relay, loop, params["deadline_s"]) if impl == "omni" else ZmqStream(HIDDEN)


def _close(obj: Any, notes: list[str], what: str) -> None:
    try:
        obj.close()
    except BaseException as exc:  # noqa: BLE001 - a wedged pipeline must not end the run
        notes.append(f"stream: closing {what} failed: {type(exc).__name__}: {exc}")


def _round(obj: Any, impl: str, point: _Point, c: int, params: dict[str, Any]) -> None:
    """One measured round; chunks count what the sink read (a truncated stream counts less)."""
    chunks = params["chunks"]
    results: list[dict] = []
    deadline = time.monotonic() + params["deadline_s"]
    pids = {"caller": os.getpid(), **obj.pids()}
    with CpuWindow(pids) as window:
        done, elapsed = obj.streams(chunks, c, params["duration_s"], deadline, results)
    read = sum(r["n"] for r in results)
    messages = {role: (done if role in ("caller", "head") else read if role == "sink" else done * chunks) for role in pids}
    point.cpu.add(window, messages)
    point.rates.append(read / elapsed)
    point.streams += done
    point.chunks += read
    point.sent += done * chunks
    for r in results:
        point.latencies += r["lat_us"]
        point.bad += r["bad"]
        point.short += r["n"] != chunks


def measure_relay(relay: str, params: dict[str, Any], loop: common.Loop, notes: list[str]) -> list[dict[str, Any]]:
    rows = []
    live: dict[str, Any] = {}
    try:
        for c in params["concurrency"]:
            common.log(f"stream: relay {relay}, {c} concurrent streams of {params['chunks']} chunks")
            points = {impl: _Point() for impl in IMPLS}
            for impl in IMPLS:  # start (or restart after a failure) and warm up
                try:
                    if impl not in live:
                        live[impl] = _open(impl, relay, loop, params)
                    live[impl].streams(params["chunks"], c, params["warmup_s"], time.monotonic() + params["deadline_s"], None)
                except Exception as exc:
                    points[impl].fail(exc)
                    if impl in live:
                        _close(live.pop(impl), notes, f"{impl} after a failed warm-up")
            for order in common.rounds(list(IMPLS), params["rounds"], seed=c):
                for impl in order:
                    if points[impl].status != "ok":
                        continue
                    try:
                        _round(live[impl], impl, points[impl], c, params)
                    except Exception as exc:
                        points[impl].fail(exc)
                        _close(live.pop(impl), notes, f"{impl} after a failed round")
            for impl, p in points.items():
                cpu = p.cpu.report(stage_roles=["src", "sink"]) if p.cpu.windows else None
                rows.append({
                    "relay": relay, "concurrency": c, "impl": impl, "status": p.status, "error": p.error,
                    "chunks_per_stream": params["chunks"], "streams": p.streams, "chunks": p.chunks, "chunks_sent": p.sent,
                    "chunks_per_s": common.summarize(p.rates), "latency_us": common.summarize(p.latencies),
                    "bad_chunks": p.bad, "short_streams": p.short, "cpu": cpu,
                    "cpu_us_per_chunk": (cpu["total_cpu_s"] / p.chunks * 1e6) if cpu and p.chunks else None,
                })
                if p.error:  # the row keeps the whole message (and remote traceback); the note its first line
                    first = p.error.strip().splitlines()[0]
                    notes.append(f"stream: relay {relay}, {c} streams, {LABELS[impl]}: {p.status}: {first}")
    finally:
        for impl, obj in live.items():
            _close(obj, notes, impl)
    return rows


def run(params: dict[str, Any], *, quick: bool, ray: bool) -> dict[str, Any]:
    doc = common.result(NAME, quick=quick, parameters={**params, "hidden": [1, 1, HIDDEN], "dtype": "bfloat16",
                                                          "chunk_bytes": 2 * HIDDEN})
    with common.Loop() as loop:
        for relay in params["relays"]:
            doc["rows"] += measure_relay(relay, params, loop, doc["notes"])
    doc["notes"].append("no Ray peer for this scenario")
    _ratios(doc)
    return doc


def row(doc: dict[str, Any], relay: str, c: int, impl: str) -> dict[str, Any] | None:
    return next((r for r in doc["rows"] if r["relay"] == relay and r["concurrency"] == c and r["impl"] == impl), None)


def _ok(r: dict[str, Any] | None) -> bool:
    return bool(r) and r["status"] == "ok" and r["chunks"] > 0


def _ratios(doc: dict[str, Any]) -> None:
    for relay in dict.fromkeys(r["relay"] for r in doc["rows"]):
        for c in sorted({r["concurrency"] for r in doc["rows"] if r["relay"] == relay}):
            omni, zmq = row(doc, relay, c, "omni"), row(doc, relay, c, "zmq")
            key = f"{relay} {c}"
            entry: dict[str, Any] = {}
            if _ok(omni) and _ok(zmq):
                entry["omni/zmq chunks/s"] = common.ratio(omni["chunks_per_s"]["median"], zmq["chunks_per_s"]["median"])
                entry["omni/zmq latency p50"] = common.ratio(omni["latency_us"]["median"], zmq["latency_us"]["median"])
                entry["omni/zmq latency p99"] = common.ratio(omni["latency_us"]["p99"], zmq["latency_us"]["p99"])
                for role in ("src", "sink"):
                    entry[f"omni/zmq cpu per chunk {role}"] = common.ratio(per_message(omni["cpu"], role), per_message(zmq["cpu"], role))
                entry["omni/zmq cpu per chunk all processes"] = common.ratio(omni["cpu_us_per_chunk"], zmq["cpu_us_per_chunk"])
            doc["ratios"][key] = entry
            if omni is not None:
                doc["checks"][f"relay {relay}, {c} streams: omni completed every round (no timeout, no error)"] = _ok(omni)
                doc["checks"][f"relay {relay}, {c} streams: omni chunks complete, in order and intact"] = (
                    _ok(omni) and omni["bad_chunks"] == 0 and omni["short_streams"] == 0)
            if c == 16:
                got = entry.get("omni/zmq chunks/s")
                doc["checks"][f"relay {relay}, 16 streams: omni >= {TARGET_AT_16} x raw pyzmq chunks/s"] = got is not None and got >= TARGET_AT_16


def _stat(r: dict[str, Any] | None, key: str, stat: str = "median") -> float | None:
    return (r or {}).get(key, {}).get(stat) if _ok(r) else None


def _status(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    if r["status"] != "ok":
        return r["status"].upper()
    return "ok" if not (r["bad_chunks"] or r["short_streams"]) else f"{r['bad_chunks']} bad, {r['short_streams']} short"


def summary(doc: dict[str, Any]) -> str:
    rates, cpus = [], []
    for r in doc["rows"]:
        if r["impl"] != "omni":
            continue
        relay, c = r["relay"], r["concurrency"]
        z = row(doc, relay, c, "zmq")
        zcpu = (z or {}).get("cpu") if _ok(z) else None
        ocpu = r["cpu"] if _ok(r) else None
        ratios = doc["ratios"].get(f"{relay} {c}", {})
        rates.append([relay, c, _stat(r, "chunks_per_s"), _stat(z, "chunks_per_s"), ratios.get("omni/zmq chunks/s"),
                      _stat(r, "latency_us"), _stat(r, "latency_us", "p99"), _stat(z, "latency_us"), _stat(z, "latency_us", "p99"),
                      _status(r), _status(z)])
        cpus.append([relay, c, per_message(ocpu, "src"), per_message(ocpu, "sink"), per_message(zcpu, "src"), per_message(zcpu, "sink"),
                     ratios.get("omni/zmq cpu per chunk src"), ratios.get("omni/zmq cpu per chunk sink"),
                     r["cpu_us_per_chunk"] if ocpu else None, (z or {}).get("cpu_us_per_chunk") if zcpu else None,
                     (ocpu or {}).get("cores"), (ocpu or {}).get("machine_cores")])
    chunks = doc["parameters"].get("chunks")
    head = (f"stream_to edge, {chunks} chunks per stream, each a [1, 1, {HIDDEN}] bfloat16 hidden state + a token id "
            "(median chunks/s; per-chunk latency emit -> read, µs; ratio > 1 means omni is faster)")
    text = head + "\n" + common.table(["relay", "streams", "omni chunks/s", "pyzmq chunks/s", "omni/pyzmq", "omni p50 µs",
                                       "omni p99", "pyzmq p50", "pyzmq p99", "omni status", "pyzmq status"], rates)
    text += ("\n\nCPU µs per chunk (user + system, every thread, from /proc) of the emitting (src) and reading (sink) "
             "process, and of every process together (caller and head included); cores busy during omni's rounds\n")
    return text + common.table(["relay", "streams", "omni src", "omni sink", "pyzmq src", "pyzmq sink", "src omni/pyzmq",
                                "sink omni/pyzmq", "omni all", "pyzmq all", "omni cores", "machine cores"], cpus)


def plot(doc: dict[str, Any], path: str, plt: Any) -> None:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
    relays = list(dict.fromkeys(r["relay"] for r in doc["rows"]))
    cs = sorted({r["concurrency"] for r in doc["rows"]})
    styles = iter(("o-", "s-", "d-", "v-", "^-", "x-"))
    failed = [f"omni ({r['relay']}) {r['concurrency']} streams: {r['status']}" for r in doc["rows"]
              if r["impl"] == "omni" and not _ok(r)]
    if failed:
        a1.text(0.98, 0.02, "not measured:\n" + "\n".join(failed), transform=a1.transAxes, fontsize=7, va="bottom", ha="right",
                color="crimson")
    for relay in relays:
        for impl in IMPLS:
            if impl == "zmq" and relay != relays[0]:
                continue  # the raw stream does not depend on omni's relay: draw it once
            pts = [(c, row(doc, relay, c, impl)) for c in cs if _ok(row(doc, relay, c, impl))]
            if not pts:
                continue
            label = f"omni ({relay})" if impl == "omni" else LABELS[impl]
            style = next(styles)
            a1.plot([c for c, _ in pts], [r["chunks_per_s"]["median"] for _, r in pts], style, label=label)
            a2.plot([c for c, _ in pts], [r["latency_us"]["median"] for _, r in pts], style, label=f"{label} p50")
    for ax, title, ylabel in ((a1, "stream: chunks per second", "chunks / s (median)"),
                              (a2, "stream: per-chunk latency", "µs, emit -> read")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_yscale("log")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

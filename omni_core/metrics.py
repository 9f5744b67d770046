"""Metrics of a pipeline, counted where things happen and aggregated over every process.

Each process keeps its own counters and histograms in plain dicts (no lock on the hot path: one
dict update under the GIL). Stage processes publish theirs as a small JSON file in the run's
private runtime directory (``<runtime_dir>/metrics/<process>.<pid>.json``), rewritten by a
background thread at most every :data:`EXPORT_INTERVAL` seconds when something changed, and once
more when the process exits. The caller's process (a server, an embedder) reads those files and
merges them with its own counts: :func:`collect`. A file per pid means a restarted process keeps
the counts of its predecessor, and the number of pids per process name is its restart count.

The runtime calls (stage processes)::

    meter = metrics.stage_meter(stage)             # once per stage (its series looked up once)
    meter.started()                                # a call began (the stage's in-flight gauge)
    meter.ended(status, seconds, request_id)       # it ended; status: ok | error | aborted
    meter.chunk()                                  # one chunk emitted by a stage
    metrics.relay_bytes(relay, src, dst, nbytes)   # tensor bytes put through a relay

The caller's side is measured around ``Pipeline.submit``/``Pipeline.stream`` by
:class:`RequestMeter`, which ``omni serve`` uses and embedders can use the same way::

    meter = RequestMeter(pipeline)
    result = await meter.submit(inputs)
    text = meter.prometheus_text()      # or meter.snapshot() for plain data

Besides the aggregates, each stage process keeps its last :data:`RECENT_CALLS` calls (request id,
stage, start, duration, outcome) in its export, and a :class:`RequestMeter` its last
:data:`RECENT_REQUESTS` requests (id, outcome, latency, chunks per stage): ``omni serve``'s console
joins them by request id into a per-stage timeline of each recent request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import Any

#: Seconds between two exports of a stage process's metrics (only when something changed).
EXPORT_INTERVAL = 0.25

#: Stage calls a process remembers for per-request timelines (its export's ``calls``).
RECENT_CALLS = 256

#: Requests a :class:`RequestMeter` remembers (:attr:`RequestMeter.recent`).
RECENT_REQUESTS = 50

#: Histogram buckets (seconds): from sub-millisecond hops to minute-long generations.
BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)

#: Every metric omni exports: name → (type, help, label names).
DEFINITIONS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "omni_requests_total": ("counter", "Requests that ended, by outcome.", ("pipeline", "status")),
    "omni_request_duration_seconds": ("histogram", "Request latency, from admission to its result or error.", ("pipeline",)),
    "omni_time_to_first_chunk_seconds": ("histogram", "Time from admission to the first streamed chunk.", ("pipeline",)),
    "omni_requests_in_flight": ("gauge", "Requests admitted and not ended.", ("pipeline",)),
    "omni_stage_calls_total": ("counter", "Stage calls that ended, by outcome (ok, error, aborted).", ("stage", "status")),
    "omni_stage_in_flight": ("gauge", "Stage calls running now (live processes only).", ("stage",)),
    "omni_stage_duration_seconds": ("histogram", "Duration of one stage call.", ("stage",)),
    "omni_stream_chunks_total": ("counter", "Chunks a stage emitted.", ("stage",)),
    "omni_relay_bytes_total": ("counter", "Tensor bytes put through a relay, by sending and receiving process.", ("relay", "src", "dst")),
    "omni_process_restarts_total": ("counter", "Times a stage process was restarted.", ("process",)),
    "omni_request_retries_total": ("counter", "Requests run again after their process died or hung (retry), by error.", ("pipeline", "error")),
}

#: Gauges the stage processes count: a dead process's last value is not summed.
PROCESS_GAUGES = ("omni_stage_in_flight",)

METRIC_KINDS = ("counter", "gauge", "histogram")


def define(name: str, kind: str, help_text: str, labels: tuple[str, ...]) -> None:
    """Add a metric of a plugin (an API of ``omni serve``, say) to :data:`DEFINITIONS`, so that
    the Prometheus text shows it. Defining the same metric again is a no-op; another definition
    under a defined name is a ValueError naming both."""
    if kind not in METRIC_KINDS:
        raise ValueError(f"metric {name!r}: kind must be one of {', '.join(METRIC_KINDS)}, got {kind!r}")
    if not name.startswith("omni_") or not name.replace("_", "").isalnum():
        raise ValueError(f"metric {name!r}: a name starts with 'omni_' and holds letters, digits and '_'")
    wanted = (kind, help_text, tuple(labels))
    have = DEFINITIONS.setdefault(name, wanted)
    if have != wanted:
        raise ValueError(f"metric {name!r} is defined already as {have}; cannot define it as {wanted}")

Labels = tuple[str, ...]


class Store:
    """One process's metrics: counters, gauges and histograms keyed by metric and labels."""

    def __init__(self) -> None:
        self.values: dict[str, dict[Labels, float]] = {}
        self.histograms: dict[str, dict[Labels, list[float]]] = {}
        #: the last stage calls: ``[request_id, stage, start (epoch s), seconds, status]``
        self.calls: deque[list[Any]] = deque(maxlen=RECENT_CALLS)
        self.version = 0

    def inc(self, name: str, labels: Labels, value: float = 1.0) -> None:
        series = self.values.setdefault(name, {})
        series[labels] = series.get(labels, 0.0) + value
        self.version += 1

    def set(self, name: str, labels: Labels, value: float) -> None:
        """A gauge's value."""
        self.values.setdefault(name, {})[labels] = float(value)
        self.version += 1

    def observe(self, name: str, labels: Labels, seconds: float) -> None:
        """``[count per bucket ..., count, sum]``: bucket counts are not cumulative here."""
        series = self.histograms.setdefault(name, {})
        row = series.get(labels)
        if row is None:
            row = series[labels] = [0.0] * (len(BUCKETS) + 3)
        row[bisect_left(BUCKETS, seconds)] += 1  # index len(BUCKETS): above the last bucket
        row[-2] += 1
        row[-1] += seconds
        self.version += 1

    def snapshot(self) -> dict[str, Any]:
        """Plain, JSON-able data: ``{"values": {name: [[labels, value], ...]}, "histograms": ...}``."""
        return {
            "values": {n: [[list(k), v] for k, v in list(s.items())] for n, s in list(self.values.items())},
            "histograms": {n: [[list(k), list(v)] for k, v in list(s.items())] for n, s in list(self.histograms.items())},
        }


def merge(snapshots: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Sum snapshots of several processes into one (same shape as :meth:`Store.snapshot`)."""
    values: dict[str, dict[Labels, float]] = {}
    histograms: dict[str, dict[Labels, list[float]]] = {}
    for snap in snapshots:
        for name, rows in snap.get("values", {}).items():
            series = values.setdefault(name, {})
            for labels, value in rows:
                series[tuple(labels)] = series.get(tuple(labels), 0.0) + value
        for name, rows in snap.get("histograms", {}).items():
            counts = histograms.setdefault(name, {})
            for labels, row in rows:
                have = counts.get(tuple(labels))
                counts[tuple(labels)] = list(row) if have is None else [a + b for a, b in zip(have, row, strict=True)]
    return {
        "values": {n: [[list(k), v] for k, v in s.items()] for n, s in values.items()},
        "histograms": {n: [[list(k), v] for k, v in s.items()] for n, s in histograms.items()},
    }


#: This process's metrics.
local = Store()


# -- what the runtime calls (stage processes) ------------------------------------------------------


class StageMeter:
    """What one stage's calls count (its in-flight gauge, calls by outcome, durations, chunks,
    recent calls), with its series looked up once: a stage call is on the hot path, where
    :meth:`Store.inc`'s lookups per update were a tenth of a stage process's Python calls."""

    __slots__ = ("stage", "_store", "_key", "_in_flight", "_calls", "_chunks", "_durations", "_row")

    def __init__(self, stage: str, store: Store | None = None):
        store = local if store is None else store
        self.stage = stage
        self._store = store
        self._key = (stage,)
        self._in_flight = store.values.setdefault("omni_stage_in_flight", {})
        self._calls = store.values.setdefault("omni_stage_calls_total", {})
        self._chunks = store.values.setdefault("omni_stream_chunks_total", {})
        self._durations = store.histograms.setdefault("omni_stage_duration_seconds", {})
        self._row: list[float] | None = None

    def started(self) -> None:
        """A call began."""
        series, key = self._in_flight, self._key
        series[key] = series.get(key, 0.0) + 1.0
        self._store.version += 1

    def ended(self, status: str, seconds: float, request_id: str | None = None) -> None:
        """A call ended (``status``: ok, error or aborted) after ``seconds``."""
        store, key = self._store, self._key
        series = self._in_flight
        series[key] = series.get(key, 0.0) - 1.0
        calls, outcome = self._calls, (self.stage, status)
        calls[outcome] = calls.get(outcome, 0.0) + 1.0
        row = self._row
        if row is None:
            row = self._row = self._durations.setdefault(key, [0.0] * (len(BUCKETS) + 3))
        row[bisect_left(BUCKETS, seconds)] += 1  # as Store.observe
        row[-2] += 1
        row[-1] += seconds
        store.version += 3
        if request_id is not None:
            store.calls.append([request_id, self.stage, time.time() - seconds, seconds, status])

    def chunk(self) -> None:
        """The stage emitted a stream chunk."""
        series, key = self._chunks, self._key
        series[key] = series.get(key, 0.0) + 1.0
        self._store.version += 1


_meters: dict[str, StageMeter] = {}


def stage_meter(stage: str) -> StageMeter:
    """The :class:`StageMeter` of ``stage`` in this process."""
    meter = _meters.get(stage)
    if meter is None:
        meter = _meters[stage] = StageMeter(stage)
    return meter


def stage_started(stage: str) -> None:
    stage_meter(stage).started()


def stage_call(stage: str, status: str, seconds: float, request_id: str | None = None) -> None:
    """A call of ``stage`` ended (one :func:`stage_started` before it)."""
    stage_meter(stage).ended(status, seconds, request_id)


def stream_chunk(stage: str) -> None:
    stage_meter(stage).chunk()


def relay_bytes(relay: str, src: str, dst: str, nbytes: int) -> None:
    local.inc("omni_relay_bytes_total", (relay, src, dst), float(nbytes))


# -- export from a stage process -------------------------------------------------------------------


def metrics_dir(runtime_dir: str) -> str:
    return os.path.join(runtime_dir, "metrics")


class Exporter:
    """Writes this process's metrics to ``<runtime_dir>/metrics/<process>.<pid>.json`` when they
    changed, from a daemon thread; :meth:`close` writes a last time."""

    def __init__(self, runtime_dir: str, process: str, *, store: Store = local, interval: float = EXPORT_INTERVAL):
        self.folder = metrics_dir(runtime_dir)
        self.path = os.path.join(self.folder, f"{process}.{os.getpid()}.json")
        self.process = process
        self.store = store
        self.interval = interval
        self._written = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="omni-metrics", daemon=True)

    def start(self) -> Exporter:
        with contextlib.suppress(OSError):
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
        self.write()  # at once: a (re)started process is counted even before it serves
        self._thread.start()
        return self

    def write(self) -> None:
        version = self.store.version
        if version == self._written:
            return
        data = {"process": self.process, "pid": os.getpid(), **self.store.snapshot(), "calls": list(self.store.calls)}
        partial = f"{self.path}.partial"
        try:
            with open(partial, "w") as f:
                f.write(json.dumps(data))  # one write: json.dump writes piece by piece (7 x the time)
            os.replace(partial, self.path)
        except OSError:  # the runtime dir is gone: the pipeline is stopping
            return
        self._written = version

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.write()

    def close(self, *, remove: bool = False) -> None:
        """Stop exporting: a last write, or with ``remove`` (nobody will read it) remove this
        process's file, and the folder once it is empty."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(1.0)
        if not remove:
            self.write()
            return
        for path in (self.path, f"{self.path}.partial"):
            with contextlib.suppress(OSError):
                os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(self.folder)


# -- reading them in the caller ----------------------------------------------------------------------


def read_processes(runtime_dir: str | None) -> list[dict[str, Any]]:
    """Every stage process's last export (a file that cannot be read yet is skipped)."""
    if not runtime_dir:
        return []
    folder = metrics_dir(runtime_dir)
    found = []
    with contextlib.suppress(OSError):
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if not entry.name.endswith(".json"):
                continue
            with contextlib.suppress(OSError, ValueError), open(entry.path) as f:
                found.append(json.load(f))
    return found


def restarts(exports: list[dict[str, Any]]) -> dict[str, int]:
    """Process name → restarts: every pid that exported beyond the first."""
    pids: dict[str, set[int]] = {}
    for export in exports:
        pids.setdefault(export["process"], set()).add(export["pid"])
    return {name: len(p) - 1 for name, p in pids.items()}


def live_exports(pipeline: Any, exports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``exports`` with the :data:`PROCESS_GAUGES` of processes that are gone left out (a
    process killed mid-call never counted its calls down)."""
    pids = getattr(pipeline, "pids", None)
    if pids is None:
        return exports
    live = {pid for pid in pids().values() if pid is not None}
    out = []
    for export in exports:
        if export.get("pid") not in live:
            values = {n: v for n, v in export.get("values", {}).items() if n not in PROCESS_GAUGES}
            export = {**export, "values": values}
        out.append(export)
    return out


def collect(pipeline: Any, *, caller: Store | None = None, exports: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The pipeline's metrics over every process: the stage processes' exports (at most
    :data:`EXPORT_INTERVAL` old; ``exports``: those already read), ``caller``'s counts (request
    metrics), and restarts."""
    if exports is None:
        exports = read_processes(getattr(pipeline, "runtime_dir", None))
    restart_counts = restarts(exports)
    snap = merge([*live_exports(pipeline, exports), *([caller.snapshot()] if caller is not None else [])])
    if restart_counts:
        snap["values"]["omni_process_restarts_total"] = [[[name], float(n)] for name, n in sorted(restart_counts.items())]
    retries = getattr(pipeline, "retries", None)
    if isinstance(retries, dict) and retries:
        name = pipeline.config.name
        snap["values"]["omni_request_retries_total"] = [[[name, error], float(n)] for error, n in sorted(retries.items())]
    return snap


# -- the caller's side ---------------------------------------------------------------------------------


class RequestMeter:
    """Counts requests of one pipeline around ``submit``/``stream``: outcomes, latency, time to
    first chunk and requests in flight. ``status`` of ``omni_requests_total`` is one of ``ok``,
    ``error`` (a stage failed or a process died), ``overloaded``, ``timeout``, ``aborted``
    (abort, client gone, pipeline stopped), ``unavailable`` (pipeline not running), ``invalid``
    (bad inputs or request id).

    :attr:`recent` holds the last :data:`RECENT_REQUESTS` requests that ended, oldest first:
    ``{"id", "status", "start" (epoch s), "seconds", "stream", "chunks": {stage: [count, first s,
    last s]}, "error": {"type", "stage"} or None}`` (chunk times from the request's start)."""

    def __init__(self, pipeline: Any, store: Store | None = None):
        self.pipeline = pipeline
        self.name = pipeline.config.name
        self.store = store or Store()
        self.in_flight = 0
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)
        self.store.values.setdefault("omni_requests_in_flight", {})[(self.name,)] = 0.0

    def _gauge(self, delta: int) -> None:
        self.in_flight += delta
        self.store.values.setdefault("omni_requests_in_flight", {})[(self.name,)] = float(self.in_flight)
        self.store.version += 1

    def ended(self, status: str, seconds: float) -> None:
        self.store.inc("omni_requests_total", (self.name, status))
        self.store.observe("omni_request_duration_seconds", (self.name,), seconds)

    def first_chunk(self, seconds: float) -> None:
        self.store.observe("omni_time_to_first_chunk_seconds", (self.name,), seconds)

    def _remember(self, request_id: str | None, status: str, wall: float, seconds: float,
                  chunks: dict[str, list[float]] | None, error: BaseException | None) -> None:
        stage = getattr(error, "stage", None) or next(iter(getattr(error, "stages", None) or ()), None)
        self.recent.append({
            "id": request_id, "status": status, "start": wall, "seconds": seconds, "stream": chunks is not None,
            "chunks": chunks or {},
            "error": None if error is None else {"type": getattr(error, "error_type", None) or type(error).__name__, "stage": stage},
        })

    async def submit(self, inputs: Any, *, request_id: str | None = None, from_network: bool = False) -> Any:
        wall, start = time.time(), time.perf_counter()
        self._gauge(+1)
        status = "error"
        error = None
        try:
            result = await self.pipeline.submit(inputs, request_id=request_id, from_network=from_network)
            status = "ok"
            return result
        except BaseException as exc:
            status, error = outcome(exc), exc
            raise
        finally:
            self._gauge(-1)
            seconds = time.perf_counter() - start
            self.ended(status, seconds)
            self._remember(request_id, status, wall, seconds, None, error)

    async def stream(self, inputs: Any, *, request_id: str | None = None,
                     from_network: bool = False) -> AsyncGenerator[Any, None]:
        wall, start = time.time(), time.perf_counter()
        self._gauge(+1)
        status = "aborted"  # left before the result: the caller stopped reading
        error = None
        first = True
        chunks: dict[str, list[float]] = {}
        try:
            async for event in self.pipeline.stream(inputs, request_id=request_id, from_network=from_network):
                if not event.is_result:
                    now = time.perf_counter() - start
                    if first:
                        first = False
                        self.first_chunk(now)
                    seen = chunks.get(event.stage)
                    if seen is None:
                        chunks[event.stage] = [1, now, now]
                    else:
                        seen[0] += 1
                        seen[2] = now
                if event.is_result:
                    status = "ok"
                yield event
        except BaseException as exc:
            if status != "ok":  # closing the iterator after the result is no abort
                status, error = outcome(exc), exc
            raise
        finally:
            self._gauge(-1)
            seconds = time.perf_counter() - start
            self.ended(status, seconds)
            self._remember(request_id, status, wall, seconds, chunks, error)

    def snapshot(self) -> dict[str, Any]:
        return collect(self.pipeline, caller=self.store)

    def prometheus_text(self) -> str:
        return prometheus_text(self.snapshot())


def outcome(exc: BaseException) -> str:
    """The ``status`` label of a request that ended with ``exc``."""
    from .errors import Overloaded, PipelineClosed, RequestAborted, RequestTimeout

    if isinstance(exc, Overloaded):
        return "overloaded"
    if isinstance(exc, (RequestTimeout, asyncio.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(exc, (RequestAborted, asyncio.CancelledError, GeneratorExit)):
        return "aborted"
    if isinstance(exc, PipelineClosed):
        return "unavailable"
    if isinstance(exc, (ValueError, TypeError)):
        return "invalid"
    return "error"


# -- Prometheus text ---------------------------------------------------------------------------------------


def prometheus_text(snapshot: Mapping[str, Any], *, definitions: Mapping[str, tuple[str, str, tuple[str, ...]]] | None = None) -> str:
    """The snapshot in Prometheus' text exposition format (through prometheus-client);
    ``definitions``: the metrics to show instead of :data:`DEFINITIONS` (``omni serve`` with
    several pipelines adds a ``pipeline`` label to each)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    values = snapshot.get("values", {})
    histograms = snapshot.get("histograms", {})

    class _Collector:
        def collect(self):
            for name, (kind, help_text, labelnames) in (DEFINITIONS if definitions is None else definitions).items():
                if kind == "histogram":
                    family = HistogramMetricFamily(name, help_text, labels=labelnames)
                    for labels, row in histograms.get(name, []):
                        cumulative, buckets = 0.0, []
                        for bound, count in zip((*BUCKETS, float("inf")), row[: len(BUCKETS) + 1], strict=True):
                            cumulative += count
                            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
                        family.add_metric(list(labels), buckets, row[-1])
                else:
                    metric_name = name.removesuffix("_total") if kind == "counter" else name
                    family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                        metric_name, help_text, labels=labelnames)
                    for labels, value in values.get(name, []):
                        family.add_metric(list(labels), value)
                yield family

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry).decode()

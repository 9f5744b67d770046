"""The omni console: ``GET /`` of ``omni serve``, a page to watch the pipeline live and try it.

Everything the page shows comes from what the server already keeps; this module only reads it:

- the **graph** from the plan the runner launched (process groups, GPUs, each edge's relay);
- the **live state** from :func:`omni_core.metrics.collect` (the stage processes' exports plus the
  server's request counts: the same numbers as ``/metrics``), the runner's supervision states
  (:meth:`~omni_core.runtime.pipeline.Pipeline.process_states`) and the server's drain state;
- the **recent requests** from the server's :class:`~omni_core.metrics.RequestMeter` (outcome,
  latency, chunks per stage) joined by request id with the stage calls each stage process
  remembers (start and duration of each call): a per-stage timeline.

Routes (none of them with ``--no-console``):

- ``GET /``: the page; its script and style sheet at ``GET /console/static/{name}`` (files shipped
  in this package, nothing fetched from elsewhere; a Content-Security-Policy keeps it so);
- ``GET /console/events``: the push channel (SSE): ``event: topology`` once the plan is known,
  then ``event: state`` every :data:`PUSH_INTERVAL` seconds until the client leaves or the server
  drains;
- ``GET /console/state``: the same two objects as one JSON document (``{"topology", "state"}``);
- ``POST /console/requests``: the playground: the body of ``POST /v1/pipelines/{name}/requests``,
  answered as SSE (``chunk``, then ``result`` or ``error``); an ``error`` event also carries the
  stage's traceback with file paths cut down to file names.

Nothing here shows a path, an address or an environment variable: what ``/v1/pipelines`` shows
(stage and process names, pids, states) plus the plan's groups, devices and relays.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import deque
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from .. import metrics
from ..encoding import to_jsonable
from .context import (
    ApiContext,
    ClientGone,
    EventStream,
    ServeState,
    new_request_id,
    read_json,
    request_fields,
    sse,
    stream_body,
    until_disconnect,
)
from .errors import HTTPError, error_response

#: Seconds between two ``state`` events of the push channel.
PUSH_INTERVAL = 0.5

#: Seconds over which requests/s are measured.
RATE_WINDOW = 5.0

#: Recent requests a ``state`` event carries (newest first).
RECENT_SHOWN = 20

#: The page's own files (``GET /console/static/{name}``) and their media types.
STATIC = {
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}

#: Nothing but this server: scripts, styles, connections, media (audio is played from blobs).
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data: blob:; media-src 'self' blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

_TRACEBACK_PATH = re.compile(r'File "(?:[^"]*[/\\])?([^"/\\]+)"')


def _static(name: str) -> str:
    return resources.files("omni_core.serve").joinpath("static").joinpath(name).read_text(encoding="utf-8")


def strip_paths(traceback: str) -> str:
    """A traceback with each ``File "/dir/name.py"`` cut down to ``File "name.py"``."""
    return _TRACEBACK_PATH.sub(r'File "\1"', traceback)


# -- what the page shows ------------------------------------------------------------------------------


def example_input(state: ServeState) -> Any:
    """The playground's example: ``serve.options.console.example`` of the config, else ``{}``."""
    options = state.pipeline.config.serve.options.get("console", {})
    return options.get("example", {}) if isinstance(options, dict) else {}


def topology(state: ServeState, registry: Any = None) -> dict[str, Any] | None:
    """The graph: process groups (with their GPUs and processes), stages, edges and relays, and the
    chat route of a mounted API (``registry``'s registration, by default the process's); None until
    the plan is known (the pipeline is starting)."""
    plan = state.pipeline.plan
    if plan is None:
        return None
    from ..plan.render import group_label

    cfg = plan.config
    apis = state.apis if hasattr(state, "apis") else state.settings.apis  # the APIs serving this pipeline
    chat = chat_path(apis, registry, cfg.serve.options)
    speech = route_path("speech", apis, registry, cfg.serve.options)
    transcription = route_path("transcription", apis, registry, cfg.serve.options)
    groups = []
    for name in plan.groups:
        procs = plan.group(name)
        groups.append({
            "name": name,
            "label": group_label(plan, name),
            "stages": list(procs[0].stages),
            "gpus": list(dict.fromkeys(p.gpu for p in procs if p.gpu is not None)),
            "processes": [{"name": p.name, "replica": p.replica, "tp_rank": p.tp_rank, "gpu": p.gpu} for p in procs],
        })
    return {
        "pipeline": cfg.name,
        "description": cfg.description,
        "entry": cfg.entry,
        "stages": list(cfg.stage_names),
        "terminal_stages": list(cfg.terminal_stages),
        "groups": groups,
        "edges": [{"src": e.src, "dst": e.dst, "kind": e.kind, "relay": e.relay,
                   "label": e.relay if e.kind == "next" else f"stream: {e.relay}"} for e in plan.edges],
        "apis": list(apis),
        "chat": chat,
        "speech": speech,
        "transcription": transcription,
        "openai": chat is not None,  # the former name of "chat is not None"
        "example": to_jsonable(example_input(state)),
        "requests_path": f"/v1/pipelines/{cfg.name}/requests",
    }


def chat_path(apis: Any, registry: Any = None, options: Any = None) -> str | None:
    """The path of the chat completions route of the first mounted API whose registration says it
    serves one for this pipeline (:func:`route_path` ``"chat"``)."""
    return route_path("chat", apis, registry, options)


def route_path(key: str, apis: Any, registry: Any = None, options: Any = None) -> str | None:
    """The path of the OpenAI-style ``key`` route (``chat``, ``speech``, ``transcription``) of the
    first mounted API whose registration says it serves one for this pipeline:
    ``register(..., chat="/v1/chat/completions")``, or ``chat="pkg.mod:fn"``, ``fn(the pipeline's
    serve.options[API])`` giving the path or None (an API that mounts speech routes instead of chat
    for some pipelines). The console's tab for it talks to that path; without one (None) the tab is
    not shown."""
    from ..plugins import get_registry
    from ..registry import import_ref

    try:
        registry = registry if registry is not None else get_registry()
        for name in apis:
            if registry.kind_of(name, ("api",)) != "api" or not (path := registry.get("api", name).meta.get(key)):
                continue
            if not str(path).startswith("/"):  # decided per pipeline, from its options for this API
                mine = (options or {}).get(name) if isinstance(options, dict) else None
                path = import_ref(path)(dict(mine) if isinstance(mine, dict) else {})
            if path:
                return str(path)
    except Exception:  # the tab is a courtesy: never fail the page over it
        return None
    return None


def quantile(row: list[float] | None, q: float) -> float | None:
    """The ``q`` quantile (seconds) of a histogram row (``[count per bucket ..., count, sum]``),
    interpolated inside its bucket; None without observations."""
    if not row or row[-2] <= 0:
        return None
    rank = q * row[-2]
    seen = 0.0
    for i, count in enumerate(row[: len(metrics.BUCKETS) + 1]):
        if count and seen + count >= rank:
            low = metrics.BUCKETS[i - 1] if i > 0 else 0.0
            high = metrics.BUCKETS[i] if i < len(metrics.BUCKETS) else max(low, row[-1] / row[-2])
            return low + (high - low) * (rank - seen) / count
        seen += count
    return None


def _series(snap: dict[str, Any], kind: str, name: str) -> dict[tuple[str, ...], Any]:
    return {tuple(labels): value for labels, value in snap.get(kind, {}).get(name, [])}


class Feed:
    """Builds the ``state`` events of one push channel (rates are measured between its own
    snapshots, over :data:`RATE_WINDOW`)."""

    def __init__(self, state: ServeState):
        self.state = state
        self.history: deque[tuple[float, dict[str, float]]] = deque()

    def _rates(self, now: float, totals: dict[str, float]) -> dict[str, float]:
        self.history.append((now, totals))
        while len(self.history) > 2 and now - self.history[1][0] >= RATE_WINDOW:
            self.history.popleft()
        then, old = self.history[0]
        span = now - then
        if span <= 0:
            return dict.fromkeys(totals, 0.0)
        return {k: max(0.0, (v - old.get(k, 0.0)) / span) for k, v in totals.items()}

    def snapshot(self, exports: list[dict[str, Any]]) -> dict[str, Any]:
        """The state event, from the stage processes' ``exports`` (:func:`read_exports`)."""
        state = self.state
        pipeline = state.pipeline
        cfg = pipeline.config
        snap = metrics.collect(pipeline, caller=state.meter.store, exports=exports)
        calls = _series(snap, "values", "omni_stage_calls_total")
        durations = _series(snap, "histograms", "omni_stage_duration_seconds")
        in_flight = _series(snap, "values", "omni_stage_in_flight")
        chunks = _series(snap, "values", "omni_stream_chunks_total")
        requests = _series(snap, "values", "omni_requests_total")
        latency = _series(snap, "histograms", "omni_request_duration_seconds").get((cfg.name,))
        relayed = _series(snap, "values", "omni_relay_bytes_total")

        totals = {f"stage:{s}": sum(v for (stage, _), v in calls.items() if stage == s) for s in cfg.stage_names}
        totals["requests"] = sum(requests.values())
        totals.update({"relay:" + "|".join(key): v for key, v in relayed.items()})
        now = time.monotonic()
        rates = self._rates(now, totals)
        stages = {}
        for name in cfg.stage_names:
            row = durations.get((name,))
            stages[name] = {
                "in_flight": int(in_flight.get((name,), 0)),
                "calls": int(totals[f"stage:{name}"]),
                "requests_per_s": round(rates[f"stage:{name}"], 3),
                "p50": quantile(row, 0.5),
                "p99": quantile(row, 0.99),
                "errors": int(calls.get((name, "error"), 0)),
                "chunks": int(chunks.get((name,), 0)),
            }
        pids = pipeline.pids()
        processes = {name: {**info, "pid": pids.get(name)} for name, info in pipeline.process_states().items()}
        return {
            "time": time.time(),
            "pipeline": {
                "name": cfg.name,
                "state": "draining" if state.draining else pipeline.state,
                "ready": state.ready,
                "in_flight": state.meter.in_flight,
                "requests_per_s": round(rates["requests"], 3),
                "requests": {status: int(v) for (_, status), v in requests.items()},
                "p50": quantile(latency, 0.5),
                "p99": quantile(latency, 0.99),
                "restarts": pipeline.restarts,
            },
            "stages": stages,
            "processes": processes,
            # tensor bytes through each relay, by sending and receiving process ("coordinator": the server)
            "relays": [{"relay": relay, "src": src or "coordinator", "dst": dst or "coordinator", "bytes": int(v),
                        "bytes_per_s": round(rates["relay:" + "|".join((relay, src, dst))], 1)}
                       for (relay, src, dst), v in sorted(relayed.items())],
            "recent": recent_requests(state.meter.recent, exports),
        }


async def read_exports(state: ServeState) -> list[dict[str, Any]]:
    """The stage processes' metric exports, read off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, metrics.read_processes, state.pipeline.runtime_dir)


def recent_requests(recent: Any, exports: list[dict[str, Any]], limit: int = RECENT_SHOWN) -> list[dict[str, Any]]:
    """The last ``limit`` requests, newest first, each with its stage calls (``stages``: stage,
    start from the request's start, seconds, status) as far as the stage processes still remember
    them."""
    shown = list(recent)[-limit:][::-1]
    wanted = {r["id"]: r for r in shown if r["id"] is not None}
    calls: dict[str, list[dict[str, Any]]] = {}
    for export in exports:
        for request_id, stage, start, seconds, status in export.get("calls", ()):
            req = wanted.get(request_id)
            # An id can be reused once its request ended: only calls inside this request count.
            if req is None or not (req["start"] - 1.0 <= start <= req["start"] + req["seconds"] + 1.0):
                continue
            calls.setdefault(request_id, []).append({
                "stage": stage, "start": round(max(0.0, start - req["start"]), 6), "seconds": round(seconds, 6), "status": status,
            })
    out = []
    for req in shown:
        stages = sorted(calls.get(req["id"], []), key=lambda c: c["start"])
        out.append({**req, "start": round(req["start"], 3), "seconds": round(req["seconds"], 6), "stages": stages})
    return out


# -- routes ---------------------------------------------------------------------------------------------


def routes(state: ServeState) -> list[Any]:
    """The console's routes for ``state``'s server."""
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    apis = {s.name: ApiContext("console", s.pipeline, s.settings, {}, s) for s in state.group.values()}
    headers = {"content-security-policy": CSP, "x-content-type-options": "nosniff", "cache-control": "no-cache"}

    async def page(request):
        return HTMLResponse(_static("console.html"), headers=headers)

    async def static(request):
        name = request.path_params["name"]
        if name not in STATIC:
            return error_response(HTTPError(404, "NotFound", f"GET {request.url.path}: no such console file"))
        return Response(_static(name), media_type=STATIC[name], headers=headers)

    def chosen(request) -> ApiContext:
        """The pipeline a console request is about: ``?pipeline=NAME`` (a server may serve
        several), the first one without it; a 404 naming those served otherwise."""
        name = request.query_params.get("pipeline")
        if name is None:
            return next(iter(apis.values()))
        if name not in apis:
            served = ", ".join(repr(n) for n in apis)
            raise HTTPError(404, "UnknownPipeline", f"unknown pipeline {name!r}; this server serves {served}")
        return apis[name]

    async def current(request):
        try:
            one = chosen(request).state
        except HTTPError as exc:
            return error_response(exc)
        body = {"topology": topology(one), "state": Feed(one).snapshot(await read_exports(one))}
        if len(apis) > 1:  # a server of several pipelines: their names, for ?pipeline=
            body["pipelines"] = list(apis)
        return JSONResponse(body)

    async def events(request):
        try:
            one = chosen(request).state
        except HTTPError as exc:
            return error_response(exc)
        return EventStream(push(one))

    async def playground(request):
        try:
            api = chosen(request)
            state = api.state
            inputs, _, request_id, timeout = request_fields(await read_json(request))
            request_id = request_id or new_request_id()
            state.check_available()
        except HTTPError as exc:
            return error_response(exc)
        request.scope.setdefault("state", {})["omni_request_id"] = request_id
        stream = api.stream(inputs, request_id=request_id, timeout=timeout, headers=request.headers)
        try:
            first = await until_disconnect(request.receive, stream.__anext__())
        except ClientGone:
            return Response(status_code=499)
        except StopAsyncIteration:
            first = None
        except Exception as exc:
            first = exc
        return EventStream(stream_body(request, stream, first, request_id, traceback=_traceback))

    return [
        Route("/", page, methods=["GET"]),
        Route("/console/static/{name}", static, methods=["GET"]),
        Route("/console/state", current, methods=["GET"]),
        Route("/console/events", events, methods=["GET"]),
        Route("/console/requests", playground, methods=["POST"]),
    ]


def _traceback(exc: BaseException) -> str:
    """A failed stage's traceback for the playground, paths cut to file names."""
    return strip_paths(getattr(exc, "traceback", "") or "")


async def push(state: ServeState) -> AsyncIterator[bytes]:
    """The push channel: the topology once known, then the state every :data:`PUSH_INTERVAL`
    seconds, until the server drains."""
    feed = Feed(state)
    sent_topology = False
    while not state.draining:
        if not sent_topology:
            graph = topology(state)
            if graph is not None:
                yield sse("topology", graph)
                sent_topology = True
        yield sse("state", json.dumps(feed.snapshot(await read_exports(state)), separators=(",", ":"), allow_nan=False))
        await asyncio.sleep(PUSH_INTERVAL)

"""The ASGI application of ``omni serve``: the core routes, the console (:mod:`.console`), the
mounted APIs, the access log.

One or several pipelines per server (``omni serve A B``: :attr:`ServeState.group`); the server
process is their caller. Every request that reaches
the pipeline goes through :class:`~omni_core.serve.context.ApiContext` (the core route, the
console and every API plugin alike), which refuses new work while the server drains, counts the
request in the metrics, aborts it when the client goes away, and bounds it by its timeout.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from typing import Any

import structlog

from ..encoding import to_jsonable
from ..logs import get_logger
from . import console
from .context import (
    ApiContext,
    ClientGone,
    EventStream,
    ServeState,
    new_request_id,
    note_error,
    read_json,
    request_fields,
    stream_body,
    until_disconnect,
)
from .context import ServeSettings as ServeSettings  # re-exported: it was defined here
from .errors import RETRY_AFTER, HTTPError, error_body, error_response

#: Paths of the console (``GET /``, see :mod:`.console`).
CONSOLE_PATHS = ("/", "/console/static/{name}", "/console/events", "/console/state", "/console/requests")

#: Paths of the core routes; an API may not take them.
CORE_PATHS = ("/health", "/ready", "/metrics", "/openapi.json", "/v1/plugins", "/v1/pipelines",
              "/v1/pipelines/{name}/requests", *CONSOLE_PATHS)


def build_app(state: ServeState, api_routes: list[Any] | None = None):
    """The Starlette app: the core routes, then every API's routes."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    def states() -> list[ServeState]:
        return list(state.group.values())

    def several(body: dict[str, Any]) -> dict[str, Any]:
        """With several pipelines: each one's own status beside the server's."""
        if len(state.group) > 1:
            body["pipelines"] = {s.name: _one_status(s) for s in states()}
        return body

    async def health(request):
        dead = next((s for s in states() if not s.alive), None)
        first = dead or state
        body = {"status": first.pipeline.state, "pipeline": first.name}
        if dead is not None and not dead.draining:  # it cannot go on: the server exits (see server.py)
            body["error"] = stopped_reason(dead)
        return JSONResponse(several(body), status_code=503 if dead is not None else 200)

    async def ready(request):
        waiting = next((s for s in states() if not s.ready), None)
        if waiting is None:
            return JSONResponse(several({"status": "ready", "pipeline": state.name}))
        dead = next((s for s in states() if not s.alive), None)
        why = "draining" if waiting.draining else waiting.pipeline.state
        if why == "running":
            why = "starting"
        body = {"status": why, "pipeline": waiting.name}
        if dead is not None and not dead.draining:
            body.update(status="failed", pipeline=dead.name, error=stopped_reason(dead))
        return JSONResponse(several(body), status_code=503, headers={"Retry-After": str(RETRY_AFTER)})

    async def metrics(request):
        text = await asyncio.get_running_loop().run_in_executor(None, prometheus_text, states())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def plugins(request):
        from ..plugins import get_plugins

        return JSONResponse([info.to_dict() for info in get_plugins().infos])

    async def pipelines(request):
        return JSONResponse({"pipelines": [{
            "name": s.pipeline.config.name,
            "description": s.pipeline.config.description,
            "state": s.pipeline.state,
            "ready": s.ready,
            "stages": s.pipeline.config.stage_names,
            "terminal_stages": list(s.pipeline.config.terminal_stages),
            "apis": list(s.apis),
            "processes": s.pipeline.pids(),
        } for s in states()]})

    apis = {s.name: ApiContext("core", s.pipeline, s.settings, {}, s) for s in states()}

    async def requests(request):
        name = request.path_params["name"]
        try:
            api = apis.get(name)
            if api is None:
                served = ", ".join(repr(n) for n in state.group)
                raise HTTPError(404, "UnknownPipeline", f"unknown pipeline {name!r}; this server serves {served}")
            inputs, stream, request_id, timeout = request_fields(await read_json(request))
            request_id = request_id or new_request_id()
            api.state.check_available()
        except HTTPError as exc:
            return error_response(exc)
        request.scope.setdefault("state", {})["omni_request_id"] = request_id
        if stream:
            return await _stream(request, api, inputs, request_id, timeout)
        try:
            result = await until_disconnect(request.receive, api.submit(inputs, request_id=request_id, timeout=timeout,
                                                                        headers=request.headers))
        except ClientGone:
            return PlainTextResponse("", status_code=499)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                raise
            return _failed(request, exc)
        return JSONResponse({"id": request_id, "result": to_jsonable(result)})

    async def _stream(request, api, inputs, request_id, timeout):
        events = api.stream(inputs, request_id=request_id, timeout=timeout, headers=request.headers)
        # Errors before the first event (overloaded, a stage failing at once) get their status
        # code; later ones become an `event: error`.
        try:
            first = await until_disconnect(request.receive, events.__anext__())
        except ClientGone:
            return PlainTextResponse("", status_code=499)
        except StopAsyncIteration:
            first = None
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                raise
            return _failed(request, exc)

        return EventStream(stream_body(request, events, first, request_id))

    async def openapi_json(request):
        from .openapi import openapi_document

        return JSONResponse(openapi_document(state, app.routes, CORE_PATHS))

    routes = [
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/plugins", plugins, methods=["GET"]),
        Route("/v1/pipelines", pipelines, methods=["GET"]),
        Route("/v1/pipelines/{name}/requests", requests, methods=["POST"]),
    ]
    if state.settings.console:
        routes += console.routes(state)

    async def not_found(request, exc):
        return error_response(HTTPError(exc.status_code, "NotFound" if exc.status_code == 404 else "HTTPError",
                                        f"{request.method} {request.url.path}: {exc.detail}"))

    app = Starlette(routes=routes + list(api_routes or []), exception_handlers={404: not_found, 405: not_found})
    app.state.omni = state
    app.router.default = _no_route(app.router.default, state)
    from .auth import ApiKeys, Auth
    from .limits import BodyLimit

    # Outside in: the access log sees every answer (401s included); a request without a valid
    # key is answered before its body is read.
    keys = ApiKeys(state.settings.api_keys)
    limit = max(s.pipeline.config.serve.max_request_bytes for s in states())
    guarded = Auth(BodyLimit(app, limit), keys, state.settings.public_routes,
                   CORE_PATHS)
    return AccessLog(guarded, state, app)


def _one_status(state: ServeState) -> dict[str, Any]:
    """One pipeline's part of /health and /ready when a server serves several."""
    status = "ready" if state.ready else "draining" if state.draining else state.pipeline.state
    body: dict[str, Any] = {"status": "starting" if status == "running" else status}
    if not state.alive and not state.draining:
        body.update(status="failed", error=stopped_reason(state))
    return body


def prometheus_text(states: list[ServeState]) -> str:
    """The server's metrics: each pipeline's, every series labelled by its pipeline when the
    server serves several (stage metrics gain a ``pipeline`` label then: two pipelines may
    have stages of one name)."""
    from .. import metrics

    if len(states) == 1:
        return states[0].meter.prometheus_text()
    values: dict[str, list[Any]] = {}
    histograms: dict[str, list[Any]] = {}
    definitions = {name: (kind, help_text, labels if "pipeline" in labels else ("pipeline", *labels))
                   for name, (kind, help_text, labels) in metrics.DEFINITIONS.items()}
    for s in states:
        snap = s.meter.snapshot()
        for into, part in ((values, snap.get("values", {})), (histograms, snap.get("histograms", {}))):
            for name, series in part.items():
                own = "pipeline" in metrics.DEFINITIONS.get(name, ("", "", ("pipeline",)))[2]
                into.setdefault(name, []).extend(
                    (labels, row) if own else ([s.name, *labels], row) for labels, row in series)
    return metrics.prometheus_text({"values": values, "histograms": histograms}, definitions=definitions)


def stopped_reason(state: ServeState) -> str:
    """Why the pipeline stopped on its own (what /health and /ready say before the server exits)."""
    if state.failed is not None:
        return state.failed
    reason = getattr(getattr(state.pipeline, "lifecycle", None), "closed_reason", None)
    return str(reason) if reason is not None else f"the pipeline {state.name!r} stopped"


def _no_route(default: Callable, state: ServeState) -> Callable:
    """The router's answer when no route matches: for a WebSocket, instead of a bare 403, an
    accepted connection that gets one Realtime-style ``error`` event naming the API that serves
    the path (from the registered APIs' descriptions) and is closed (1008)."""

    async def no_route(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "websocket":
            await default(scope, receive, send)
            return
        message = websocket_not_served(scope.get("path", ""), state)
        state.log.warning("websocket refused", path=scope.get("path"), reason=message)
        await send({"type": "websocket.accept"})
        event = {"type": "error", "event_id": None,
                 "error": {"type": "invalid_request_error", "code": "not_found", "message": message, "param": None}}
        await send({"type": "websocket.send", "text": json.dumps(event)})
        await send({"type": "websocket.close", "code": 1008, "reason": message.encode()[:120].decode("utf-8", "ignore")})

    return no_route


def websocket_not_served(path: str, state: ServeState) -> str:
    """Why no WebSocket answers at ``path``, and which API to mount when one is known to serve it."""
    from ..plugins import get_registry

    mounted = list(state.settings.apis)
    pattern = re.compile(rf"(?<![\w/]){re.escape(path)}(?![\w/])")
    try:
        serving = [e.name for e in get_registry().entries("api") if e.description and pattern.search(e.description)]
    except Exception:  # the hint is a courtesy: never fail the answer over it
        serving = []
    serving = [n for n in serving if n not in mounted]
    head = f"no WebSocket at {path} on this server (APIs mounted: {', '.join(mounted) or 'none'})"
    if serving:
        name = serving[0]
        return (f"{path} is served by the API {name!r}, which this server does not mount: start it with "
                f"`omni serve {state.settings.config or 'CONFIG'} --api {name}` (or add it to serve.apis); {head}")
    return f"{head}; `omni plugins list` shows the APIs installed, `omni serve ... --api NAME` mounts one"

def _failed(request: Any, exc: BaseException):
    err = note_error(request, exc)
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


class AccessLog:
    """ASGI middleware: one line per HTTP request (id, method, path, status, duration and, for a
    stream, time to first chunk), with ``request_id`` bound for every log line of the request."""

    def __init__(self, app: Any, state: ServeState, starlette: Any = None):
        self.app = app
        self.state = state
        #: The Starlette app inside the middlewares (APIs' routes are added to its router).
        self.starlette = starlette
        self.log = get_logger(pipeline=state.name)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        first_body: float | None = None
        streamed = False
        structlog.contextvars.clear_contextvars()

        async def send_wrapper(message: dict) -> None:
            nonlocal status, first_body, streamed
            if message["type"] == "http.response.start":
                status = message["status"]
                streamed = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and first_body is None and message.get("body"):
                first_body = time.perf_counter() - start
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            state = scope.get("state") or {}
            rid = state.get("omni_request_id")
            fields: dict[str, Any] = {
                "method": scope.get("method"), "path": scope.get("path"), "status": status,
                "duration_ms": round((time.perf_counter() - start) * 1000, 2),
            }
            if rid is not None:
                fields["request_id"] = rid
            if first_body is not None and streamed:  # a stream's first body bytes are its first chunk
                fields["ttfc_ms"] = round(first_body * 1000, 2)
            if scope.get("path") not in ("/health", "/ready", "/metrics"):
                self.log.info("http request", **fields)
            structlog.contextvars.clear_contextvars()

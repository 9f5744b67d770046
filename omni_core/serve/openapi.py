"""``GET /openapi.json``: an OpenAPI 3.1 document of the routes this server serves.

The core routes are described here in full (bodies, answers, the error shape). A route an API
mounts is described by the operations it declares, when it declares some: a Starlette route (or
its endpoint) with an ``openapi`` attribute, a mapping of lower-case HTTP method to an OpenAPI
operation object; otherwise by its path and methods alone, with a JSON body and the OpenAI error
shape, as mounted by its API. WebSocket routes have no place in OpenAPI 3; they are listed in
``x-websockets``.
"""

from __future__ import annotations

from typing import Any

from .._version import __version__ as omni_version
from .context import ServeState

_CORE_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "stage": {"type": ["string", "null"]}, "message": {"type": "string"}}}},
}

_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "null"]}}}},
}

_REQUEST_BODY = {
    "type": "object",
    "required": ["input"],
    "additionalProperties": False,
    "properties": {
        "input": {"description": "The pipeline's inputs (JSON; tensors in omni's tensor encoding)."},
        "stream": {"type": "boolean", "default": False, "description": "Answer as server-sent events."},
        "request_id": {"type": "string", "minLength": 1},
        "timeout": {"type": "number", "exclusiveMinimum": 0},
    },
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(schema: dict[str, Any], *codes: str) -> dict[str, Any]:
    text = {"400": "A client mistake, named.", "401": "No valid API key.", "404": "Unknown pipeline.",
            "409": "The request id is in flight.", "413": "The body is too large.", "429": "Overloaded.",
            "500": "A stage failed.", "503": "Starting, draining or stopped.", "504": "Timed out."}
    return {code: _json(schema, text[code]) for code in codes}


def _op(summary: str, responses: dict[str, Any], *, body: dict[str, Any] | None = None,
        params: list[dict[str, Any]] | None = None, secured: bool = True) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if params:
        op["parameters"] = params
    if not secured:
        op["security"] = []
    return op


def _names(state: ServeState) -> str:
    """The pipelines the server serves, quoted (``omni serve A B``: several)."""
    return ", ".join(repr(n) for n in (getattr(state, "group", None) or [state.name]))


def core_paths(state: ServeState) -> dict[str, dict[str, Any]]:
    """The core routes' (and the console's) path items."""
    public = set(state.settings.public_routes) if state.settings.api_keys else None
    name_param = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"},
                   "description": f"The pipeline's name ({_names(state)} on this server)."}]

    def secured(path: str) -> bool:
        return public is None or path not in public

    err = _errors(_CORE_ERROR, "401")
    paths: dict[str, dict[str, Any]] = {
        "/health": {"get": _op("Alive: 200 unless the pipeline stopped.", {
            "200": _json({"type": "object"}, "Alive."), "503": _json({"type": "object"}, "Stopped or failed."), **err},
            secured=secured("/health"))},
        "/ready": {"get": _op("Ready for requests.", {
            "200": _json({"type": "object"}, "Ready."), "503": _json({"type": "object"}, "Not ready (the status says why)."),
            **err}, secured=secured("/ready"))},
        "/metrics": {"get": _op("Prometheus metrics of the server and every stage process.", {
            "200": {"description": "Prometheus text.", "content": {"text/plain": {"schema": {"type": "string"}}}}, **err},
            secured=secured("/metrics"))},
        "/openapi.json": {"get": _op("This document.", {"200": _json({"type": "object"}, "OpenAPI 3.1."), **err},
                                     secured=secured("/openapi.json"))},
        "/v1/plugins": {"get": _op("The plugins loaded.", {"200": _json({"type": "array"}, "One entry per plugin."), **err})},
        "/v1/pipelines": {"get": _op("The pipeline served, its stages, state and processes.", {
            "200": _json({"type": "object"}, "The pipeline."), **err})},
        "/v1/pipelines/{name}/requests": {"post": _op(
            "Run one request: the result as JSON, or with stream true chunk/result/error server-sent events.",
            {"200": {"description": "The result, or the stream.", "content": {
                "application/json": {"schema": {"type": "object", "properties": {"id": {"type": "string"}, "result": {}}}},
                "text/event-stream": {"schema": {"type": "string"}}}},
             **_errors(_CORE_ERROR, "400", "401", "404", "409", "413", "429", "500", "503", "504")},
            body=_REQUEST_BODY, params=name_param)},
    }
    if state.settings.console:
        paths.update({
            "/": {"get": _op("The console (a web page).", {"200": {"description": "HTML.", "content": {
                "text/html": {"schema": {"type": "string"}}}}, **err})},
            "/console/static/{name}": {"get": _op("The console's script and style sheet.", {
                "200": {"description": "The file."}, **_errors(_CORE_ERROR, "401", "404")},
                params=[{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}])},
            "/console/state": {"get": _op("The console's graph and live state.", {"200": _json({"type": "object"}, "State."),
                                                                                  **err})},
            "/console/events": {"get": _op("The console's push channel (server-sent events).", {
                "200": {"description": "Events.", "content": {"text/event-stream": {"schema": {"type": "string"}}}}, **err})},
            "/console/requests": {"post": _op("The console's playground: a request answered as server-sent events.", {
                "200": {"description": "Events.", "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                **_errors(_CORE_ERROR, "400", "401", "413", "503")}, body=_REQUEST_BODY)},
        })
    return paths


def api_operations(route: Any) -> dict[str, Any]:
    """The path item of a route an API mounted: its declared operations, or its methods."""
    declared = getattr(route, "openapi", None) or getattr(getattr(route, "endpoint", None), "openapi", None)
    if isinstance(declared, dict) and declared:
        return dict(declared)
    ops = {}
    params = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
              for p in getattr(route, "param_convertors", {}) or {}]
    for method in sorted(getattr(route, "methods", None) or {"GET"}):
        if method == "HEAD":
            continue
        body = {"type": "object"} if method in ("POST", "PUT", "PATCH") else None
        ops[method.lower()] = _op(f"{method} {_path(route)} (mounted by an API; it declares no schema).", {
            "200": {"description": "Success."}, **_errors(_OPENAI_ERROR, "400", "401", "404")}, body=body, params=params)
    return ops


def _path(route: Any) -> str:
    """A route's path as OpenAPI writes it: ``{model}``, not Starlette's ``{model:path}``."""
    return getattr(route, "path_format", None) or route.path


def openapi_document(state: ServeState, routes: list[Any], core: tuple[str, ...]) -> dict[str, Any]:
    """The document for a server whose Starlette app has ``routes`` (the core's and the APIs');
    ``core``: the core routes' paths (described here, not taken from ``routes``)."""
    paths = core_paths(state)
    websockets = []
    for route in routes:
        path = getattr(route, "path", None)
        if path is None or path in core:
            continue
        if type(route).__name__ == "WebSocketRoute":
            websockets.append(path)
            continue
        paths.setdefault(_path(route), {}).update(api_operations(route))
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": f"omni serve: {' '.join(getattr(state, 'group', None) or [state.name])}",
                 "version": omni_version,
                 "description": f"Pipeline(s) {_names(state)}; APIs mounted: {', '.join(state.settings.apis) or 'none'}."},
        "paths": paths,
        "x-websockets": websockets,
    }
    if state.settings.api_keys:
        doc["components"] = {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
        doc["security"] = [{"bearer": []}]
    return doc

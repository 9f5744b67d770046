"""``omni serve``: one pipeline behind HTTP.

Core routes (``/health``, ``/ready``, ``/metrics``, ``/v1/plugins``, ``/v1/pipelines``,
``POST /v1/pipelines/{name}/requests`` as JSON or SSE), APIs mounted from plugins
(``omni_register_apis``), Prometheus metrics over every stage process, graceful drain on SIGTERM,
and the console at ``GET /`` (:mod:`.console`: the graph, live state, a playground; ``--no-console``
turns it off). See docs/serving.md.

An API plugin's factory receives an :class:`ApiContext` and returns Starlette routes::

    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def make_routes(api):
        async def echo(request):
            result = await api.submit(await request.json())
            return JSONResponse({"result": result})
        return [Route("/v1/echo", echo, methods=["POST"])]
"""

from __future__ import annotations

from .app import build_app
from .context import (
    MAX_JSON_DEPTH,
    ApiContext,
    ClientGone,
    EventStream,
    ServeSettings,
    ServeState,
    parse_json,
    read_json,
    sse,
)
from .errors import HTTPError, describe, error_body, error_response, log_error, parts

__all__ = [
    "ApiContext",
    "ClientGone",
    "EventStream",
    "HTTPError",
    "MAX_JSON_DEPTH",
    "ServeSettings",
    "ServeState",
    "build_app",
    "describe",
    "error_body",
    "error_response",
    "log_error",
    "parse_json",
    "parts",
    "read_json",
    "sse",
]

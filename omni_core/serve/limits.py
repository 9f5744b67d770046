"""The request body limit of ``omni serve`` (``serve.max_request_bytes``), for every route: the core
routes and every API a plugin mounts.

A body whose ``Content-Length`` is over the limit is refused before any of it is read; a body
without one (chunked) is counted as it arrives and refused the moment it passes the limit, so the
server never holds more than the limit of any body. The refusal is a 413 with the JSON error body
every route uses; whatever the route would have answered instead (it could not read its body) is
dropped.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import HTTPError, error_body

#: Where the limit is set, as the 413 names it.
LIMIT_FIELD = "serve.max_request_bytes"


def too_large(limit: int, size: int | None = None) -> HTTPError:
    """The 413 for a body over ``limit`` bytes (``size``: its declared length, when known)."""
    what = f"the request body ({size} bytes)" if size is not None else "the request body"
    return HTTPError(413, "RequestTooLarge",
                     f"{what} is larger than {LIMIT_FIELD} ({limit} bytes); send a smaller body, or raise "
                     f"{LIMIT_FIELD} in the pipeline config's serve: section")


class _BodyTooLarge(Exception):
    """Raised from ``receive`` into the route that reads a body past the limit."""


class BodyLimit:
    """ASGI middleware enforcing ``limit`` bytes per request body. ``router`` is the wrapped
    app's, so routes added to it later (the APIs, mounted once the pipeline runs) are limited
    too."""

    def __init__(self, app: Any, limit: int):
        self.app = app
        self.limit = limit
        self.router = getattr(app, "router", None)

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            await _answer(send, too_large(self.limit, declared), self._shape(scope))
            return
        received = 0
        over = False
        started = False

        async def counted() -> dict:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    over = True
                    raise _BodyTooLarge()
            return message

        async def guarded(message: dict) -> None:
            nonlocal started
            if over:
                return  # the route's answer to a body it could not read: the 413 replaces it
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not over:
                raise
        if over and not started:
            await _answer(send, too_large(self.limit), self._shape(scope))

    def _shape(self, scope: dict) -> Callable[[HTTPError], dict] | None:
        """The error body of the route ``scope`` goes to, when it has its own (an API whose
        errors have another shape sets ``omni_error_body`` on its endpoint), so that a route
        answers every error in one shape."""
        from starlette.routing import Match

        for route in getattr(self.router, "routes", ()):
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return getattr(getattr(route, "endpoint", None), "omni_error_body", None)
        return None


def _content_length(scope: dict) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _answer(send: Callable, err: HTTPError, shape: Callable[[HTTPError], dict] | None = None) -> None:
    body = json.dumps((shape or error_body)(err)).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

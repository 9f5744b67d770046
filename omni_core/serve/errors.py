"""How a request's error becomes an HTTP answer: one status code and one body shape,
``{"error": {"type": ..., "stage": ..., "message": ...}}``, for every route and every API."""

from __future__ import annotations

import asyncio
from typing import Any

from ..errors import (
    Overloaded,
    PipelineClosed,
    ProcessDied,
    RequestAborted,
    RequestTimeout,
    StageError,
)

#: Seconds a client is told to wait (``Retry-After``) after a 429 or a 503.
RETRY_AFTER = 1


class HTTPError(Exception):
    """An error the server answers with ``status`` (bad body, unknown pipeline, draining ...)."""

    def __init__(self, status: int, type_: str, message: str, *, stage: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.stage = stage
        self.headers = headers or {}


def describe(exc: BaseException) -> HTTPError:
    """The HTTP form of any error a request can end with."""
    if isinstance(exc, HTTPError):
        return exc
    retry = {"Retry-After": str(RETRY_AFTER)}
    if isinstance(exc, Overloaded):
        return HTTPError(429, "Overloaded", str(exc), headers=retry)
    if isinstance(exc, StageError):
        return HTTPError(500, exc.error_type, exc.reason, stage=exc.stage)
    if isinstance(exc, ProcessDied):
        return HTTPError(500, "ProcessDied", str(exc), stage=exc.stages[0] if exc.stages else None)
    if isinstance(exc, (RequestTimeout, asyncio.TimeoutError, TimeoutError)):
        return HTTPError(504, "RequestTimeout", str(exc) or "the request timed out")
    if isinstance(exc, PipelineClosed):
        return HTTPError(503, "PipelineUnavailable", str(exc), headers=retry)
    if isinstance(exc, RequestAborted):
        return HTTPError(503, "RequestAborted", str(exc), headers=retry)
    if isinstance(exc, ValueError) and "already in flight" in str(exc):
        return HTTPError(409, "RequestIdInUse", str(exc))
    if isinstance(exc, (ValueError, TypeError)):
        return HTTPError(400, "InvalidRequest", str(exc))
    return HTTPError(500, "InternalError", f"{type(exc).__name__}: {exc}")


def error_body(err: HTTPError) -> dict[str, Any]:
    return {"error": {"type": err.type, "stage": err.stage, "message": err.message}}


def error_response(exc: BaseException):
    """A JSON response for ``exc`` (status, ``Retry-After`` where it applies)."""
    from starlette.responses import JSONResponse

    err = describe(exc)
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)

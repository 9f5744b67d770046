"""How a request's error becomes an HTTP answer: one status code, and on the core routes one body
shape, ``{"error": {"type": ..., "stage": ..., "message": ..., "field": ...}}`` (APIs with a shape
of their own, like the OpenAI API, build theirs from the same :func:`describe`).

The rule: a client's mistake is a 4xx naming what is wrong (and the input at fault, ``field``,
where there is one): a bad body, an unknown field, and every :class:`~omni_core.errors.InvalidInput`
a stage raises (bad types or values, media that cannot be decoded, a sequence longer than the
model takes, a server path the request may not name) → 400. A condition that passes is a 429 or
503 with ``Retry-After`` (overloaded, draining, a stage process that died and is being
restarted). A 500 is a bug (a stage raising anything else), and :func:`log_error` logs it at
error level with its traceback."""

from __future__ import annotations

import asyncio
from typing import Any

from ..errors import (
    InvalidInput,
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
    """An error the server answers with ``status`` (bad body, unknown pipeline, draining ...).
    ``field``: the input at fault as the stage names it (``"max_tokens"``, ``"messages[0].content[1]"``);
    ``param`` is the same (the OpenAI API's name for it)."""

    def __init__(self, status: int, type_: str, message: str, *, stage: str | None = None,
                 headers: dict[str, str] | None = None, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.stage = stage
        self.headers = headers or {}
        self.field = field

    @property
    def param(self) -> str | None:
        return self.field


def describe(exc: BaseException) -> HTTPError:
    """The HTTP form of any error a request can end with."""
    if isinstance(exc, HTTPError):
        return exc
    retry = {"Retry-After": str(RETRY_AFTER)}
    if isinstance(exc, Overloaded):
        return HTTPError(429, "Overloaded", str(exc), headers=retry)
    if isinstance(exc, StageError):
        if exc.invalid_input:  # the stage refused the caller's input
            return HTTPError(400, "InvalidInput", exc.reason, stage=exc.stage, field=exc.field)
        return HTTPError(500, exc.error_type, exc.reason, stage=exc.stage)
    if isinstance(exc, InvalidInput):
        return HTTPError(400, "InvalidInput", str(exc), field=exc.field)
    if isinstance(exc, ProcessDied):  # the process is being restarted (or the server is going down): retry
        return HTTPError(503, "ProcessDied", str(exc), stage=exc.stages[0] if exc.stages else None, headers=retry)
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


def parts(exc: BaseException) -> tuple[int, str, str, str | None]:
    """``(status, type, message, param)`` of any error a request can end with (:func:`describe`),
    for an API that answers in a shape of its own; ``param`` is the input at fault, or None."""
    err = describe(exc)
    return err.status, err.type, err.message, err.field


def log_error(log: Any, event: str, err: HTTPError, exc: BaseException | None = None, **fields: Any) -> None:
    """Log a failed request once: a 5xx (a bug, or a failure on the server's side) at error level
    with its traceback (the stage's for a :class:`StageError`, else ``exc``'s own), a client's
    mistake (4xx) at warning."""
    first = err.message.splitlines()[0] if err.message else ""
    fields = {"type": err.type, "stage": err.stage, "status": err.status, "message": first, **fields}
    if err.field:
        fields["field"] = err.field
    if err.status < 500:
        log.warning(event, **fields)
        return
    tb = getattr(exc, "traceback", None) if exc is not None else None
    if tb:
        log.error(event, traceback=tb, **fields)
    elif exc is not None and exc.__traceback__ is not None:
        log.error(event, exc_info=exc, **fields)
    else:
        log.error(event, **fields)


def error_body(err: HTTPError) -> dict[str, Any]:
    body = {"type": err.type, "stage": err.stage, "message": err.message}
    if err.field:
        body["field"] = err.field
    return {"error": body}


def error_response(exc: BaseException):
    """A JSON response for ``exc`` (status, ``Retry-After`` where it applies)."""
    from starlette.responses import JSONResponse

    err = describe(exc)
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)

"""What the routes of ``omni serve`` work with, the core's (:mod:`.app`), the console's
(:mod:`.console`) and every API's: the server's settings and state; :class:`ApiContext`, which
every request that reaches the pipeline goes through (it refuses new work while the server
drains, counts the request in the metrics, aborts it when the client goes away, and bounds it by
its timeout); and a request's HTTP plumbing: its body's fields, the client going away, an answer
as server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import attrs
import structlog

from .. import tracing
from ..encoding import EncodingError, from_jsonable, to_jsonable
from ..errors import RequestAborted
from ..logs import get_logger
from ..metrics import RequestMeter
from .errors import RETRY_AFTER, HTTPError, describe, error_body, error_response, log_error


@attrs.define
class ServeSettings:
    """What ``omni serve`` was started with."""

    config: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    apis: tuple[str, ...] = ()
    drain_timeout: float = 30.0
    console: bool = True  # the console at GET / (``--no-console``: off)
    #: Keys a client must present (``--api-key``, ``--api-key-file``, ``OMNI_API_KEY``; empty:
    #: none needed). Never shown: not in the repr, never logged.
    api_keys: tuple[str, ...] = attrs.field(default=(), repr=False)
    #: Routes served without a key when keys are set (``--public-route``).
    public_routes: tuple[str, ...] = ("/health", "/ready")
    ssl_certfile: str | None = None  # TLS (``--ssl-certfile``/``--ssl-keyfile``, uvicorn's)
    ssl_keyfile: str | None = None


class ServeState:
    """The server's view of its pipeline: readiness, drain, requests in flight, metrics."""

    def __init__(self, pipeline: Any, settings: ServeSettings):
        self.pipeline = pipeline
        self.settings = settings
        self.name = pipeline.config.name
        self.meter = RequestMeter(pipeline)
        self.draining = False
        self.started = False  # the pipeline's start() returned
        self.idle = asyncio.Event()
        self.idle.set()
        self.active: set[str] = set()  # ids of the requests in flight (the drain aborts them last)
        #: Why the pipeline cannot go on (it stopped on its own: restart never, or past its limit);
        #: the server then fails what is in flight and exits non-zero. None while it can.
        self.failed: str | None = None
        self.log = get_logger(pipeline=self.name)
        #: Every pipeline's state in this server, by pipeline name, in the order given (``omni
        #: serve A B``): one dict shared by all of them (this one alone when it serves one).
        self.group: dict[str, ServeState] = {self.name: self}
        #: The APIs this pipeline is served by (its ``serve.apis``, then ``--api``).
        self.apis: tuple[str, ...] = tuple(settings.apis)

    @property
    def ready(self) -> bool:
        return self.started and not self.draining and self.pipeline.state == "running"

    @property
    def alive(self) -> bool:
        return self.pipeline.state not in ("stopping", "stopped")

    def check_available(self) -> None:
        """Raise the 503 a new request gets while the server cannot take it."""
        retry = {"Retry-After": str(RETRY_AFTER)}
        if self.draining:
            raise HTTPError(503, "Draining", f"the server is shutting down: pipeline {self.name!r} takes no new requests", headers=retry)
        if not self.started:
            raise HTTPError(503, "PipelineUnavailable", f"pipeline {self.name!r} is starting", headers=retry)
        # Once started, a pipeline that stopped on its own refuses the request itself, saying why
        # (PipelineClosed, a 503 too).

    def enter(self, request_id: str) -> None:
        self.active.add(request_id)
        self.idle.clear()

    def leave(self, request_id: str) -> None:
        self.active.discard(request_id)
        if not self.active:
            self.idle.set()

    async def abort_all(self) -> int:
        """Abort every request in flight (the drain's last resort); returns how many."""
        ids = list(self.active)
        for request_id in ids:
            await self.pipeline.abort(request_id)
        return len(ids)


@attrs.define
class ApiContext:
    """What an API factory (``omni_register_apis``) receives.

    ``pipeline``: the running :class:`~omni_core.Pipeline`; ``settings``: the server's
    :class:`ServeSettings`; ``options``: this API's ``serve.options`` mapping from the config.
    Use :meth:`submit` / :meth:`stream` rather than the pipeline's own methods: they refuse work
    while the server drains, count the request in ``/metrics``, apply the timeout, and mark the
    request as come over the network (``ctx.from_network``: stages refuse server paths in it
    unless ``serve.allow_local_files`` allows them)."""

    name: str
    pipeline: Any
    settings: ServeSettings
    options: dict[str, Any]
    state: ServeState = attrs.field(repr=False)

    @property
    def pipeline_name(self) -> str:
        return self.state.name

    def peers(self) -> dict[str, ApiContext]:
        """This API's context for every pipeline of the server that it serves, by pipeline name,
        this one first (``omni serve A B`` serves several): an API picks the pipeline by the
        request's ``model``. Each has that pipeline's own ``options``."""
        out = {self.state.name: self}
        for name, state in self.state.group.items():
            if name not in out and self.name in state.apis:
                options = dict(state.pipeline.config.serve.options.get(self.name, {}))
                out[name] = ApiContext(self.name, state.pipeline, self.settings, options, state)
        return out

    async def submit(self, inputs: Any, *, request_id: str | None = None, timeout: float | None = None,
                     headers: Mapping[str, str] | None = None) -> Any:
        """Run one request; raises what ``Pipeline.submit`` raises, ``HTTPError`` 503 while
        draining, ``TimeoutError`` past ``timeout``. ``headers``: the HTTP request's, whose
        ``traceparent`` becomes the parent of the request's span (with tracing on)."""
        self.state.check_available()
        request_id = request_id or new_request_id()
        self.state.enter(request_id)
        try:
            bind_request(request_id)
            with tracing.request_span(f"{self.name} request", request_id=request_id, pipeline=self.state.name, headers=headers):
                if timeout is None:
                    return await self.state.meter.submit(inputs, request_id=request_id, from_network=True)
                return await asyncio.wait_for(self.state.meter.submit(inputs, request_id=request_id, from_network=True),
                                              timeout)
        finally:
            self.state.leave(request_id)

    async def stream(self, inputs: Any, *, request_id: str | None = None, timeout: float | None = None,
                     headers: Mapping[str, str] | None = None) -> AsyncGenerator[Any, None]:
        """``Pipeline.stream`` with the same guarantees as :meth:`submit`; ``timeout`` bounds
        the whole stream. Closing the iterator early aborts the request."""
        self.state.check_available()
        request_id = request_id or new_request_id()
        self.state.enter(request_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        events = self.state.meter.stream(inputs, request_id=request_id, from_network=True)
        span = tracing.start_request_span(f"{self.name} stream", request_id=request_id, pipeline=self.state.name, headers=headers)
        error: BaseException | None = None
        first = True
        try:
            bind_request(request_id)
            while True:
                # The first step admits the request and sends its inputs: under the span, so
                # the stage processes' spans are its children.
                with tracing.use(span if first else None):
                    if deadline is None:
                        event = await events.__anext__()
                    else:
                        event = await asyncio.wait_for(events.__anext__(), max(0.0, deadline - time.monotonic()))
                first = False
                yield event
                if event.is_result:
                    return
        except StopAsyncIteration:
            return
        except BaseException as exc:
            error = exc
            raise
        finally:
            await events.aclose()
            self.state.leave(request_id)
            tracing.end(span, error if isinstance(error, Exception) else None)

    @staticmethod
    def error_response(exc: BaseException):
        return error_response(exc)

    @staticmethod
    async def until_disconnect(receive: Callable[[], Awaitable[dict]], work: Awaitable[Any]) -> Any:
        """Await ``work`` unless the client disconnects first; then cancel it (aborting its
        request) and raise :class:`ClientGone`. ``receive`` is the ASGI receive (after the body
        was read), e.g. ``request.receive``."""
        return await until_disconnect(receive, work)


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def new_request_id() -> str:
    """An id for a request whose client gave none."""
    return f"req-{secrets.token_hex(8)}"


def bind_request(request_id: str | None) -> None:
    if request_id is not None:
        structlog.contextvars.bind_contextvars(request_id=request_id)


async def _wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive: Callable[[], Awaitable[dict]], work: Awaitable[Any]) -> Any:
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        if task.cancelled():
            raise RequestAborted("the request was aborted: the server is shutting down")
        return task.result()
    task.cancel()
    with _suppress_all():
        await task
    raise ClientGone()


class _suppress_all:
    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> bool:
        return exc[0] is not None and issubclass(exc[0], (Exception, asyncio.CancelledError))


class EventStream:
    """A ``text/event-stream`` response fed by an async iterator of bytes. The client going away
    cancels the iterator at once (even while it waits for the next chunk), which aborts the
    request behind it."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], *, headers: dict[str, str] | None = None):
        self.events = events
        self.headers = {"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        headers += [(k.encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def pump() -> None:
            async for data in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnect(receive, pump())
        except (ClientGone, OSError):
            pass
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                with _suppress_all():
                    await aclose()


def sse(event: str | None, data: Any) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


# -- a request's body, and its answer as a stream ------------------------------------------------


def request_fields(body: Any) -> tuple[Any, bool, str | None, float | None]:
    """``(inputs, stream, request_id, timeout)`` of a request's body (``POST
    /v1/pipelines/{name}/requests``, the console's playground); a 400 naming the problem otherwise."""
    if not isinstance(body, dict):
        raise HTTPError(400, "InvalidRequest", f"the body must be a JSON object like {{\"input\": {{...}}}}, got {type(body).__name__}")
    unknown = sorted(set(body) - {"input", "stream", "request_id", "timeout"})
    if unknown:
        raise HTTPError(400, "InvalidRequest", f"unknown field(s) {unknown}; the body takes input, stream, request_id, timeout")
    if "input" not in body:
        raise HTTPError(400, "InvalidRequest", "the body needs 'input': the pipeline's inputs")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HTTPError(400, "InvalidRequest", f"'stream' must be true or false, got {stream!r}")
    request_id = body.get("request_id")
    if request_id is not None and (not isinstance(request_id, str) or not request_id):
        raise HTTPError(400, "InvalidRequest", f"'request_id' must be a non-empty string, got {request_id!r}")
    timeout = body.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise HTTPError(400, "InvalidRequest", f"'timeout' must be a positive number of seconds, got {timeout!r}")
    try:
        inputs = from_jsonable(body["input"])
    except EncodingError as exc:
        raise HTTPError(400, "InvalidRequest", str(exc)) from None
    return inputs, stream, request_id, timeout


#: How deeply a request's JSON body may nest arrays and objects (a chat request needs 5 or so).
MAX_JSON_DEPTH = 64


_JSON_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _too_deep(text: str | bytes, limit: int) -> bool:
    """Whether ``text`` (JSON) nests arrays/objects deeper than ``limit``: counted on the raw text
    (strings left out) before any parser recurses into it, in passes at C speed that each take
    away the innermost level (the empty brackets ``[]``)."""
    if isinstance(text, str):
        text = text.encode("utf-8", "surrogatepass")
    if text.count(b"[") + text.count(b"{") <= limit:  # cannot be deeper: the common case
        return False
    brackets = _JSON_STRINGS.sub(b"", text).translate(_BRACKETS, _NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


def parse_json(raw: str | bytes, *, what: str = "the body", limit: int = MAX_JSON_DEPTH) -> Any:
    """``raw`` parsed as JSON; an ``HTTPError`` 400 naming the problem otherwise (not JSON, not
    UTF-8, or nested deeper than ``limit``: refused before parsing, so a deep body costs no
    recursion anywhere). Every route that reads a JSON body uses it (or :func:`read_json`)."""
    if _too_deep(raw, limit):
        raise HTTPError(400, "InvalidRequest", f"{what} nests arrays/objects more than {limit} deep")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HTTPError(400, "InvalidRequest", f"{what} is not valid JSON: {exc}") from None
    except RecursionError:  # deeper than the parser goes: the check above should have caught it
        raise HTTPError(400, "InvalidRequest", f"{what} nests arrays/objects too deeply") from None


async def read_json(request: Any) -> Any:
    """The request's JSON body (:func:`parse_json`); a 400 naming the problem otherwise."""
    return parse_json(await request.body())


async def stream_body(request: Any, events: AsyncGenerator[Any, None], first: Any, request_id: str, *,
                      traceback: Callable[[BaseException], str] | None = None) -> AsyncIterator[bytes]:
    """A request's SSE body: ``first`` (an event, None at the end, or the exception that ended
    the request before its first event), then the rest of ``events``: every chunk, then the
    result or the error (``traceback(exc)`` added to its fields when given)."""
    event = first
    try:
        while event is not None:
            if isinstance(event, BaseException):
                raise event
            if event.is_result:
                yield sse("result", {"id": request_id, "result": to_jsonable(event.data)})
                return
            yield sse("chunk", {"stage": event.stage, "data": to_jsonable(event.data)})
            event = await events.__anext__()
    except StopAsyncIteration:
        return
    except (Exception, asyncio.TimeoutError) as exc:
        body = error_body(note_error(request, exc))["error"]
        if traceback is not None:
            body["traceback"] = traceback(exc)
        yield sse("error", body)
    finally:
        await events.aclose()


def note_error(request: Any, exc: BaseException) -> HTTPError:
    """The HTTP form of a failed request's error, logged once (:func:`~.errors.log_error`: a 5xx
    at error with its traceback, a client's mistake at warning)."""
    err = describe(exc)
    request.scope.setdefault("state", {})["omni_error"] = err
    log_error(get_logger(), "request failed", err, exc)
    return err

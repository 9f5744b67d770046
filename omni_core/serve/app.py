"""The ASGI application of ``omni serve``: the core routes, the mounted APIs, the access log.

One pipeline per server; the server process is the pipeline's caller. Every request that reaches
the pipeline goes through :class:`ApiContext` (the core route and every API plugin alike), which
refuses new work while the server drains, counts the request in the metrics, aborts it when the
client goes away, and bounds it by its timeout.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import attrs
import structlog

from .. import tracing
from ..encoding import EncodingError, from_jsonable, to_jsonable
from ..errors import RequestAborted
from ..logs import get_logger
from ..metrics import RequestMeter
from .errors import RETRY_AFTER, HTTPError, describe, error_body, error_response

#: Paths of the console (``GET /``, see :mod:`.console`).
CONSOLE_PATHS = ("/", "/console/static/{name}", "/console/events", "/console/state", "/console/requests")

#: Paths of the core routes; an API may not take them.
CORE_PATHS = ("/health", "/ready", "/metrics", "/v1/plugins", "/v1/pipelines", "/v1/pipelines/{name}/requests", *CONSOLE_PATHS)


@attrs.define
class ServeSettings:
    """What ``omni serve`` was started with."""

    config: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    apis: tuple[str, ...] = ()
    drain_timeout: float = 30.0
    console: bool = True  # the console at GET / (``--no-console``: off)


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
        self.log = get_logger(pipeline=self.name)

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
    while the server drains, count the request in ``/metrics``, and apply the timeout."""

    name: str
    pipeline: Any
    settings: ServeSettings
    options: dict[str, Any]
    state: ServeState = attrs.field(repr=False)

    @property
    def pipeline_name(self) -> str:
        return self.state.name

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
                    return await self.state.meter.submit(inputs, request_id=request_id)
                return await asyncio.wait_for(self.state.meter.submit(inputs, request_id=request_id), timeout)
        finally:
            self.state.leave(request_id)

    async def stream(self, inputs: Any, *, request_id: str | None = None, timeout: float | None = None,
                     headers: Mapping[str, str] | None = None) -> AsyncIterator[Any]:
        """``Pipeline.stream`` with the same guarantees as :meth:`submit`; ``timeout`` bounds
        the whole stream. Closing the iterator early aborts the request."""
        self.state.check_available()
        request_id = request_id or new_request_id()
        self.state.enter(request_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        events = self.state.meter.stream(inputs, request_id=request_id)
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


# -- the core routes --------------------------------------------------------------------------------


def _request_fields(body: Any) -> tuple[Any, bool, str | None, float | None]:
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


async def read_json(request: Any) -> Any:
    """The request's JSON body; a 400 naming the problem otherwise."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HTTPError(400, "InvalidRequest", f"the body is not valid JSON: {exc}") from None


def build_app(state: ServeState, api_routes: list[Any] | None = None):
    """The Starlette app: the core routes, then every API's routes."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    api = ApiContext("core", state.pipeline, state.settings, {}, state)

    async def health(request):
        status = 200 if state.alive else 503
        return JSONResponse({"status": state.pipeline.state, "pipeline": state.name}, status_code=status)

    async def ready(request):
        if state.ready:
            return JSONResponse({"status": "ready", "pipeline": state.name})
        why = "draining" if state.draining else state.pipeline.state
        if why == "running":
            why = "starting"
        return JSONResponse({"status": why, "pipeline": state.name}, status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER)})

    async def metrics(request):
        text = await asyncio.get_running_loop().run_in_executor(None, state.meter.prometheus_text)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def plugins(request):
        from ..plugins import get_plugins

        return JSONResponse([info.to_dict() for info in get_plugins().infos])

    async def pipelines(request):
        cfg = state.pipeline.config
        return JSONResponse({"pipelines": [{
            "name": cfg.name,
            "description": cfg.description,
            "state": state.pipeline.state,
            "ready": state.ready,
            "stages": cfg.stage_names,
            "terminal_stages": list(cfg.terminal_stages),
            "apis": list(state.settings.apis),
            "processes": state.pipeline.pids(),
        }]})

    async def requests(request):
        name = request.path_params["name"]
        try:
            if name != state.name:
                raise HTTPError(404, "UnknownPipeline", f"unknown pipeline {name!r}; this server serves {state.name!r}")
            inputs, stream, request_id, timeout = _request_fields(await read_json(request))
            request_id = request_id or new_request_id()
            state.check_available()
        except HTTPError as exc:
            return error_response(exc)
        request.scope.setdefault("state", {})["omni_request_id"] = request_id
        if stream:
            return await _stream(request, inputs, request_id, timeout)
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

    async def _stream(request, inputs, request_id, timeout):
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

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/plugins", plugins, methods=["GET"]),
        Route("/v1/pipelines", pipelines, methods=["GET"]),
        Route("/v1/pipelines/{name}/requests", requests, methods=["POST"]),
    ]
    if state.settings.console:
        from . import console

        routes += console.routes(state)

    async def not_found(request, exc):
        return error_response(HTTPError(exc.status_code, "NotFound" if exc.status_code == 404 else "HTTPError",
                                        f"{request.method} {request.url.path}: {exc.detail}"))

    app = Starlette(routes=routes + list(api_routes or []), exception_handlers={404: not_found, 405: not_found})
    app.state.omni = state
    from .limits import BodyLimit

    return AccessLog(BodyLimit(app, state.pipeline.config.serve.max_request_bytes), state)


async def stream_body(request: Any, events: AsyncIterator[Any], first: Any, request_id: str, *,
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
        body = error_body(_note_error(request, exc))["error"]
        if traceback is not None:
            body["traceback"] = traceback(exc)
        yield sse("error", body)
    finally:
        await events.aclose()


def _note_error(request: Any, exc: BaseException) -> HTTPError:
    """The HTTP form of a failed request's error, logged once (stage errors with their
    traceback)."""
    err = describe(exc)
    request.scope.setdefault("state", {})["omni_error"] = err
    tb = getattr(exc, "traceback", None)
    get_logger().error("request failed", type=err.type, stage=err.stage, status=err.status,
                       message=err.message.splitlines()[0] if err.message else "", **({"traceback": tb} if tb else {}))
    return err


def _failed(request: Any, exc: BaseException):
    err = _note_error(request, exc)
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


class AccessLog:
    """ASGI middleware: one line per HTTP request (id, method, path, status, duration and, for a
    stream, time to first chunk), with ``request_id`` bound for every log line of the request."""

    def __init__(self, app: Any, state: ServeState):
        self.app = app
        self.state = state
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

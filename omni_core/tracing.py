"""OpenTelemetry tracing (optional: ``pip install 'omni-core[otel]'``).

One span per request in the caller (``omni serve``: ``POST /v1/pipelines/{name}/requests`` and
every API request, a child of the HTTP request's W3C ``traceparent`` when it sent one), and one
span per stage call in the stage processes, a child of the request's span: the request's
``traceparent`` rides in the control messages (``wire.Data.trace``), so one trace shows every stage
of a request, across processes.

Tracing is on when the OpenTelemetry SDK is installed and ``OTEL_TRACES_EXPORTER`` names an
exporter (``otlp``, ``console``, or any installed ``opentelemetry_traces_exporter`` entry point;
the standard ``OTEL_*`` variables configure it: endpoint, headers, service name ...). Off, every
function here is a no-op costing one attribute check. Stage processes inherit the environment,
so they export to the same place, with ``OTEL_SERVICE_NAME`` (default ``omni``) and the process
name as resource attributes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

_tracer: Any = None
_enabled: bool | None = None
_provider: Any = None


def enabled() -> bool:
    """Whether spans are recorded (set up on first use, once per process)."""
    global _enabled
    if _enabled is None:
        _enabled = _setup()
    return _enabled


def _setup(process: str | None = None) -> bool:
    global _tracer, _provider
    name = os.environ.get("OTEL_TRACES_EXPORTER", "").strip()
    if not name or name == "none":
        return False
    try:
        from importlib.metadata import entry_points

        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        return False
    exporters = []
    for item in (n.strip() for n in name.split(",") if n.strip()):
        found = [ep for ep in entry_points(group="opentelemetry_traces_exporter") if ep.name == item]
        if not found:
            from .logs import get_logger

            get_logger().warning("unknown OTEL_TRACES_EXPORTER; tracing is off", exporter=item)
            return False
        exporters.append(found[0].load()())
    attrs = {"service.name": os.environ.get("OTEL_SERVICE_NAME", "omni")}
    if process:
        attrs["omni.process"] = process
    _provider = TracerProvider(resource=Resource.create(attrs))
    simple = os.environ.get("OMNI_OTEL_SIMPLE_PROCESSOR") == "1"  # export each span at once (tests)
    for exporter in exporters:
        _provider.add_span_processor(SimpleSpanProcessor(exporter) if simple else BatchSpanProcessor(exporter))
    _tracer = _provider.get_tracer("omni")
    return True


def setup_process(process: str) -> None:
    """Called by a stage process at start: its spans carry the process name."""
    global _enabled
    _enabled = _setup(process)


def shutdown() -> None:
    """Flush what is buffered (a stage process calls it before exiting)."""
    if _provider is not None:
        with contextlib.suppress(Exception):
            _provider.shutdown()


def traceparent() -> str:
    """The W3C ``traceparent`` of the current span ("" when none or tracing is off)."""
    if not enabled():
        return ""
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get("traceparent", "")


@contextlib.contextmanager
def request_span(name: str, *, request_id: str, pipeline: str, headers: Mapping[str, str] | None = None,
                 attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """The caller's span of one request, a child of ``headers``' ``traceparent`` when given."""
    if not enabled():
        yield None
        return
    from opentelemetry import trace
    from opentelemetry.propagate import extract

    parent = extract({k.lower(): v for k, v in (headers or {}).items()})
    attrs = {"omni.request_id": request_id, "omni.pipeline": pipeline, **(attributes or {})}
    with _tracer.start_as_current_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=attrs) as span:
        yield span


@contextlib.contextmanager
def stage_span(stage: str, *, request_id: str, parent: str) -> Iterator[Any]:
    """A stage call's span, a child of the request's ``traceparent`` (from the control message)."""
    if not enabled() or not parent:
        yield None
        return
    from opentelemetry.propagate import extract

    context = extract({"traceparent": parent})
    attrs = {"omni.stage": stage, "omni.request_id": request_id}
    with _tracer.start_as_current_span(f"stage {stage}", context=context, attributes=attrs) as span:
        yield span


def start_request_span(name: str, *, request_id: str, pipeline: str, headers: Mapping[str, str] | None = None,
                       attributes: Mapping[str, Any] | None = None) -> Any:
    """Like :func:`request_span` for a span that outlives one task step (a stream): started,
    not made current; make it current with :func:`use` and end it with ``span.end()``."""
    if not enabled():
        return None
    from opentelemetry import trace
    from opentelemetry.propagate import extract

    parent = extract({k.lower(): v for k, v in (headers or {}).items()})
    attrs = {"omni.request_id": request_id, "omni.pipeline": pipeline, **(attributes or {})}
    return _tracer.start_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=attrs)


@contextlib.contextmanager
def use(span: Any) -> Iterator[None]:
    """Make ``span`` current for the block (no-op for None)."""
    if span is None:
        yield
        return
    from opentelemetry import trace

    with trace.use_span(span, end_on_exit=False):
        yield


def end(span: Any, error: BaseException | None = None) -> None:
    if span is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()

"""Tracing across real processes: the HTTP request's ``traceparent`` is the parent of the server's
request span, whose context rides in the control messages into every stage process, where each
stage call is a child span. Spans go to a file exporter installed as an ordinary
``opentelemetry_traces_exporter`` entry point and selected with ``OTEL_TRACES_EXPORTER``."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import httpx
import pytest

from omni_core.testing.serve import ServerProcess
from omni_core.testing.waiting import holds_within

pytest.importorskip("opentelemetry.sdk")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HERE = Path(__file__).parent
CONFIG = str(HERE / "configs" / "serve" / "words.yaml")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"

EXPORTER = '''
    """A span exporter writing one JSON line per span to $OMNITEST_SPANS_FILE."""
    import json
    import os

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


    class FileExporter(SpanExporter):
        def export(self, spans):
            lines = []
            for span in spans:
                ctx, parent = span.get_span_context(), span.parent
                lines.append(json.dumps({
                    "name": span.name,
                    "trace_id": format(ctx.trace_id, "032x"),
                    "span_id": format(ctx.span_id, "016x"),
                    "parent_id": format(parent.span_id, "016x") if parent else None,
                    "attributes": dict(span.attributes),
                    "process": span.resource.attributes.get("omni.process"),
                    "pid": os.getpid(),
                }))
            fd = os.open(os.environ["OMNITEST_SPANS_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, ("\\n".join(lines) + "\\n").encode())
            finally:
                os.close(fd)
            return SpanExportResult.SUCCESS

        def shutdown(self):
            pass
'''


def install_exporter(site: Path) -> None:
    (site / "omnitest_spans.py").write_text(textwrap.dedent(EXPORTER))
    info = site / "omnitest_spans-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: omnitest-spans\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[opentelemetry_traces_exporter]\nomnitest_file = omnitest_spans:FileExporter\n")


def read_spans(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_one_trace_shows_the_request_and_every_stage_across_processes(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    install_exporter(site)
    spans_file = tmp_path / "spans.jsonl"
    env = {
        "PYTHONPATH": os.pathsep.join([str(site), str(HERE), os.environ.get("PYTHONPATH", "")]),
        "OTEL_TRACES_EXPORTER": "omnitest_file",
        "OTEL_SERVICE_NAME": "omni-test",
        "OMNI_OTEL_SIMPLE_PROCESSOR": "1",
        "OMNITEST_SPANS_FILE": str(spans_file),
    }
    server = ServerProcess(CONFIG, env=env).start()
    try:
        headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
        with httpx.Client(base_url=server.url, timeout=30) as client:
            r = client.post("/v1/pipelines/words/requests", json={"input": {"text": "a b"}, "request_id": "traced"},
                            headers=headers)
            assert r.status_code == 200, r.text
            with client.stream("POST", "/v1/pipelines/words/requests", headers=headers,
                               json={"input": {"text": "c d"}, "stream": True, "request_id": "traced-stream"}) as s:
                list(s.iter_lines())

        def trace_of(request_id: str) -> list[dict]:
            return [s for s in read_spans(spans_file) if s["trace_id"] == TRACE_ID
                    and s["attributes"].get("omni.request_id") == request_id]

        holds_within(lambda: all(len(trace_of(rid)) >= 3 for rid in ("traced", "traced-stream")), 20, 0.05)
        for rid in ("traced", "traced-stream"):
            spans = trace_of(rid)
            requests = [s for s in spans if "omni.stage" not in s["attributes"]]
            stages = {s["attributes"]["omni.stage"]: s for s in spans if "omni.stage" in s["attributes"]}
            assert len(requests) == 1, spans
            assert requests[0]["parent_id"] == PARENT_ID  # the HTTP request's traceparent
            assert set(stages) == {"shout", "words"}
            for name, span in stages.items():
                assert span["parent_id"] == requests[0]["span_id"]
                assert span["process"] == name and span["pid"] != requests[0]["pid"]  # its own process
            assert stages["shout"]["pid"] != stages["words"]["pid"]
    finally:
        assert server.stop() == 0, server.output()
    server.assert_nothing_left()

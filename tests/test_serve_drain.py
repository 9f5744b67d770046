"""``omni serve`` under overload and shutdown: 429 with Retry-After at the admission limit, and the
SIGTERM drain (ready 503 at once, new requests 503, a stream in flight completes, exit 0, nothing
left), a drain timeout and a second signal that abort what is left."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from omni_core.testing.serve import ServerProcess, sse_events
from omni_core.testing.waiting import holds_within

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HERE = Path(__file__).parent
CONFIG = str(HERE / "configs" / "serve" / "small.yaml")
REQUESTS = "/v1/pipelines/small/requests"
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), "OMNI_LOG_LEVEL": "info"}


def held_stream(client: httpx.Client, gate: Path, request_id: str, words: str = "one two three"):
    """Open a stream whose stage waits for ``gate`` after its first word; returns the response
    and its line iterator, positioned after the first chunk."""
    body = {"input": {"text": words, "gate": str(gate)}, "stream": True, "request_id": request_id}
    response = client.send(client.build_request("POST", REQUESTS, json=body), stream=True)
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    head = [next(lines), next(lines)]
    assert head[0] == "event: chunk"
    return response, lines, head




def test_overload_is_a_429_with_retry_after_and_sigterm_drains_a_stream_in_flight(tmp_path):
    gate = tmp_path / "gate"
    server = ServerProcess(CONFIG, "--drain-timeout", "30", env=ENV).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            first, first_lines, first_head = held_stream(client, gate, "held-1")
            second, second_lines, second_head = held_stream(client, gate, "held-2")
            # limits.max_in_flight is 2: a third request is refused at once, JSON or stream.
            r = client.post(REQUESTS, json={"input": {"text": "x"}})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "Overloaded"
            r = client.post(REQUESTS, json={"input": {"text": "x"}, "stream": True})
            assert r.status_code == 429

            server.signal(signal.SIGTERM)
            assert holds_within(lambda: client.get("/ready").status_code == 503, 20)
            assert client.get("/ready").json()["status"] == "draining"
            refused = client.post(REQUESTS, json={"input": {"text": "late"}})
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "Draining"
            assert server.proc.poll() is None  # still serving its two streams

            gate.touch()  # let both streams finish
            events = sse_events(first_head + list(first_lines))
            others = sse_events(second_head + list(second_lines))
            first.close()
            second.close()
        assert [n for n, _ in events] == ["chunk", "chunk", "chunk", "result"]
        assert json.loads(events[-1][1])["result"] == {"text": "ONE TWO THREE", "count": 3}
        assert others[-1][0] == "result"
        assert server.wait(60) == 0, server.output()
    finally:
        if server.proc.poll() is None:
            server.stop()
    server.assert_nothing_left()
    access = [json.loads(line) for line in server.lines if '"http request"' in line]
    held = [a for a in access if a.get("request_id") == "held-1"]
    assert len(held) == 1 and held[0]["status"] == 200 and "duration_ms" in held[0] and "ttfc_ms" in held[0]


@pytest.mark.parametrize("how", ["drain timeout", "second signal"])
def test_what_is_left_after_the_drain_is_aborted_and_the_server_still_exits_cleanly(tmp_path, how):
    args = ["--drain-timeout", "0.5" if how == "drain timeout" else "60"]
    server = ServerProcess(CONFIG, *args, env=ENV).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            response, lines, head = held_stream(client, tmp_path / "never", "stuck")
            server.signal(signal.SIGTERM)
            if how == "second signal":
                assert holds_within(lambda: client.get("/ready").status_code == 503, 20)
                server.signal(signal.SIGINT)
            events = sse_events(head + list(lines))
            response.close()
        assert events[-1][0] == "error"
        assert json.loads(events[-1][1])["type"] == "RequestAborted"
        assert server.wait(60) == 0, server.output()
    finally:
        if server.proc.poll() is None:
            server.stop()
    server.assert_nothing_left()

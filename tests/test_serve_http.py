"""``omni serve`` as a real process hit over real HTTP: routes, JSON and SSE requests, the tensor
encoding, the error mapping, 64 concurrent streams, disconnects that abort, and metrics over
every stage process."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest
import torch

from omni_core.encoding import from_jsonable, to_jsonable
from omni_core.testing.serve import ServerProcess, sse_events
from omni_core.testing.waiting import holds_within

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HERE = Path(__file__).parent
CONFIG = str(HERE / "configs" / "serve" / "words.yaml")
REQUESTS = "/v1/pipelines/words/requests"


@pytest.fixture(scope="module")
def server():
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    with ServerProcess(CONFIG, "--drain-timeout", "10", env=env).serving() as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of a Prometheus text page (None when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        sample, _, rest = key.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if sample == name and got == want:
            return float(value)
    return None


def wait_metric(client, name, predicate, deadline=10.0, **labels):
    end = time.monotonic() + deadline
    while True:
        value = metric(client.get("/metrics").text, name, **labels)
        if predicate(value) or time.monotonic() > end:
            return value
        time.sleep(0.05)


# -- routes --------------------------------------------------------------------------------------


def test_health_and_ready_answer_200_while_running(client):
    assert client.get("/health").status_code == 200
    r = client.get("/ready")
    assert r.status_code == 200 and r.json() == {"status": "ready", "pipeline": "words"}


def test_pipelines_and_plugins_describe_the_server(client):
    pipelines = client.get("/v1/pipelines").json()["pipelines"]
    assert [(p["name"], p["stages"], p["terminal_stages"], p["ready"]) for p in pipelines] == \
        [("words", ["shout", "words"], ["words"], True)]
    plugins = {p["name"]: p for p in client.get("/v1/plugins").json()}
    assert plugins["omni.relays"]["builtin"] and "shm" in plugins["omni.relays"]["registered"]["relay"]


def test_a_json_request_returns_the_result_with_its_id(client):
    r = client.post(REQUESTS, json={"input": {"text": "hello omni"}, "request_id": "json-1"})
    assert r.status_code == 200, r.text
    assert r.json() == {"id": "json-1", "result": {"text": "HELLO OMNI", "count": 2}}


def test_without_a_request_id_the_server_gives_one(client):
    first = client.post(REQUESTS, json={"input": {"text": "a"}}).json()["id"]
    second = client.post(REQUESTS, json={"input": {"text": "a"}}).json()["id"]
    assert first and second and first != second


def test_tensors_travel_in_and_out_in_the_documented_encoding(client):
    x = torch.tensor([[1.5, -2.0], [3.0, 4.25]])
    r = client.post(REQUESTS, json={"input": {"text": "t", "tensor": 3, "x": to_jsonable(x)}})
    assert r.status_code == 200, r.text
    result = r.json()["result"]
    assert result.keys() >= {"values", "x"}
    assert result["values"]["dtype"] == "float32" and result["values"]["shape"] == [3]
    assert torch.equal(from_jsonable(result["values"]), torch.arange(3, dtype=torch.float32))
    assert torch.equal(from_jsonable(result["x"]), x * 2)


def test_a_stream_sends_each_chunk_then_the_result(client):
    with client.stream("POST", REQUESTS, json={"input": {"text": "one two three"}, "stream": True, "request_id": "s-1"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(r.iter_lines()))
    assert [name for name, _ in events] == ["chunk", "chunk", "chunk", "result"]
    chunks = [json.loads(data) for _, data in events[:3]]
    assert chunks == [{"stage": "words", "data": {"index": i, "text": w}} for i, w in enumerate(["ONE", "TWO", "THREE"])]
    assert json.loads(events[3][1]) == {"id": "s-1", "result": {"text": "ONE TWO THREE", "count": 3}}


def test_a_stage_error_after_chunks_ends_the_stream_with_an_error_event(client):
    body = {"input": {"text": "a b c", "fail_after": 2}, "stream": True}
    with client.stream("POST", REQUESTS, json=body) as r:
        events = sse_events(list(r.iter_lines()))
    assert [name for name, _ in events] == ["chunk", "chunk", "error"]
    error = json.loads(events[-1][1])
    assert (error["type"], error["stage"]) == ("ValueError", "words")
    assert "failed after 2 word(s)" in error["message"]


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "not valid JSON"),
    (b'["input"]', "JSON object"),
    (b'{"inputs": {}}', "unknown field(s) ['inputs']"),
    (b'{}', "needs 'input'"),
    (b'{"input": {}, "stream": "yes"}', "'stream' must be true or false"),
    (b'{"input": {}, "timeout": -1}', "'timeout' must be a positive number"),
    (b'{"input": {"x": {"dtype": "float99", "shape": [1], "data": "AAAA"}}}', "unknown dtype 'float99'"),
])
def test_an_invalid_body_is_a_400_that_says_what_is_wrong(client, body, fragment):
    r = client.post(REQUESTS, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "InvalidRequest" and fragment in error["message"]


def test_an_unknown_pipeline_is_a_404(client):
    r = client.post("/v1/pipelines/nope/requests", json={"input": {}})
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "UnknownPipeline" and "'words'" in r.json()["error"]["message"]


def test_a_stage_error_is_a_500_naming_the_stage(client):
    r = client.post(REQUESTS, json={"input": {"text": "x", "fail_at_once": True}})
    assert r.status_code == 500
    assert r.json()["error"] == {"type": "RuntimeError", "stage": "words", "message": "failed before any word"}


def test_a_request_past_its_timeout_is_a_504_and_is_aborted(client, tmp_path):
    marker = tmp_path / "aborted"
    body = {"input": {"text": "a b", "gate": str(tmp_path / "never"), "marker": str(marker)}, "timeout": 0.5}
    r = client.post(REQUESTS, json=body)
    assert r.status_code == 504 and r.json()["error"]["type"] == "RequestTimeout"
    assert holds_within(marker.exists, 30), "the stage's call never recorded its end"
    assert marker.read_text() == "aborted"


def test_a_request_id_in_flight_cannot_be_reused(client, tmp_path):
    gate = tmp_path / "gate"
    body = {"input": {"text": "a b", "gate": str(gate)}, "stream": True, "request_id": "dup"}
    with client.stream("POST", REQUESTS, json=body) as r:
        lines = r.iter_lines()
        head = [next(lines), next(lines)]  # the first chunk: the request is in flight
        again = client.post(REQUESTS, json={"input": {"text": "x"}, "request_id": "dup"})
        gate.touch()
        events = sse_events(head + list(lines))
    assert again.status_code == 409 and again.json()["error"]["type"] == "RequestIdInUse"
    assert events[-1][0] == "result"


# -- many streams, disconnects, metrics ---------------------------------------------------------------


def test_64_concurrent_streams_all_complete_in_order(server):
    async def one(client, i):
        words = [f"w{i}x{k}" for k in range(5)]
        body = {"input": {"text": " ".join(words)}, "stream": True, "request_id": f"many-{i}"}
        async with client.stream("POST", REQUESTS, json=body) as r:
            assert r.status_code == 200
            events = sse_events([line async for line in r.aiter_lines()])
        assert [json.loads(d)["data"]["text"] for n, d in events if n == "chunk"] == [w.upper() for w in words]
        assert events[-1][0] == "result"

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            await asyncio.gather(*(one(client, i) for i in range(64)))

    asyncio.run(main())


def test_a_client_that_disconnects_aborts_its_request(client, tmp_path):
    marker = tmp_path / "aborted"
    body = {"input": {"text": "a b c", "gate": str(tmp_path / "never"), "marker": str(marker)}, "stream": True}
    with client.stream("POST", REQUESTS, json=body) as r:
        lines = r.iter_lines()  # kept: dropping the iterator closes the connection
        assert next(lines).startswith("event: chunk")
        assert wait_metric(client, "omni_requests_in_flight", lambda v: v == 1, pipeline="words") == 1
    # The connection is closed: the stage's call is cancelled and nothing stays in flight.
    assert holds_within(marker.exists, 30), "the stage's call never recorded its end"
    assert marker.read_text() == "aborted"
    assert wait_metric(client, "omni_requests_in_flight", lambda v: v == 0, pipeline="words") == 0


def test_a_non_streamed_request_is_aborted_when_its_client_disconnects(server, client, tmp_path):
    marker = tmp_path / "aborted"
    body = {"input": {"text": "a b", "gate": str(tmp_path / "never"), "marker": str(marker)}}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url, timeout=1.0) as short:
        short.post(REQUESTS, json=body)
    assert holds_within(marker.exists, 30), "the stage's call never recorded its end"
    assert marker.read_text() == "aborted"
    assert wait_metric(client, "omni_requests_in_flight", lambda v: v == 0, pipeline="words") == 0


def test_metrics_cover_requests_and_every_stage_process(client):
    assert client.post(REQUESTS, json={"input": {"text": "m e t"}}).status_code == 200
    with client.stream("POST", REQUESTS, json={"input": {"text": "s t"}, "stream": True}) as r:
        list(r.iter_lines())
    client.post(REQUESTS, json={"input": {"text": "x", "fail_at_once": True}})
    # Stage processes export every EXPORT_INTERVAL: poll until the calls above are counted.
    wait_metric(client, "omni_stage_calls_total", lambda v: (v or 0) >= 1, stage="words", status="error")
    text = client.get("/metrics").text
    assert client.get("/metrics").headers["content-type"].startswith("text/plain")
    assert metric(text, "omni_requests_total", pipeline="words", status="ok") >= 2
    assert metric(text, "omni_requests_total", pipeline="words", status="error") >= 1
    assert metric(text, "omni_request_duration_seconds_count", pipeline="words") >= 3
    assert metric(text, "omni_time_to_first_chunk_seconds_count", pipeline="words") >= 1
    assert metric(text, "omni_requests_in_flight", pipeline="words") == 0
    for stage in ("shout", "words"):
        assert metric(text, "omni_stage_calls_total", stage=stage, status="ok") >= 2
        assert metric(text, "omni_stage_duration_seconds_count", stage=stage) >= 2
        assert metric(text, "omni_process_restarts_total", process=stage) == 0
    assert metric(text, "omni_stream_chunks_total", stage="words") >= 5
    assert metric(text, "omni_stage_duration_seconds_bucket", stage="words", le="+Inf") >= 2
    assert "# TYPE omni_relay_bytes_total counter" in text


def test_unknown_routes_answer_in_the_error_shape(client):
    r = client.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFound"

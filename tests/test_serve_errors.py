"""How omni serve answers a stage's errors, and how stages know a request came over the network.

A stage's ``InvalidInput`` (in any process) is a 400 naming its field, JSON or SSE, before or after
the first event, without a traceback; anything else a stage raises is a 500 logged at error with
its traceback; a process that dies holding the request is a 503 with ``Retry-After``; a body
nested too deeply is a 400 in JSON. ``ctx.from_network`` is True in every stage process for a
request over HTTP and False for the Python API; the local-file rule follows it."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest

from omni_core import Pipeline, StageError, load_config
from omni_core.testing.serve import ServerProcess, sse_events
from omni_core.testing.waiting import holds_within

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HERE = Path(__file__).parent
CONFIG = str(HERE / "configs" / "serve" / "errors.yaml")
REQUESTS = "/v1/pipelines/errors/requests"
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(CONFIG, env=ENV).serving() as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_every_stage_process_knows_the_request_came_over_the_network(client):
    r = client.post(REQUESTS, json={"input": {"text": "hi"}})
    assert r.status_code == 200 and r.json()["result"]["seen"] == [True, True]
    with client.stream("POST", REQUESTS, json={"input": {"text": "hi"}, "stream": True}) as r:
        events = sse_events(list(r.iter_lines()))
    assert json.loads(events[-1][1])["result"]["seen"] == [True, True]


def test_the_python_api_is_local_unless_it_says_otherwise(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    monkeypatch.syspath_prepend(str(HERE))

    async def main():
        async with Pipeline(load_config(CONFIG)) as p:
            local = await p.submit({"path": "/etc/hostname"})
            networked = await p.submit({"text": "x"}, from_network=True)
            with pytest.raises(StageError) as refused:
                await p.submit({"path": "/etc/hostname"}, from_network=True)
            return local, networked, refused.value

    local, networked, refused = asyncio.run(main())
    assert local["seen"] == [False, False] and local["path"] == "/etc/hostname"
    assert networked["seen"] == [True, True]
    assert refused.invalid_input and refused.field == "path" and refused.error_type == "InvalidInput"


@pytest.mark.parametrize("where", ["first", "second"])
def test_a_stages_invalid_input_is_a_400_naming_the_field(client, where):
    r = client.post(REQUESTS, json={"input": {"invalid": "max_tokens", "where": where}})
    assert r.status_code == 400
    assert r.json() == {"error": {"type": "InvalidInput", "stage": where, "message": "max_tokens is wrong here",
                                  "field": "max_tokens"}}
    r = client.post(REQUESTS, json={"input": {"invalid": "speed", "where": where}, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["field"] == "speed"


def test_after_the_first_event_the_error_event_names_the_field(client):
    body = {"input": {"invalid": "voice", "where": "second", "emit_first": True}, "stream": True}
    with client.stream("POST", REQUESTS, json=body) as r:
        assert r.status_code == 200
        events = sse_events(list(r.iter_lines()))
    kind, data = events[-1]
    assert kind == "error"
    assert json.loads(data) == {"type": "InvalidInput", "stage": "second", "message": "voice is wrong here",
                                "field": "voice"}


def test_a_local_path_from_the_network_is_refused_without_a_trace_of_the_file(client, tmp_path):
    there = tmp_path / "there.txt"
    there.write_text("x")
    answers = set()
    for value in (str(there), str(tmp_path / "missing.txt"), "../../etc/hostname", "%2Fetc%2Fhostname"):
        r = client.post(REQUESTS, json={"input": {"path": value}})
        assert r.status_code == 400 and r.json()["error"]["field"] == "path"
        answers.add(r.text.replace(json.dumps(repr(value))[1:-1], "VALUE"))
    assert len(answers) == 1, answers


def test_any_other_stage_error_is_a_500_logged_at_error_with_its_traceback(client, server):
    r = client.post(REQUESTS, json={"input": {"bug": True, "where": "second"}})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "KeyError" and "Traceback" not in r.text
    logged = [json.loads(line) for line in server.wait_for_lines('"request failed"', "KeyError")]
    assert logged[-1]["level"] == "error" and "a bug in the stage" in logged[-1]["traceback"]
    refused = [json.loads(line) for line in server.lines if '"request failed"' in line and "InvalidInput" in line]
    assert all(line["level"] == "warning" for line in refused)


def test_a_process_that_dies_holding_the_request_is_a_503_to_retry(client):
    r = client.post(REQUESTS, json={"input": {"die": True, "where": "second"}})
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["type"] == "ProcessDied"
    r = client.post(REQUESTS, json={"input": {"die": True, "where": "first"}, "stream": True})
    assert r.status_code == 503 and r.headers["retry-after"]
    answers = []

    def retried() -> bool:  # the process restarts (restart: on-failure): a retry is answered
        answers.append(client.post(REQUESTS, json={"input": {"text": "again"}}))
        return answers[-1].status_code != 503

    holds_within(retried, 60, 0.1)
    assert answers[-1].status_code == 200, answers[-1].text


@pytest.mark.parametrize("depth", [65, 5000, 200_000])
def test_a_body_nested_too_deeply_is_a_400_in_json(client, depth):
    body = '{"input": {"x": ' + "[" * depth + "]" * depth + "}}"
    r = client.post(REQUESTS, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"] == {"type": "InvalidRequest", "stage": None,
                                 "message": "the body nests arrays/objects more than 64 deep"}
    shallow = '{"input": {"x": ' + "[" * 60 + "]" * 60 + "}}"
    assert client.post(REQUESTS, content=shallow, headers={"content-type": "application/json"}).status_code == 200

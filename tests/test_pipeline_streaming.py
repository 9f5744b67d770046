"""Streaming: chunks to the caller, between processes, inside one process, before the payload,
and stream_done_to_fn."""

from __future__ import annotations

import contextlib

import pytest
from runtime_helpers import arun, fn, no_leaks, pipeline, stage, until  # noqa: F401

from omni_core import Pipeline, StageError
from omni_core.errors import RequestTimeout

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_leaks")]


async def _stream(cfg, inputs):
    async with Pipeline(cfg) as p:
        return [event async for event in p.stream(inputs)]


def test_terminal_stage_chunks_reach_the_caller_in_order_before_the_result():
    cfg = pipeline(stage("up", "Upper", next="tok"), stage("tok", "Tokens", terminal=True))
    events = arun(_stream(cfg, {"text": "abc"}))
    assert [(e.kind, e.stage, e.data) for e in events] == [
        ("chunk", "tok", {"token": "A"}),
        ("chunk", "tok", {"token": "B"}),
        ("chunk", "tok", {"token": "C"}),
        ("result", "tok", {"text": "ABC"}),
    ]


@pytest.mark.parametrize("same_process", [False, True], ids=["across-processes", "one-process"])
def test_stage_streams_to_another_stage_while_it_runs(same_process):
    process = {"process": "p"} if same_process else {}
    cfg = pipeline(
        stage("src", "Echo", next=["tok", "collect"], **process),
        stage("tok", "Tokens", args={"delay": 0.01}, stream_to=["collect"], terminal=True, **process),
        # collect's payload (from src) and tok's first chunk race: allow chunks to come first
        stage("collect", "Collect", args={"source": "tok"}, terminal=True, can_accept_stream_before_payload=True, **process),
    )
    events = arun(_stream(cfg, {"text": "stream"}))
    assert [e.data["token"] for e in events if not e.is_result] == list("stream")
    result = events[-1].data
    assert result["collect"] == {"streamed": "stream", "payload": {"text": "stream"}}


def test_chunks_before_the_payload_are_buffered_when_allowed():
    cfg = pipeline(
        stage("tok", "Tokens", stream_to=["collect"], next="collect"),
        stage("collect", "Collect", args={"source": "tok"}, terminal=True, can_accept_stream_before_payload=True),
    )
    events = arun(_stream(cfg, {"text": "early"}))
    assert events[-1].data == {"streamed": "early", "payload": {"text": "early"}}


def test_chunks_before_the_payload_are_held_until_it_arrives_without_the_flag():
    # tok streams its whole output, then sends collect its payload: every chunk comes first
    cfg = pipeline(
        stage("tok", "Tokens", stream_to=["collect"], next="collect"),
        stage("collect", "Collect", args={"source": "tok"}, terminal=True),
    )
    events = arun(_stream(cfg, {"text": "held"}))
    assert events[-1].data == {"streamed": "held", "payload": {"text": "held"}}


def test_stream_done_to_fn_chooses_who_gets_the_end_signal():
    cfg = pipeline(
        stage("src", "Echo", next=["tok", "collect"]),
        stage("tok", "Tokens", stream_to=["collect"], stream_done_to_fn=fn("stream_done_by_request_id"), terminal=True),
        stage("collect", "Collect", args={"source": "tok"}, terminal=True, can_accept_stream_before_payload=True),
        limits={"request_timeout": 3},
    )

    async def body():
        async with Pipeline(cfg) as p:
            done = await p.submit({"text": "ok"}, request_id="done-1")
            with pytest.raises(RequestTimeout):
                await p.submit({"text": "ok"}, request_id="never-1")
            return done

    assert arun(body())["collect"]["streamed"] == "ok"


def test_leaving_the_stream_early_aborts_the_request():
    cfg = pipeline(stage("tok", "Tokens", args={"delay": 0.05}, terminal=True))

    async def body():
        async with Pipeline(cfg) as p:
            async with contextlib.aclosing(p.stream({"text": "abcdefghij"}, request_id="r")) as events:
                async for event in events:
                    assert event.data == {"token": "a"}
                    break
            assert "r" not in p.by_id
            async for _ in p.stream({"text": "abcdefghij"}, request_id="r"):
                break
            await until(lambda: "r" not in p.by_id, "the dropped generator to be closed, aborting its request")
            return await p.submit({"text": "z"}, request_id="r")

    assert arun(body()) == {"text": "z"}


def test_emitting_without_stream_to_from_a_non_terminal_stage_fails_the_request():
    cfg = pipeline(stage("tok", "Tokens", next="end"), stage("end", "Echo", terminal=True))
    with pytest.raises(StageError, match="no stream_to and is not terminal"):
        arun(_stream(cfg, {"text": "x"}))

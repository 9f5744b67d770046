"""``stream_to: [caller]`` from a tensor-parallel stage: every rank emits, only the leader's
(rank 0's) chunks reach the caller (and a next stage it streams to as well), each once and in
order, with the credits of any stream; a caller that reads nothing or leaves mid-stream holds
nothing up, and nothing is left behind."""

from __future__ import annotations

import asyncio

import pytest
import torch
from runtime_helpers import arun, no_leaks, pipeline, stage, until_state  # noqa: F401
from test_stream_to_caller import read

from omni_core import Pipeline

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_leaks")]

TP = 2


def config(buffer: int = 2) -> dict:
    """``tp`` (two ranks) streams to the caller and hands its result to ``sink``; few credits, so
    a stream waits on its reader."""
    return pipeline(
        stage("tp", "TPChunks", tp_size=TP, stream_to=["caller"], next=["sink"]),
        stage("sink", "Echo", terminal=True),
        limits={"stream_buffer": buffer},
    )


def check_chunks(events: list, n: int) -> None:
    """``n`` chunks of stage ``tp``, i = 0..n-1 once each in order, all from rank 0, each with the
    group's all-reduced sum."""
    assert [e.stage for e in events] == ["tp"] * n
    assert [e.data["i"] for e in events] == list(range(n))
    assert {e.data["rank"] for e in events} <= {0}
    for e in events:
        assert torch.equal(e.data["sum"], torch.full((1,), float(e.data["i"] * TP)))


def idle(state: dict) -> bool:
    """Nothing held anywhere: the coordinator's request table and every process's counters
    (requests running, streams, fan-in parts, finished-but-unforgotten requests, ordering
    windows: the follower's included) are all 0."""
    assert {"coordinator", "tp.0", "tp.1"} <= set(state)
    return all(value == 0 for report in state.values() for value in report.values()
               if isinstance(value, (int, float)) and not isinstance(value, bool))


def test_a_tp_stage_streams_only_its_leaders_chunks_to_the_caller_in_order_and_once():
    async def body():
        async with Pipeline(config()) as p:
            assert sorted(p.pids()) == ["sink", "tp.0", "tp.1"]
            alone = await read(p, {"n": 40})
            together = await asyncio.gather(*(read(p, {"n": 10 + r, "r": r}) for r in range(8)))
            submitted = await p.submit({"n": 25, "r": "unread"})  # nobody reads the stream: credits come back
            after = await read(p, {"n": 5, "r": "after"})  # no chunk of an earlier request shows up here
            state = await until_state(p, idle, "every process idle after the requests")
            return alone, together, submitted, after, state

    alone, together, submitted, after, _ = arun(body(), timeout=200)
    events, result = alone
    check_chunks(events, 40)
    assert result == {"n": 40, "rank": 0, "ranks": TP, "r": None}
    for r, (events, result) in enumerate(together):
        check_chunks(events, 10 + r)
        assert result == {"n": 10 + r, "rank": 0, "ranks": TP, "r": r}
    assert submitted == {"n": 25, "rank": 0, "ranks": TP, "r": "unread"}
    events, result = after
    check_chunks(events, 5)
    assert result["r"] == "after"


def test_a_caller_leaving_a_tp_stages_stream_ends_that_request_alone():
    async def body():
        async with Pipeline(config(buffer=1)) as p:
            stream = p.stream({"n": 200})
            first = await anext(stream)
            await stream.aclose()  # the caller leaves after one chunk: the request is aborted on every rank
            after = await asyncio.gather(*(read(p, {"n": 12, "r": r}) for r in range(3)))
            await until_state(p, idle, "every process idle after the abort")
            return first, after

    first, after = arun(body(), timeout=200)
    assert first.stage == "tp" and first.data["i"] == 0 and first.data["rank"] == 0
    for r, (events, result) in enumerate(after):
        check_chunks(events, 12)
        assert result == {"n": 12, "rank": 0, "ranks": TP, "r": r}


def test_a_tp_stage_streaming_to_the_caller_and_to_a_next_stage_sends_each_its_leaders_chunks_once():
    cfg = pipeline(
        stage("tp", "TPChunks", tp_size=TP, stream_to=["collect", "caller"], next=["collect"]),
        stage("collect", "CollectTensors", args={"source": "tp"}, terminal=True, can_accept_stream_before_payload=True),
        limits={"stream_buffer": 2},
    )

    async def body():
        async with Pipeline(cfg) as p:
            runs = await asyncio.gather(*(read(p, {"n": 15 + r}) for r in range(6)))
            await until_state(p, idle, "every process idle after the requests")
            return runs

    for r, (events, result) in enumerate(arun(body(), timeout=200)):
        check_chunks(events, 15 + r)
        assert result == {"got": list(range(15 + r)), "bad": []}  # the next stage got each chunk once, in order

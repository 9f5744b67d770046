"""A process death fails the requests that are, or will be, in its process group, decided by
where each request is: a stream already past the dead stage finishes; requests still before
it or in it fail with ProcessDied."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from runtime_helpers import arun, no_leaks, pipeline, stage, until  # noqa: F401

from omni_core import Pipeline, ProcessDied
from omni_core.config import load_config
from omni_core.runtime.requests import Graph

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]


def test_the_stages_a_request_has_passed_follow_the_graph():
    cfg = load_config(pipeline(
        stage("a", "Echo", next=["b"]), stage("b", "Echo", next=["c"]),
        stage("c", "Echo", next=["d", "e"]), stage("d", "Tokens", terminal=True),
        stage("e", "Tokens", next=["f"], stream_to=["f"]), stage("f", "Collect", args={"source": "e"}, terminal=True)))
    passed = Graph(cfg).passed
    assert passed["b"] == {"a"}
    assert passed["c"] == {"a", "b"}
    assert passed["d"] == set(), "c feeds e too: hearing from d says nothing of c"
    assert passed["f"] == set(), "e streams into f: it may still run"


def test_a_stream_past_the_dead_stage_finishes_and_only_requests_before_or_in_it_fail():
    cfg = pipeline(
        stage("a", "Echo", next="b"),
        stage("b", "Echo", next="c"),
        stage("c", "Tokens", args={"delay": 0.05}, terminal=True),
        restart={"policy": "on-failure", "max_restarts": 2},
    )

    async def body():
        async with Pipeline(cfg) as p:
            text = "abcdefghijklmnopqrstuvwxyz"
            firsts = [asyncio.Event() for _ in range(6)]

            async def read(i: int):
                chunks, result = [], None
                async for event in p.stream({"text": text}, request_id=f"s{i}"):
                    if event.is_result:
                        result = event.data
                    else:
                        chunks.append(event.data["token"])
                        firsts[i].set()
                return "".join(chunks), result

            streams = [asyncio.ensure_future(read(i)) for i in range(6)]
            for ev in firsts:
                await asyncio.wait_for(ev.wait(), 30)
            old = p.pids()["b"]
            os.kill(old, signal.SIGKILL)
            await until(lambda: p.running and p.pids()["b"] not in (None, old), "b restarted", 60)
            for got in await asyncio.gather(*streams):
                assert got == (text, {"text": text}), "a stream past the dead stage was cut short"
            assert (await p.submit({"text": "x"}))["text"] == "x"

    arun(body(), timeout=100)


def test_a_request_before_the_dead_stage_fails_with_process_died():
    cfg = pipeline(
        stage("a", "Sleep", next="b"),
        stage("b", "Echo", next="c"),
        stage("c", "Echo", terminal=True),
        restart={"policy": "on-failure", "max_restarts": 2},
    )

    async def body():
        async with Pipeline(cfg) as p:
            waiting = asyncio.ensure_future(p.submit({"sleep": 30}))
            await until(lambda: p.coordinator.in_flight() == 1, "the request admitted")
            old = p.pids()["b"]
            os.kill(old, signal.SIGKILL)
            with pytest.raises(ProcessDied):
                await asyncio.wait_for(waiting, 30)

    arun(body(), timeout=100)


def test_a_bad_payload_is_refused_by_the_sender_with_its_path_and_the_pipeline_serves_on():
    from omni_core.relay.payload import PayloadError

    async def body():
        async with Pipeline(pipeline(stage("a", "Echo", terminal=True))) as p:
            with pytest.raises(PayloadError, match=r"payload\['tags'\]: a set"):
                await p.submit({"tags": {"x", "y"}})
            assert p.coordinator.in_flight() == 0
            assert await p.submit({"tags": ["x", "y"]}) == {"tags": ["x", "y"]}

    arun(body(), timeout=60)

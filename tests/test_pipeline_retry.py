"""Retries: a request whose attempt failed because its process died (or hung) runs again once
the group is back, with the same request id and inputs; the caller sees one result, equal to a
run without the crash. A stream is retried only before its first chunk reached the caller."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch
from runtime_helpers import arun, no_leaks, pipeline, stage, under_load, until  # noqa: F401

from omni_core import Pipeline, ProcessDied, metrics

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leaks")]

RESTART = {"policy": "on-failure", "max_restarts": 5}


def chain(journal: str, **fields) -> dict:
    return pipeline(
        stage("a", "Journal", args={"path": journal}, next="b"),
        stage("b", "Journal", args={"path": journal}, next="c"),
        stage("c", "Journal", args={"path": journal}, terminal=True),
        relay={"backend": "shm", "options": {"slots": 8, "timeout": 10}},
        restart=RESTART, **fields)


async def _killed(p: Pipeline, victim: str) -> None:
    old = p.pids()[victim]
    os.kill(old, signal.SIGKILL)
    await until(lambda: p.running and p.pids()[victim] not in (None, old), f"{victim} restarted", 60)


def test_crash_under_load_of_a_retryable_pipeline_fails_no_request(tmp_path):
    journal = str(tmp_path / "journal")
    cfg = chain(journal, retry={"attempts": 3})

    async def body():
        async with Pipeline(cfg) as p:
            async def one(i: int):
                await asyncio.sleep(0.005 * i)  # the load: arrivals 5 ms apart
                return await p.submit({"t": torch.full((16384,), float(i)), "sleep": 0.01, "block": True},
                                      request_id=f"r{i}")

            tasks = [asyncio.ensure_future(one(i)) for i in range(200)]
            await under_load(tasks, journal, p.pids()["b"], served=20)
            await _killed(p, "b")
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
            for i, o in enumerate(outcomes):
                assert isinstance(o, dict), f"request {i} failed: {o!r}"
                assert torch.equal(o["t"], torch.full((16384,), float(i))) and o["sleep"] == 0.01
            assert p.retries.get("ProcessDied", 0) > 0, "the kill retried nothing"
            snap = metrics.collect(p)
            assert dict((tuple(k), v) for k, v in snap["values"]["omni_request_retries_total"]) == {
                ("test", "ProcessDied"): p.retries["ProcessDied"]}
            state = await p.debug_state()
            assert state["coordinator"] == {"requests": 0, "by_id": 0, "ordered": 0}

    arun(body(), timeout=170)


def test_a_request_may_ask_for_retries_or_refuse_them(tmp_path):
    async def body():
        async with Pipeline(chain(str(tmp_path / "journal"))) as p:
            kept = asyncio.ensure_future(p.submit({"sleep": 30}, retry=2))
            lost = asyncio.ensure_future(p.submit({"sleep": 30}))
            await until(lambda: p.coordinator.in_flight() == 2, "both admitted")
            await _killed(p, "a")
            with pytest.raises(ProcessDied):
                await asyncio.wait_for(lost, 30)
            assert not kept.done(), "the retried request ended with the failed attempt"
            await p.abort(next(iter(p.by_id)))  # its second attempt sleeps 30 s: enough
        async with Pipeline(chain(str(tmp_path / "journal2"), retry={"attempts": 4})) as p:
            refused = asyncio.ensure_future(p.submit({"sleep": 30}, retry={"attempts": 1}))
            await until(lambda: p.coordinator.in_flight() == 1, "admitted")
            await _killed(p, "a")
            with pytest.raises(ProcessDied):
                await asyncio.wait_for(refused, 30)
            with pytest.raises(ValueError, match="retry.on"):
                await p.submit({}, retry={"attempts": 2, "on": ["StageError"]})

    arun(body(), timeout=170)


def test_a_retried_request_runs_again_with_the_same_request_id(tmp_path):
    journal = tmp_path / "journal"

    async def body():
        async with Pipeline(chain(str(journal), retry={"attempts": 2})) as p:
            inputs = {"gate": str(tmp_path / "go"), "x": 7}  # held in a until it was killed
            waiting = asyncio.ensure_future(p.submit(inputs, request_id="mine"))
            await until(lambda: journal.exists() and "mine" in journal.read_text(), "a ran it")
            await _killed(p, "a")
            (tmp_path / "go").touch()
            assert await asyncio.wait_for(waiting, 60) == inputs
            runs = [line.split() for line in journal.read_text().splitlines()]
            assert [stage_pid for stage_pid, rid in runs if rid == "mine"][:1] != [str(p.pids()["a"])]
            assert sum(1 for _, rid in runs if rid == "mine") == 4, "a twice (killed, retried), b and c once"

    arun(body(), timeout=170)


def test_a_stream_is_retried_before_its_first_chunk_and_not_after(tmp_path):
    cfg = pipeline(
        stage("a", "Sleep", next="b"),
        stage("b", "Tokens", args={"delay": 0.2}, terminal=True),
        restart=RESTART, retry={"attempts": 3})

    async def body():
        async with Pipeline(cfg) as p:
            async def read(inputs):
                chunks = []
                async for event in p.stream(inputs):
                    if event.is_result:
                        return "".join(chunks), event.data
                    chunks.append(event.data["token"])
                    first.set()

            first = asyncio.Event()
            early = asyncio.ensure_future(read({"gate": str(tmp_path / "go"), "text": "abc"}))  # held in a
            await until(lambda: p.coordinator.in_flight() == 1, "admitted")
            await _killed(p, "a")  # before any chunk: retried, and the stream is whole
            (tmp_path / "go").touch()
            assert await asyncio.wait_for(early, 60) == ("abc", {"text": "abc"})
            first.clear()
            late = asyncio.ensure_future(read({"sleep": 0, "text": "abcdefghijklmnop"}))
            await asyncio.wait_for(first.wait(), 30)
            await _killed(p, "b")  # after a chunk: not retried (no chunk is repeated)
            with pytest.raises(ProcessDied):
                await asyncio.wait_for(late, 30)

    arun(body(), timeout=170)

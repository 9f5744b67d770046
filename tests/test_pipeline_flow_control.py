"""Streams with flow control on the default relay and default limits (no timeout configured):
long streams and many concurrent streams complete, in order and correct; chunks that come
before their target's payload are held; a target that returned early drops the rest."""

from __future__ import annotations

import asyncio

import pytest
from runtime_helpers import arun, no_leaks, pipeline, stage  # noqa: F401

from omni_core import Pipeline

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_leaks")]


def live(**collect_args) -> dict:
    """The live-streaming wiring: ``src`` hands the payload to the producer and to the reader,
    which starts on whichever comes first."""
    return pipeline(
        stage("src", "Echo", next=["tok", "collect"]),
        stage("tok", "TensorChunks", stream_to=["collect"], terminal=True),
        stage("collect", "CollectTensors", args={"source": "tok", **collect_args}, terminal=True,
              can_accept_stream_before_payload=True),
    )


def run_streams(cfg: dict, count: int, n: int, timeout: float = 200) -> list[dict]:
    async def body():
        async with Pipeline(cfg) as p:
            return await asyncio.gather(*(p.submit({"n": n, "r": r}) for r in range(count)))

    return arun(body(), timeout=timeout)


def check(results: list[dict], n: int) -> None:
    for result in results:
        collected = result.get("collect", result)  # one terminal stage: its result itself
        assert collected == {"got": list(range(n)), "bad": []}


def test_a_stream_of_300_tensor_chunks_completes_on_the_default_relay():
    check(run_streams(live(), 1, 300), 300)


def test_20_concurrent_streams_of_60_tensor_chunks_complete():
    check(run_streams(live(), 20, 60), 60)


def test_100_concurrent_streams_of_40_chunks_complete():
    """More streams than the reader's max_concurrency (64): the chunks of readers not started
    yet are buffered, bounded by the credits, and every stream completes."""
    check(run_streams(live(), 100, 40), 40)


def test_chunks_that_come_before_the_payload_are_held_until_it_arrives():
    """The reader's payload is the producer's result, so every chunk arrives first; the reader
    does not accept streams before its payload, so they are held, not rejected."""
    cfg = pipeline(
        stage("tok", "TensorChunks", stream_to=["collect"], next="collect"),
        stage("collect", "CollectTensors", args={"source": "tok"}, terminal=True),
    )
    check(run_streams(cfg, 4, 30), 30)


def test_a_reader_that_returned_early_drops_the_later_chunks_without_failing():
    results = run_streams(live(take=2), 20, 30)
    for result in results:
        assert result["collect"] == {"got": [0, 1], "bad": []}

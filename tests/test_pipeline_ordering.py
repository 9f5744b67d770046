"""One order per sender: tensor chunks, tensor-less chunks, stream ends and results are handled
in the order they were sent, stage → stage and stage → caller, whatever the relay, even when
the receiving event loop is busy while they arrive."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from runtime_helpers import arun, no_leaks, pipeline, stage  # noqa: F401

from omni_core import Pipeline

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]

RELAYS = ["shm", "inline"]


@pytest.mark.parametrize("relay", RELAYS)
def test_stage_to_stage_chunks_arrive_in_order_while_the_reader_is_busy(relay):
    """Two tensor chunks and a tensor-less one reach a reader whose event loop is busy while
    they (and the stream's end) queue up: it reads all three, in order, with their tensors."""
    cfg = pipeline(
        stage("src", "Echo", next=["tok", "collect"]),
        stage("tok", "TensorChunks", stream_to=["collect"], terminal=True),
        stage("collect", "CollectTensors", args={"source": "tok", "block": 0.3}, terminal=True,
              can_accept_stream_before_payload=True),
        relay=relay,
    )

    async def body():
        async with Pipeline(cfg) as p:
            return await asyncio.gather(*(p.submit({"n": 3, "plain": 3, "r": r}) for r in range(4)))

    for result in arun(body()):
        assert result["collect"] == {"got": [0, 1, 2], "bad": []}


@pytest.mark.parametrize("relay", RELAYS)
def test_stage_to_caller_chunks_all_arrive_in_order_before_the_result(relay):
    """A terminal stage emits 40 tensor chunks and returns; each concurrent caller, its loop
    busy after the first chunk, reads all 40 in order, then the result."""
    cfg = pipeline(stage("src", "Echo", next="tok"), stage("tok", "TensorChunks", terminal=True), relay=relay)

    async def read(p, r):
        events = []
        async for event in p.stream({"n": 40, "r": r}):
            if not events:
                end = time.monotonic() + 0.2  # the caller's loop is busy: everything queues up
                while time.monotonic() < end:
                    pass
            events.append(event)
        return events

    async def body():
        async with Pipeline(cfg) as p:
            return await asyncio.gather(*(read(p, r) for r in range(4)))

    for r, events in enumerate(arun(body())):
        chunks, result = events[:-1], events[-1]
        assert [e.data["i"] for e in chunks] == list(range(40))
        assert all(torch.equal(e.data["t"], torch.full((16,), float(e.data["i"]))) for e in chunks)
        assert result.is_result and result.data["r"] == r

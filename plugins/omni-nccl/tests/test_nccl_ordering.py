"""One order per sender over the nccl relay (CPU tensors over gloo): two tensor chunks and a
tensor-less one reach a reader whose event loop is busy while they and the stream's end queue
up; it reads all three, in order, with their tensors."""

from __future__ import annotations

import asyncio

import pytest
import torch
from omni_core import Pipeline
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leaks")]

STAGES = "nccl_test_stages"


def test_stage_to_stage_chunks_arrive_in_order_over_nccl_while_the_reader_is_busy():
    cfg = {
        "name": "nccl-order",
        "relay": {"backend": "nccl", "options": {"credits": 4, "timeout": 10}},
        "stages": [
            {"name": "src", "factory": f"{STAGES}:Echo", "next": ["tok", "collect"]},
            {"name": "tok", "factory": f"{STAGES}:TensorChunks", "stream_to": ["collect"], "terminal": True},
            {"name": "collect", "factory": f"{STAGES}:CollectTensors", "args": {"source": "tok", "block": 0.3},
             "terminal": True, "can_accept_stream_before_payload": True},
        ],
    }

    async def body():
        async with Pipeline(cfg) as p:
            return await asyncio.gather(*(p.submit({"n": 3, "plain": 3, "x": torch.ones(4), "r": r}) for r in range(4)))

    for result in asyncio.run(asyncio.wait_for(body(), 150)):
        assert result["collect"] == {"got": [0, 1, 2], "bad": []}

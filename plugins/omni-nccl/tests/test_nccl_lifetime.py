"""Received tensors that leave a stage are copied out of the nccl relay's buffers before they are
reused: a CPU echo over gloo (runs everywhere), CUDA echo and a tensor-parallel stage over NCCL
(GPU tests: skipped without CUDA, failed under OMNI_REQUIRE_CUDA=1; NCCL refuses two ranks of one
communicator on one GPU, so these need two)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from omni_core import Pipeline
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leaks")]

STAGES = "nccl_test_stages"


def tensor(n: int) -> torch.Tensor:
    return torch.arange(1000 + n, dtype=torch.float32) + n


def run(cfg: dict, count: int) -> list[dict]:
    async def go():
        async with Pipeline(cfg) as p:
            return await asyncio.gather(*(p.submit({"n": n, "x": tensor(n)}) for n in range(count)))

    return asyncio.run(asyncio.wait_for(go(), 150))


def chain(middle: dict, first: str = "Scale", last: str = "Echo", gpus=(None, None, None)) -> dict:
    stages = [
        {"name": "first", "factory": f"{STAGES}:{first}", "next": "middle"},
        {"name": "middle", **middle, "next": "last"},
        {"name": "last", "factory": f"{STAGES}:{last}", "terminal": True},
    ]
    for spec, gpu in zip(stages, gpus, strict=True):
        if gpu is not None:
            spec["gpu"] = gpu
    return {"name": "nccl-echo", "relay": {"backend": "nccl", "options": {"credits": 2, "timeout": 10}},
            "stages": stages}


def test_cpu_echo_of_pooled_buffers_over_gloo():
    for n, result in enumerate(run(chain({"factory": f"{STAGES}:Echo"}), 24)):
        assert torch.equal(result["x"], tensor(n) * 2), f"request {n}: corrupted"
        assert torch.equal(result["head"], (tensor(n) * 2)[:3])


@pytest.mark.cuda(devices=2)
def test_cuda_echo_between_two_gpus_over_nccl():
    cfg = chain({"factory": f"{STAGES}:Echo", "gpu": [1]}, first="ToGpu", last="ToHost", gpus=([0], None, [0]))
    for n, result in enumerate(run(cfg, 24)):
        assert torch.equal(result["x"], tensor(n) * 2), f"request {n}: corrupted"


@pytest.mark.cuda(devices=2)
def test_tensor_parallel_stage_over_nccl_returns_its_received_tensor():
    cfg = chain({"factory": f"{STAGES}:TpEcho", "tp_size": 2, "gpu": [0, 1]}, first="ToGpu", last="ToHost",
                gpus=([0], None, [0]))
    for n, result in enumerate(run(cfg, 12)):
        assert torch.equal(result["x"], tensor(n) * 2)
        assert torch.equal(result["total"], tensor(n) * 4)

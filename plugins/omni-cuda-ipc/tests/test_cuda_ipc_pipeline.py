"""The cuda_ipc relay under the real runtime, on a GPU machine (skipped without CUDA): GPU stage
processes on one GPU exchange CUDA tensors with no copy, releases after each stage call."""

from __future__ import annotations

import asyncio

import pytest
import torch
from omni_core import Pipeline
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.cuda(reason="cuda_ipc moves CUDA tensors"),
    pytest.mark.usefixtures("no_leaks"),
]

STAGES = "cuda_ipc_test_stages"


def config(gpus: tuple[int, int, int] = (0, 0, 0)) -> dict:
    return {
        "name": "cuda-ipc-chain",
        "relay": {"backend": "cuda_ipc", "options": {"credits": 4, "timeout": 10}},
        "stages": [
            {"name": "up", "factory": f"{STAGES}:ToGpu", "gpu": [gpus[0]], "next": "scale"},
            {"name": "scale", "factory": f"{STAGES}:Scale", "gpu": [gpus[1]], "next": "down"},
            {"name": "down", "factory": f"{STAGES}:ToHost", "gpu": [gpus[2]], "terminal": True},
        ],
    }


def tensor(n: int) -> torch.Tensor:
    return torch.arange(1 + (n * 7919) % 300_000, dtype=torch.float32) + n


def run_chain(cfg: dict, count: int) -> list:
    async def go():
        async with Pipeline(cfg) as p:
            return await asyncio.gather(*(p.submit({"n": n, "x": tensor(n)}) for n in range(count)))

    return asyncio.run(asyncio.wait_for(go(), 150))


def test_cuda_tensors_cross_gpu_stage_processes_on_one_gpu():
    for n, result in enumerate(run_chain(config(), 16)):
        assert result["n"] == n and result["was_cuda"]
        assert torch.equal(result["x"], tensor(n) * 6)


@pytest.mark.cuda(devices=2, reason="a peer copy needs two CUDA devices")
def test_cuda_tensors_cross_stage_processes_on_two_gpus():
    for n, result in enumerate(run_chain(config((0, 1, 0)), 8)):
        assert torch.equal(result["x"], tensor(n) * 6)

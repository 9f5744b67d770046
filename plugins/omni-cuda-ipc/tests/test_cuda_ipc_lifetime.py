"""Received CUDA tensors that leave a stage (returned as they are, or sliced) are copied out of
relay memory before it is released: the sender's allocation on one GPU (which torch will not let
this process share again) or the pooled receive buffer across GPUs (reused by the next transfer).
GPU tests: skipped without CUDA, failed under OMNI_REQUIRE_CUDA=1."""

from __future__ import annotations

import asyncio

import pytest
import torch
from omni_core import Pipeline
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(180), pytest.mark.cuda, pytest.mark.usefixtures("no_leaks")]

STAGES = "cuda_ipc_test_stages"


def config(gpus=(0, 0, 0)) -> dict:
    return {
        "name": "cuda-ipc-echo",
        "relay": {"backend": "cuda_ipc", "options": {"credits": 2, "timeout": 10}},
        "stages": [
            {"name": "up", "factory": f"{STAGES}:ToGpu", "gpu": [gpus[0]], "next": "echo"},
            {"name": "echo", "factory": f"{STAGES}:Echo", "gpu": [gpus[1]], "next": "down"},
            {"name": "down", "factory": f"{STAGES}:ToHost", "gpu": [gpus[2]], "terminal": True},
        ],
    }


def tensor(n: int) -> torch.Tensor:
    return torch.arange(1000 + n, dtype=torch.float32) + n


def run(cfg: dict, payloads: list[dict]) -> list[dict]:
    async def go():
        async with Pipeline(cfg) as p:
            return await asyncio.gather(*(p.submit(x) for x in payloads))

    return asyncio.run(asyncio.wait_for(go(), 150))


def check(results: list[dict]) -> None:
    for n, result in enumerate(results):
        assert result["n"] == n and result["was_cuda"]
        assert torch.equal(result["x"], tensor(n) * 2), f"request {n}: corrupted"


def test_an_echo_stage_between_two_gpu_stages_returns_its_received_tensors():
    check(run(config(), [{"n": n, "x": tensor(n)} for n in range(24)]))


def test_a_payload_mixing_cpu_and_cuda_tensors_travels_through_the_split_path_and_back():
    cfg = config()
    cfg["stages"][2]["factory"] = f"{STAGES}:Echo"  # the terminal returns both kinds as received
    results = run(cfg, [{"n": n, "x": tensor(n), "h": torch.full((5,), float(n))} for n in range(16)])
    for n, result in enumerate(results):
        assert torch.equal(result["x"].cpu(), tensor(n) * 2)
        assert torch.equal(result["head"].cpu(), (tensor(n) * 2)[:3])
        assert result["h"].device.type == "cpu" and torch.equal(result["h"], torch.full((5,), float(n)))


@pytest.mark.cuda(devices=2)
def test_an_echo_across_two_gpus_is_not_corrupted_by_the_reused_receive_buffers():
    check(run(config((0, 1, 0)), [{"n": n, "x": tensor(n)} for n in range(24)]))

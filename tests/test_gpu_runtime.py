"""The core runtime on a GPU (skipped without CUDA, failed under OMNI_REQUIRE_CUDA=1): placement on
``cuda:0`` from the devices torch reports, CUDA tensors through the ``shm`` relay (copied to the
host), and received tensors echoed out of a stage while the pool is reused."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_core import ConfigError, Pipeline
from omni_core.config.load import load_config
from omni_core.plan import build_plan
from omni_core.plugins import get_registry
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(180), pytest.mark.cuda(reason="GPU placement and CUDA tensors")]

STAGES = "gpu_test_stages"


def run(cfg: dict, payloads: list[dict]) -> list:
    async def go():
        async with Pipeline(cfg) as p:
            return await asyncio.gather(*(p.submit(x) for x in payloads))

    return asyncio.run(asyncio.wait_for(go(), 150))


def chain(*stages: dict, name: str = "gpu", **fields) -> dict:
    out = []
    for i, stage in enumerate(stages):
        stage = dict(stage)
        if i + 1 < len(stages):
            stage["next"] = stages[i + 1]["name"]
        else:
            stage["terminal"] = True
        out.append(stage)
    return {"name": name, "stages": out, **fields}


def test_the_plan_sees_the_gpus_torch_sees_with_their_memory():
    cfg = load_config(chain({"name": "model", "factory": f"{STAGES}:WhereAmI", "memory": 0.25},
                            placement={"strategy": "pack"}), registry=get_registry())
    plan = build_plan(cfg, get_registry())
    assert len(plan.devices) == torch.cuda.device_count()
    assert plan.devices[0].memory == torch.cuda.get_device_properties(0).total_memory
    [proc] = plan.processes
    assert proc.gpu == 0 and proc.device == "cuda:0"


def test_a_stage_larger_than_the_gpu_is_a_config_error_naming_it():
    too_big = torch.cuda.get_device_properties(0).total_memory * 2
    with pytest.raises(ConfigError, match="GPU 0 is over its memory budget"):  # while loading or planning
        cfg = load_config(chain({"name": "model", "factory": f"{STAGES}:WhereAmI", "memory": too_big, "gpu": 0}),
                          registry=get_registry())
        build_plan(cfg, get_registry())


@pytest.mark.usefixtures("no_leaks")
def test_a_stage_packed_on_gpu_0_runs_on_cuda_0_and_a_cpu_stage_sees_no_gpu():
    [gpu] = run(chain({"name": "gpu", "factory": f"{STAGES}:WhereAmI", "memory": 0.1}, placement={"strategy": "pack"}), [{}])
    assert gpu["device"] == "cuda:0" and gpu["gpu_id"] == 0
    assert gpu["visible"] == 1 and gpu["current"] == 0, "a GPU stage sees exactly its own GPU"
    assert gpu["cuda_visible_devices"] == "0" and gpu["omni_gpu_id"] == "0"
    assert gpu["x_device"] == "cuda:0" and torch.equal(gpu["x"], torch.arange(4.0) * 2)
    assert gpu["name"] == torch.cuda.get_device_name(0)
    [cpu] = run(chain({"name": "cpu", "factory": f"{STAGES}:WhereAmI"}), [{}])
    assert cpu["device"] == "cpu" and cpu["visible"] == 0 and cpu["cuda_visible_devices"] == ""


def shm_chain(last: str = "Report", slots: int = 2) -> dict:
    return chain(
        {"name": "up", "factory": f"{STAGES}:ToDevice", "gpu": 0},
        {"name": "mid", "factory": f"{STAGES}:Echo", "gpu": 0},
        {"name": "down", "factory": f"{STAGES}:{last}"},
        name="gpu-shm",
        relay={"backend": "shm", "options": {"slots": slots, "slot_bytes": 1 << 20, "inline_below": 0}},
    )


def tensor(n: int) -> torch.Tensor:
    return torch.arange(1000 + n, dtype=torch.float32) + n


@pytest.mark.usefixtures("no_leaks")
def test_cuda_tensors_cross_the_shm_relay_as_host_tensors_and_are_not_corrupted():
    """A GPU stage returns CUDA tensors; shm copies them to the host; the echo stage in the middle
    returns the received (pooled) tensors and a slice of them while two slots serve 24 requests."""
    payloads = [{"n": n, "x": tensor(n), "h": torch.full((5,), float(n))} for n in range(24)]
    results = run(shm_chain(), payloads)
    for n, result in enumerate(results):
        assert result["n"] == n
        assert result["x_device"] == "cpu" and result["h_device"] == "cpu", "shm delivers host tensors"
        assert torch.equal(result["x"], tensor(n) * 2), f"request {n}: corrupted"
        assert torch.equal(result["h"], torch.full((5,), float(n)))


@pytest.mark.usefixtures("no_leaks")
def test_an_echo_of_cuda_tensors_received_through_shm_reaches_the_caller_intact():
    results = run(shm_chain(last="Echo"), [{"n": n, "x": tensor(n)} for n in range(24)])
    for n, result in enumerate(results):
        assert torch.equal(result["x"], tensor(n) * 2), f"request {n}: corrupted"
        assert torch.equal(result["head"], (tensor(n) * 2)[:3])

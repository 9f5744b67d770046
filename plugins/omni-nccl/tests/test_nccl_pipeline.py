"""The nccl relay under the real runtime: stage processes, control messages, releases after each
stage call, and aborts that drop messages whose transfers are already on a link."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from omni_core import Pipeline
from omni_core.errors import RequestAborted
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture
from omni_core.testing.waiting import until

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leaks")]

STAGES = "nccl_test_stages"


def config(**options) -> dict:
    return {
        "name": "nccl-chain",
        "relay": {"backend": "nccl", "options": {"credits": 4, "timeout": 10, **options}},
        "stages": [
            {"name": "double", "factory": f"{STAGES}:Scale", "args": {"factor": 2.0}, "next": "triple"},
            {"name": "triple", "factory": f"{STAGES}:Scale", "args": {"factor": 3.0}, "next": "total"},
            {"name": "total", "factory": f"{STAGES}:Total", "terminal": True},
        ],
    }


def arun(coro, timeout: float = 150):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def tensor(n: int) -> torch.Tensor:
    return torch.arange(1 + (n * 7919) % 300_000, dtype=torch.float32) + n


def test_tensors_cross_a_chain_of_stage_processes_over_nccl_links():
    async def go():
        async with Pipeline(config()) as p:
            return await asyncio.gather(*(p.submit({"n": n, "x": tensor(n)}) for n in range(24)))

    for n, result in enumerate(arun(go())):
        assert result["n"] == n
        assert torch.equal(result["x"], tensor(n) * 6)


def test_aborted_requests_whose_messages_are_dropped_never_desynchronise_the_links(tmp_path):
    """While "triple" blocks its event loop, transfers of three requests reach its link and the
    requests are aborted: "triple" then drops their data messages without a get. Its link thread
    has taken the transfers off the link anyway and discards them once "double" cleans the
    requests up; every later transfer still arrives as itself. "triple" holds its loop until the
    test releases it (after the aborts); "double" marks each victim it ran."""
    cfg = config()
    cfg["stages"][1]["factory"] = f"{STAGES}:Hold"

    async def go():
        async with Pipeline(cfg) as p:
            for round_ in range(4):
                release, ran = tmp_path / f"release{round_}", tmp_path / f"ran{round_}"
                blocker = asyncio.ensure_future(
                    p.submit({"n": 100 + round_, "x": tensor(100 + round_), "release": str(release)}))
                await until(lambda r=release: os.path.exists(f"{r}.held"), "triple to block its loop")
                ids = [f"v{round_}.{n}" for n in range(3)]
                victims = [asyncio.ensure_future(p.submit({"n": n, "x": tensor(n), "marker": str(ran)}, request_id=i))
                           for n, i in enumerate(ids)]
                await until(lambda r=ran, ids=ids: all(os.path.exists(f"{r}.{i}") for i in ids),
                            "double to run the victims")
                for i in ids:
                    await p.abort(i)
                release.touch()
                result = await blocker
                assert torch.equal(result["x"], tensor(100 + round_) * 6)
                for victim in victims:
                    with pytest.raises(RequestAborted):
                        await victim
            return await asyncio.gather(*(p.submit({"n": n, "x": tensor(n)}) for n in range(30, 40)))

    after = arun(go())
    assert [r["n"] for r in after] == list(range(30, 40))
    assert all(torch.equal(r["x"], tensor(r["n"]) * 6) for r in after)

"""Tensor-parallel stages on CPU: one process per rank in a gloo group; only the leader talks to
the rest of the pipeline; a follower's death fails requests like any process death."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch
from runtime_helpers import arun, no_leaks, pipeline, stage, until  # noqa: F401

from omni_core import Pipeline, ProcessDied

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_stage_all_reduce_result_reaches_the_caller(tp_size):
    cfg = pipeline(
        stage("pre", "Echo", next="tp"),
        stage("tp", "AllReduce", tp_size=tp_size, next="post"),
        stage("post", "Echo", terminal=True),
    )
    expected = sum(range(1, tp_size + 1))

    async def body():
        async with Pipeline(cfg) as p:
            names = sorted(p.pids())
            assert names == sorted(["pre", "post", *[f"tp.{r}" for r in range(tp_size)]])
            results = await asyncio.gather(*(p.submit({"x": torch.full((3,), float(i))}) for i in range(4)))
            return results, p.pids()

    results, pids = arun(body())
    for i, result in enumerate(results):
        assert torch.equal(result["x"], torch.full((3,), float(i * expected)))
        assert result["ranks"] == tp_size
        assert result["pid"] == pids["tp.0"]


def test_only_the_leaders_chunks_reach_the_caller():
    cfg = pipeline(stage("tp", "AllReduce", tp_size=2, terminal=True))

    async def body():
        async with Pipeline(cfg) as p:
            return [e async for e in p.stream({"x": torch.ones(2), "emit": True})]

    events = arun(body())
    assert [e.data for e in events[:-1]] == [{"rank_sum": 6.0}]


def test_follower_death_fails_requests_with_process_died(tmp_path):
    cfg = pipeline(stage("tp", "AllReduce", tp_size=2, terminal=True))
    marker = tmp_path / "reached"

    async def body():
        async with Pipeline(cfg) as p:
            await p.submit({"x": torch.ones(1)})
            task = asyncio.ensure_future(p.submit({"x": torch.ones(1), "leader_sleep": 30, "marker": str(marker)}))
            # the follower now waits in all_reduce for the leader (its loop is blocked there: a
            # file it writes first says so, not its state report)
            await until(lambda: os.path.exists(f"{marker}.1"), "the follower to reach all_reduce")
            os.kill(p.pids()["tp.1"], signal.SIGKILL)
            with pytest.raises(ProcessDied) as info:
                await asyncio.wait_for(task, 60)
            return info.value

    error = arun(body())
    assert error.process == "tp.1" and error.signal == "SIGKILL"

"""Launcher ``ray`` on a real local multi-node cluster: a pipeline across three nodes, its
relays, supervision and a clean stop."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch
from conftest import live_actors, wait_until

from omni_core import Pipeline, ProcessDied
from omni_core.testing.leaks import runtime_dirs

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("no_actor_leaks")]


def stage(name, factory, **fields):
    return {"name": name, "factory": f"ray_test_stages:{factory}", **fields}


def three_nodes(**fields):
    return {
        "name": "three-nodes",
        "launcher": "ray",
        "stages": [
            stage("a", "Where", next="b", launch={"resources": {"head": 1}}),
            stage("b", "Where", next="c", launch={"resources": {"node_a": 1}}),
            stage("c", "Where", terminal=True, launch={"resources": {"node_b": 1}}),
        ],
        **fields,
    }


def arun(coro, timeout=240):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_a_tensor_crosses_three_nodes_under_100_concurrent_requests(cluster):
    dirs_before = runtime_dirs()

    async def body():
        async with Pipeline(three_nodes()) as p:
            edges = {(e.src, e.dst): e for e in p.plan.edges}
            assert edges["a", "b"].crosses_nodes and edges["b", "c"].crosses_nodes
            assert edges["a", "b"].relay == edges["b", "c"].relay == "inline"
            assert p.addresses["a"].startswith("ipc://")  # the coordinator's node
            assert p.addresses["b"].startswith("tcp://") and p.addresses["c"].startswith("tcp://")
            inputs = [torch.arange(1000, dtype=torch.float32) + i for i in range(100)]
            results = await asyncio.gather(*(p.submit({"x": x}) for x in inputs))
            for x, result in zip(inputs, results, strict=True):
                assert torch.equal(result["x"], x * 8)
                assert [h[1] for h in result["hops"]] == [cluster.node_ids[n] for n in ("head", "node_a", "node_b")]
            pids = {h[0]: h[2] for h in results[0]["hops"]}
            assert pids == {n: p.pids()[n] for n in "abc"}

    arun(body())
    assert not live_actors()
    assert runtime_dirs() == dirs_before


def test_same_node_processes_keep_ipc_and_shm(cluster):
    cfg = three_nodes()
    for s in cfg["stages"]:
        s["launch"] = {"resources": {"node_a": 1}}

    async def body():
        async with Pipeline(cfg) as p:
            assert {e.relay for e in p.plan.edges} == {"shm"}
            assert not any(e.crosses_nodes for e in p.plan.edges)
            result = await p.submit({"x": torch.ones(4096)})
            assert torch.equal(result["x"], torch.full((4096,), 8.0))
            boots = p.boots
            assert all(a.startswith("ipc://") for a in boots["b"].addresses.values() if a != boots["b"].addresses[""])
            assert boots["b"].addresses[""].startswith("tcp://")  # the coordinator is on the head

    arun(body())


def test_a_killed_actor_fails_its_requests_with_process_died_naming_node_and_reason(cluster):
    cfg = three_nodes()
    cfg["stages"][1]["factory"] = "ray_test_stages:Sleep"

    async def body():
        async with Pipeline(cfg) as p:
            tasks = [asyncio.ensure_future(p.submit({"x": torch.ones(8), "sleep": 60})) for _ in range(3)]
            await wait_until_async(lambda: len(p.requests) == 3)
            os.kill(p.pids()["b"], signal.SIGKILL)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(r, ProcessDied) for r in results), results
            assert results[0].process == "b"
            assert "on node" in str(results[0]) and "Ray:" in str(results[0])

    arun(body())


async def wait_until_async(predicate, timeout=30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.02)

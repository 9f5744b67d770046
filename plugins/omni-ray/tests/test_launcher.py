"""Launcher ``ray`` on a real local multi-node cluster: a pipeline across three nodes, its
relays, supervision and a clean stop."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from omni_core import Pipeline, ProcessDied
from omni_core.testing.leaks import runtime_dirs
from omni_core.testing.waiting import until

from omni_ray.testing import live_actors, wait_until

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
            boots = p.launch.boots
            assert all(a.startswith("ipc://") for a in boots["b"].addresses.values() if a != boots["b"].addresses[""])
            assert boots["b"].addresses[""].startswith("tcp://")  # the coordinator is on the head

    arun(body())


def test_a_killed_actor_fails_its_requests_with_process_died_naming_node_and_reason(cluster):
    cfg = three_nodes()
    cfg["stages"][1]["factory"] = "ray_test_stages:Sleep"

    async def body():
        async with Pipeline(cfg) as p:
            tasks = [asyncio.ensure_future(p.submit({"x": torch.ones(8), "sleep": 60})) for _ in range(3)]
            await until(lambda: len(p.requests) == 3, "the 3 requests in flight")
            os.kill(p.pids()["b"], signal.SIGKILL)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(r, ProcessDied) for r in results), results
            assert results[0].process == "b"
            assert "on node" in str(results[0]) and "Ray:" in str(results[0])

    arun(body())


def test_restart_on_failure_recreates_the_actor_on_its_node_at_its_addresses(cluster):
    cfg = three_nodes(restart={"policy": "on-failure", "max_restarts": 1})

    async def body():
        async with Pipeline(cfg) as p:
            first = await p.submit({"x": torch.ones(4)})
            old_pid, address = p.pids()["b"], p.addresses["b"]
            os.kill(old_pid, signal.SIGKILL)
            await until(lambda: p.pids()["b"] != old_pid and p.running, "b restarted", 60)
            await until(lambda: p.handles["b"].exitcode is None and not p.runner.readiness.starting("b"), "b ready", 60)
            second = await p.submit({"x": torch.ones(4)})
            assert torch.equal(first["x"], second["x"])
            hop = {h[0]: h for h in second["hops"]}["b"]
            assert hop[1] == cluster.node_ids["node_a"] and hop[2] == p.pids()["b"] != old_pid
            assert p.addresses["b"] == address

    arun(body())


def test_a_tp_stage_runs_its_ranks_in_one_placement_group_over_gloo(cluster):
    cfg = {
        "name": "tp",
        "launcher": "ray",
        "stages": [stage("t", "TpSum", tp_size=2, terminal=True, launch={"resources": {"node_b": 1}})],
    }

    async def body():
        async with Pipeline(cfg) as p:
            slots = p.launch.launcher.slots
            assert slots["t.0"].pg is not None and slots["t.0"].pg is slots["t.1"].pg
            assert slots["t.0"].where["node"] == slots["t.1"].where["node"] == cluster.node_ids["node_b"]
            result = await p.submit({"x": torch.ones(3)})
            assert result["world"] == 2 and torch.equal(result["x"], torch.full((3,), 3.0))

    arun(body())


def test_unschedulable_stage_fails_start_naming_it_and_leaves_no_actor(cluster):
    from omni_core.errors import StartupError

    cfg = three_nodes(limits={"startup_timeout": 15})
    cfg["stages"][2]["launch"] = {"resources": {"node_c": 1}}

    async def body():
        with pytest.raises(StartupError, match="'c'.*node_c"):
            async with Pipeline(cfg):
                pass

    arun(body())


# -- CurveZMQ ------------------------------------------------------------------------------------------


def _attacker(address, curve_server_key=None):
    """A PUSH socket to ``address`` without the run's client keys (a random key pair when the
    server key is known, else plain tcp), and a monitor of its handshake."""
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if curve_server_key is not None:
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve_server_key, public, secret
    monitor = sock.get_monitor_socket()
    sock.connect(address)
    return sock, monitor


def _handshake_refused(monitor, timeout=20.0):
    """Wait for the peer to refuse the handshake (a monitor event, not a sleep)."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    failed = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
              zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_DISCONNECTED}
    poller = zmq.Poller()
    poller.register(monitor, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if poller.poll(100):
            event = recv_monitor_message(monitor)["event"]
            assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, "a client without the run's key completed the handshake"
            if event in failed:
                return event
    raise AssertionError("no handshake failure seen")


def test_forged_shutdown_and_result_without_the_run_key_change_nothing(cluster):
    from omni_core.relay.payload import pack
    from omni_core.runtime import wire

    cfg = three_nodes()
    cfg["stages"][2]["factory"] = "ray_test_stages:Sleep"

    async def body():
        async with Pipeline(cfg) as p:
            keys = p.launch.launcher.keys
            task = asyncio.ensure_future(p.submit({"x": torch.ones(2), "sleep": 3}))
            await until(lambda: p.requests, "the request in flight")
            rid, request_id = next((r.rid, r.request_id) for r in p.requests.values())
            skeleton, _ = pack({"x": "forged"})
            forged = [(p.addresses["b"], wire.Shutdown()), (p.addresses["c"], wire.Shutdown()),
                      (p.addresses["b"], wire.Data("work", 99, "evil", "b", "", skeleton)),
                      (p.launch.launcher.tcp[""], wire.Data("result", rid, request_id, "c", "c", skeleton))]
            for server_key in (None, keys.server_public):  # plain tcp; Curve with a key of its own
                for address, msg in forged:
                    sock, monitor = _attacker(address, server_key)
                    sock.send(wire.encode(msg), zmq_noblock())
                    await asyncio.to_thread(_handshake_refused, monitor)
                    sock.disable_monitor()
                    monitor.close(0)
                    sock.close(0)
            real = await task
            assert real["x"].tolist() == [4.0, 4.0]  # a and b doubled it; nothing forged got in
            assert all(h.exitcode is None for h in p.handles.values())
            again = await p.submit({"x": torch.ones(2), "sleep": 0})
            assert again["x"].tolist() == [4.0, 4.0]

            # The same forged result sent with the run's keys and sealed with its control-plane
            # secret does change the answer: the check above can fail.
            task = asyncio.ensure_future(p.submit({"x": torch.ones(2), "sleep": 30}))
            await until(lambda: p.requests, "the request in flight")
            rid, request_id = next((r.rid, r.request_id) for r in p.requests.values())
            import zmq

            insider = zmq.Context.instance().socket(zmq.PUSH)
            insider.setsockopt(zmq.LINGER, 0)
            insider.curve_serverkey, insider.curve_publickey, insider.curve_secretkey = (
                keys.server_public, keys.client_public, keys.client_secret)
            insider.connect(p.launch.launcher.tcp[""])
            insider.send(wire.seal(p.launch.secret, wire.encode(wire.Data("result", rid, request_id, "c", "c", skeleton))))
            assert (await task) == {"x": "forged"}
            insider.close(0)

    arun(body())


def zmq_noblock():
    import zmq

    return zmq.NOBLOCK


DRIVER = """
import asyncio, json, sys
import ray, torch
from omni_core import Pipeline

cfg = json.loads(sys.argv[2])
ray.init(address=sys.argv[1], namespace="omni-test", log_to_driver=False)

async def main():
    p = Pipeline(cfg)
    await p.start()
    await p.submit({"x": torch.ones(1 << 16)})  # shm between b and c on node_a holds a segment
    print(json.dumps({"pids": p.pids(), "run_id": p.launch.run_id}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_the_drivers_sigkill_leaves_no_actor_and_the_next_start_sweeps_its_segments(cluster, tmp_path):
    import json
    import subprocess
    import sys

    from omni_core.testing.leaks import alive, shm_segments

    cfg = three_nodes()
    cfg["stages"][2]["launch"] = {"resources": {"node_a": 1}}  # b -> c on one node: shm
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), cluster.address, json.dumps(cfg)],
                            stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert shm_segments(proc.pid), "the run should hold an shm segment"
    finally:
        proc.kill()
        proc.wait()
    wait_until(lambda: not live_actors(), 60, "Ray to end the dead driver's actors")
    wait_until(lambda: not any(alive(pid) for pid in info["pids"].values()), 30, "the actors' processes to exit")

    async def body():  # the next run on the node sweeps what the killed run left
        cfg2 = three_nodes()
        cfg2["stages"][2]["launch"] = {"resources": {"node_a": 1}}
        async with Pipeline(cfg2) as p:
            await p.submit({"x": torch.ones(4)})

    arun(body())
    assert not shm_segments(proc.pid)

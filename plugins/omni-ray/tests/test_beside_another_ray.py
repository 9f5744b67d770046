"""The tests' cluster and the launcher beside another, unrelated Ray instance on the machine.

A second Ray instance (``ray.cluster_utils.Cluster``, its own head and dashboard, one live actor)
runs in a subprocess and records its address where Ray's auto-detection looks first (the
bootstrap file under ``RAY_TMPDIR``, here a private folder that stands in for the machine's
``/tmp/ray``): ``ray.init()``, ``ray.util.state.list_actors()`` and ``ray status`` without an
address would all find it. What must see only its own cluster: :func:`omni_ray.testing.live_actors`
and the leak checks built on it, and launcher ``ray`` with ``address: null`` (a local Ray of its
own). The other instance is stopped at the end; every process it or a driver started is found by a
marker in its environment and must be gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest
import torch
from omni_core import Pipeline
from omni_core.testing.leaks import processes_with_env

from omni_ray.testing import live_actors, wait_until

HERE = os.path.dirname(os.path.abspath(__file__))  # where ray_test_stages lives

pytestmark = pytest.mark.timeout(300)

OTHER = """
import json, sys
import ray
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={
    "num_cpus": 1, "object_store_memory": 75 * 2**20, "include_dashboard": True,
    "dashboard_port": None, "dashboard_agent_listen_port": None})
ray.init(address=cluster.address, namespace="unrelated", log_to_driver=False)

@ray.remote(num_cpus=0)
class Bystander:
    def ping(self):
        return 1

bystander = Bystander.options(name="bystander").remote()
ray.get(bystander.ping.remote())
print(json.dumps({"address": cluster.address, "actor": bystander._actor_id.hex()}), flush=True)
sys.stdin.read()  # until the test closes stdin
ray.kill(bystander)
ray.shutdown()
cluster.shutdown()
print("STOPPED", flush=True)
"""

DRIVER = """
import asyncio, json
import ray, torch
from omni_core import Pipeline

cfg = {"name": "alone", "launcher": {"name": "ray", "options": {"address": None}},
       "stages": [{"name": "a", "factory": "ray_test_stages:Where", "terminal": True}]}

async def main():
    async with Pipeline(cfg) as p:
        result = await p.submit({"x": torch.ones(4)})
        print(json.dumps({"gcs": ray.get_runtime_context().gcs_address,
                          "node": ray.get_runtime_context().get_node_id(),
                          "ran_on": result["hops"][0][1], "x": result["x"].tolist()}), flush=True)
    print(json.dumps({"after_stop": ray.is_initialized()}), flush=True)

asyncio.run(main())
"""


def marked_pids(marker: str) -> set[int]:
    """Processes whose environment carries ``marker`` (set to 1)."""
    return processes_with_env(f"{marker}=1")


def kill_marked(marker: str) -> None:
    for pid in marked_pids(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)


@pytest.fixture(scope="module")
def other_ray(cluster):
    """The unrelated instance, started after this module's cluster (so it is the one Ray's
    auto-detection finds); ``RAY_TMPDIR`` points this process's auto-detection at it while the
    module's tests run. Yields ``{"address", "actor", "env"}``."""
    marker = f"OMNI_OTHER_RAY_{uuid.uuid4().hex}"
    tmp = tempfile.mkdtemp(prefix="omo", dir="/tmp")  # short: Ray's unix sockets live under it
    # HOME: ~/.ray private (a Ray started by ray.init() writes an auth token there)
    env = {**os.environ, marker: "1", "RAY_TMPDIR": tmp, "HOME": tmp, "RAY_USAGE_STATS_ENABLED": "0"}
    for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, "-c", OTHER], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    saved = os.environ.get("RAY_TMPDIR")
    try:
        line = proc.stdout.readline()
        assert line, "the other Ray instance did not start"
        info = {**json.loads(line), "env": env, "marker": marker}
        os.environ["RAY_TMPDIR"] = tmp
        yield info
    finally:
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            rest = proc.stdout.read()
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            rest = ""
        try:
            wait_until(lambda: not marked_pids(marker), 60, "the other instance's processes to exit")
        finally:
            kill_marked(marker)
            shutil.rmtree(tmp, ignore_errors=True)
        assert "STOPPED" in rest and proc.returncode == 0, rest


def test_the_other_instance_is_what_auto_detection_finds(other_ray):
    """The premise: without an address Ray's state API answers for the other instance."""
    from ray.util.state import list_actors

    ids = [a.actor_id for a in list_actors(filters=[("state", "!=", "DEAD")], raise_on_missing_output=False)]
    assert other_ray["actor"] in ids


def test_live_actors_and_the_leak_check_see_only_their_own_cluster(other_ray, no_actor_leaks):
    import ray

    assert other_ray["address"] != ray.get_runtime_context().gcs_address
    assert not live_actors(), "the other instance's actor is not this cluster's"

    @ray.remote(num_cpus=0)
    class Mine:
        def ping(self):
            return 1

    mine = Mine.remote()
    ray.get(mine.ping.remote())
    assert [a.actor_id for a in live_actors()] == [mine._actor_id.hex()]
    ray.kill(mine)
    wait_until(lambda: not live_actors(), 30, "this test's actor to be dead")


def test_a_pipeline_on_the_cluster_passes_its_leak_check(other_ray, cluster, no_actor_leaks):
    import asyncio

    async def body():
        cfg = {"name": "one", "launcher": "ray",
               "stages": [{"name": "a", "factory": "ray_test_stages:Where", "terminal": True,
                           "launch": {"resources": {"node_a": 1}}}]}
        async with Pipeline(cfg) as p:
            result = await p.submit({"x": torch.ones(4)})
        assert result["hops"][0][1] == cluster.node_ids["node_a"]

    asyncio.run(asyncio.wait_for(body(), 240))


def test_launcher_with_address_null_starts_a_local_ray_of_its_own(other_ray):
    """A driver that is not connected: ``address: null`` must not join the auto-detected instance."""
    marker = f"OMNI_DRIVER_{uuid.uuid4().hex}"
    env = {**other_ray["env"], marker: "1", "PYTHONPATH": os.pathsep.join(
        p for p in (HERE, os.environ.get("PYTHONPATH")) if p)}
    env.pop(other_ray["marker"], None)
    try:
        done = subprocess.run([sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True,
                              timeout=240)
        assert done.returncode == 0, done.stderr[-4000:]
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        run, stop = lines
        assert run["gcs"] != other_ray["address"] and run["ran_on"] == run["node"]
        assert run["x"] == [2.0] * 4
        assert stop == {"after_stop": False}, "the launcher shuts down the Ray it started"
        wait_until(lambda: not marked_pids(marker), 60, "the driver's local Ray to exit")
    finally:
        kill_marked(marker)

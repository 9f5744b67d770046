"""A real local multi-node Ray cluster for the tests of one module: a head and two worker nodes
on this machine, each its own raylet, with custom resources ``head``, ``node_a`` and ``node_b``.
Small on purpose (CI has two cores): logical CPUs only, 100 MiB object stores, no dashboard."""

from __future__ import annotations

import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
NODES = ("node_a", "node_b")
STORE = 100 * 2**20


def live_actors() -> list[dict]:
    """Actors the cluster's GCS does not report dead (the state API needs the dashboard)."""
    import ray

    return [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]


def wait_until(predicate, timeout: float = 30.0, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value (returned) or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster():
    """Head + node_a + node_b; the test process is the driver (connected to the head)."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    sys.path.insert(0, HERE)
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"head": 4}, "object_store_memory": STORE, "include_dashboard": False})
    nodes = {}
    try:
        for name in NODES:
            node = c.add_node(num_cpus=4, resources={name: 4}, object_store_memory=STORE)
            nodes[name] = node
        c.wait_for_nodes()
        ray.init(address=c.address, namespace="omni-test", log_to_driver=False)
        ids = {}
        for n in ray.nodes():
            for name in ("head", *NODES):
                if name in n["Resources"]:
                    ids[name] = n["NodeID"]
        c.node_ids = ids
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture
def no_actor_leaks(cluster):
    """No actor of the test outlives it (the GCS reports every one dead), no /dev/shm segment."""
    from omni_core.testing.leaks import runtime_dirs, shm_segments

    dirs = runtime_dirs()
    yield
    wait_until(lambda: not live_actors(), 30, "every actor to be dead")
    wait_until(lambda: not shm_segments(os.getpid()), 10, "no /dev/shm segment of this test's runs")
    assert runtime_dirs() == dirs

"""A real local multi-node Ray cluster for the tests of one module: a head and two worker nodes
on this machine, each its own raylet, with custom resources ``head``, ``node_a`` and ``node_b``
(:func:`omni_ray.testing.local_cluster`). Small on purpose (CI has two cores): logical CPUs only,
100 MiB object stores; the dashboard runs because the public state API
(``ray.util.state.list_actors``) is served by it."""

from __future__ import annotations

import os
import sys

import pytest

from omni_ray.testing import NODES, live_actors, local_cluster, wait_until

HERE = os.path.dirname(os.path.abspath(__file__))

__all__ = ["NODES", "live_actors", "wait_until"]


@pytest.fixture(scope="module")
def cluster():
    """Head + node_a + node_b; the test process is the driver (connected to the head)."""
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, HERE)
    with local_cluster(NODES) as c:
        yield c


@pytest.fixture
def no_actor_leaks(cluster):
    """No actor of the test outlives it (the state API reports none alive), no /dev/shm segment."""
    from omni_core.testing.leaks import runtime_dirs, shm_segments

    dirs = runtime_dirs()
    yield
    wait_until(lambda: not live_actors(), 30, "every actor to be dead")
    wait_until(lambda: not shm_segments(os.getpid()), 10, "no /dev/shm segment of this test's runs")
    assert runtime_dirs() == dirs

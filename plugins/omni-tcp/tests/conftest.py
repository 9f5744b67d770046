"""A real local multi-node Ray cluster for the cross-node tests of one module (a head and two
worker nodes on this machine, custom resources ``head``, ``node_a`` and ``node_b``), and the
leak check of every test that starts actors or pipelines on it."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def cluster():
    """Head + node_a + node_b; the test process is the driver. The stages of
    ``tcp_test_stages`` are importable on every node (this directory on PYTHONPATH)."""
    pytest.importorskip("omni_ray", reason="the cross-node tests need omni-ray (pip install ./plugins/omni-ray)")
    from omni_ray.testing import NODES, local_cluster

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, HERE)
    with local_cluster(NODES) as c:
        yield c


@pytest.fixture
def no_leaks(cluster):
    """No actor of the test outlives it, no /dev/shm segment of its runs, no runtime dir."""
    from omni_core.testing.leaks import runtime_dirs, shm_segments
    from omni_ray.testing import live_actors, wait_until

    dirs = runtime_dirs()
    yield
    wait_until(lambda: not live_actors(), 30, "every actor to be dead")
    wait_until(lambda: not shm_segments(os.getpid()), 10, "no /dev/shm segment of this test's runs")
    assert runtime_dirs() == dirs

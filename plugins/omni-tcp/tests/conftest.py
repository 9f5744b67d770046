"""A real local multi-node Ray cluster for the cross-node tests of one module: a head and two
worker nodes on this machine, custom resources ``head``, ``node_a`` and ``node_b``."""

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

"""The relay conformance kit's cross-node mode on the local cluster, for every installed relay
that declares the ``cluster`` scope at registration (``inline`` at least): the sender in this
process on the head, the receiver on node_a, the ``doomed`` peer on node_b, handles and frames
over the control plane's tcp transport (CurveZMQ)."""

from __future__ import annotations

import pytest
from omni_core.plugins import get_registry

from omni_ray.testing import RayCrossNodeConformance

pytestmark = pytest.mark.usefixtures("cluster")


def cross_node_relays() -> list[str]:
    """Registered relays whose declared capabilities include the ``cluster`` scope."""
    return sorted(
        e.name
        for e in get_registry().entries("relay")
        if e.capabilities is not None and "cluster" in e.capabilities.scopes
    )


class AcrossNodes(RayCrossNodeConformance):
    """Checks of the mode itself, on top of the kit's."""

    def test_the_ends_are_on_three_nodes_and_the_wire_is_tcp(self, cluster, receiver, transport):
        ids = cluster.node_ids
        assert self.this_node() == ids["head"]
        assert receiver.node == ids["node_a"] != ids["head"]
        assert transport.addresses[id(receiver)].startswith("tcp://")
        assert transport.wire.address.startswith("tcp://")


for _name in cross_node_relays():
    _cls = type(
        f"Test{_name.title().replace('_', '')}AcrossNodes", (AcrossNodes,), {"relay_name": _name}
    )
    globals()[_cls.__name__] = _cls


def test_inline_declares_the_cluster_scope_and_shm_does_not():
    names = cross_node_relays()
    assert "inline" in names and "shm" not in names


def test_the_mode_skips_a_relay_without_the_cluster_scope(tmp_path):
    class Shm(RayCrossNodeConformance):
        relay_name = "shm"

    with pytest.raises(pytest.skip.Exception, match="does not declare the 'cluster' scope"):
        Shm.start_peer("receiver", "kitx", str(tmp_path), None)

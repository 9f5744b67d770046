"""The relay conformance kit's cross-node mode on the local cluster, for every installed relay
that declares the ``cluster`` scope at registration (``inline`` at least): the sender in this
process on the head, the receiver on node_a, the ``doomed`` peer on node_b, handles and frames
over the control plane's tcp transport (CurveZMQ)."""

from __future__ import annotations

import time

import pytest
import torch
from omni_core.plugins import get_registry
from omni_core.relay.inline import inline_transfer
from omni_core.testing import peer as cmd
from omni_core.testing.relay_conformance import assert_arrived

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

    def test_a_client_without_the_run_key_gets_nothing_through_the_wire(
        self, sender, receiver, transport
    ):
        """Frames forged by a client with a Curve key pair of its own never reach the receiver:
        the handshake is refused, and the genuine transfer sent later with the same token is
        the one that arrives."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        address = transport.addresses[id(receiver)]
        token = transport.token()
        forged = torch.full((4,), 666.0)
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            transport.keys.server_public,
            public,
            secret,
        )
        monitor = sock.get_monitor_socket()
        try:
            sock.connect(address)
            handle, frames = inline_transfer([forged]).handle, inline_transfer([forged]).frames
            sock.send_multipart([token, handle, *frames], zmq.NOBLOCK)
            refused = {
                zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                zmq.EVENT_DISCONNECTED,
            }
            deadline = time.monotonic() + 30
            while True:
                assert time.monotonic() < deadline, "no handshake failure seen"
                if monitor.poll(100):
                    event = recv_monitor_message(monitor)["event"]
                    assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, (
                        "a client without the run's key got in"
                    )
                    if event in refused:
                        break
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
        genuine = torch.arange(4, dtype=torch.float32)

        async def go():
            transfer = await sender.put(1, [genuine], "receiver")
            transport.wire.send(address, token, transfer.handle, list(transfer.frames))
            return await receiver.acall(cmd.get_from_wire, token)

        assert_arrived([genuine], self.run(go()))


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

"""``tcp`` across the nodes of a real local Ray cluster (one cluster for the module): the relay
conformance kit's cross-node mode (sender on the head, receiver on node_a, the killed peer on
node_b, handles over the CurveZMQ control plane), forged peers on the data connection, a dead
sender, and 100 concurrent requests carrying 1 MiB each through a pipeline whose edges cross
nodes."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import pytest
import torch
from omni_core.relay.base import RelayError, Transfer
from omni_core.testing.peer import PeerError
from omni_core.testing.relay_conformance import RECEIVER, SENDER, assert_arrived, sample

from omni_tcp import wire
from omni_tcp.relay import Handle, decode_handle, encode_handle

pytest.importorskip("omni_ray", reason="the cross-node tests need omni-ray (pip install ./plugins/omni-ray)")

import test_tcp_conformance  # noqa: E402  (a module, not its class: pytest would collect the class here too)
from omni_ray.testing import RayCrossNodeConformance, wait_until  # noqa: E402

pytestmark = pytest.mark.usefixtures("cluster")


class TestTcpAcrossNodes(RayCrossNodeConformance):
    relay_name = "tcp"
    relay_options = {"credits": 4, "timeout": 1.0, "inline_below": 0, "chunk_bytes": 1 << 16}
    credits = 4
    unread_release_gap = test_tcp_conformance.TestTcpRelay.unread_release_gap
    put_timeout = 1.0
    large_bytes = 8 << 20

    def test_the_receiver_is_on_another_node_and_the_data_goes_over_tcp(self, cluster, sender, receiver):
        assert receiver.node == cluster.node_ids["node_a"] != self.this_node()
        transfer = self.run(sender.put(1, [sample(torch.float32, (1000,))], RECEIVER))
        assert not transfer.frames, "the tensor rode in the control message, not the data connection"
        self.run(receiver.transport.deliver(receiver, transfer))
        assert decode_handle(transfer.handle).address.rsplit(":", 1)[0] == self.this_ip()

    def test_a_peer_without_the_secret_reads_nothing_and_injects_nothing(self, sender, receiver):
        """Clients that connect to the sender's listener without the secret (one claiming to be
        the receiver, one speaking another protocol) are refused before any data; the same
        handshake with the secret passes, so the check can fail; genuine transfers still arrive."""
        genuine = [sample(torch.float32, (50_000,))]
        transfer = self.run(sender.put(1, genuine, RECEIVER))
        assert_arrived(genuine, self.run(receiver.transport.deliver(receiver, transfer)))
        h = decode_handle(transfer.handle)
        host, port = h.address.rsplit(":", 1)

        with socket.create_connection((host, int(port)), timeout=10) as sock, \
                pytest.raises(wire.LinkError, match="did not prove"):
            wire.client_handshake(sock, os.urandom(32), RECEIVER)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"\x01" * 200)
            assert _drain(sock) == b"", "the listener answered a client that is not an omni tcp relay"
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            assert wire.client_handshake(sock, h.secret, "intruder") is None  # the control: it can pass

        again = [sample(torch.int64, (70_000,), seed=3)]
        transfer = self.run(sender.put(2, again, RECEIVER))
        assert_arrived(again, self.run(receiver.transport.deliver(receiver, transfer)))

    def test_a_listener_without_the_secret_cannot_pose_as_the_sender(self, sender, receiver):
        """A handle naming a listener that does not hold the secret (another process bound it):
        the receiver's get fails to authenticate and reads nothing from it."""
        listener = socket.create_server((self.this_ip(), 0))
        served: list[str] = []

        def impostor():
            conn, _ = listener.accept()
            with conn:
                try:
                    wire.server_handshake(conn, os.urandom(32), False)
                    served.append("handshake passed")
                except (OSError, wire.LinkError) as exc:
                    served.append(str(exc))

        thread = threading.Thread(target=impostor)
        thread.start()
        try:
            address = f"{self.this_ip()}:{listener.getsockname()[1]}"
            forged = encode_handle(Handle(address, os.urandom(32), SENDER, 1, 1, 64, ["float32"], [[16]]))
            with pytest.raises(PeerError, match="failed to authenticate"):
                self.run(receiver.transport.deliver(receiver, Transfer(forged)))
        finally:
            thread.join(30)
            listener.close()
        assert served and served[0] != "handshake passed"

    def test_a_dead_senders_transfer_fails_its_get_at_once(self, run_id, runtime_dir, transport, sender):
        doomed = self.start_peer("doomed", run_id, runtime_dir, transport)
        try:
            handle, frames = self.run(transport.fetch(doomed, 1, SENDER, 5, [[300_000]]))
            doomed.kill()
            wait_until(lambda: not _running(doomed.pid), 60, "the killed peer's process to end")  # one machine
            # refused (its port closed), or, should another process have taken the port since,
            # not authenticated: either way a clear error naming the sender, at once
            with pytest.raises(RelayError, match="sender 'doomed' at .*(cannot reach|failed to authenticate)|"
                               "cannot reach sender 'doomed'"):
                self.run(sender.get(handle, frames), timeout=30)
        finally:
            doomed.stop()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _drain(sock: socket.socket) -> bytes:
    """What the peer sends until it closes the connection."""
    out = b""
    try:
        while chunk := sock.recv(4096):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def test_100_concurrent_requests_of_1_mib_cross_two_nodes_intact(cluster):
    """``auto`` takes ``tcp`` for both edges (head → node_a → node_b); 100 requests of a 1 MiB
    tensor in flight at once all come back intact (more than the 16 credits per target: puts
    wait for releases, none stalls), no relay table keeps an entry, and nothing outlives the
    pipeline (actor, /dev/shm segment, runtime dir)."""
    from omni_core import Pipeline
    from omni_core.testing.leaks import runtime_dirs, shm_segments
    from omni_ray.testing import live_actors

    def stage(name, node, **fields):
        return {"name": name, "factory": "tcp_test_stages:Scale", "launch": {"resources": {node: 1}}, **fields}

    cfg = {
        "name": "tcp-across-nodes",
        "launcher": "ray",
        "stages": [stage("a", "head", next="b"), stage("b", "node_a", next="c"), stage("c", "node_b", terminal=True)],
    }

    async def body():
        async with Pipeline(cfg) as p:
            assert [(e.relay, e.crosses_nodes) for e in p.plan.edges] == [("tcp", True), ("tcp", True)]
            inputs = [torch.arange(1 << 18, dtype=torch.float32) + i for i in range(100)]
            results = await asyncio.gather(*(p.submit({"x": x}) for x in inputs))
            for x, result in zip(inputs, results, strict=True):
                assert torch.equal(result["x"], x * 8)
                assert result["nodes"] == [cluster.node_ids[n] for n in ("head", "node_a", "node_b")]
            deadline = asyncio.get_running_loop().time() + 30
            while True:
                state = await p.debug_state()
                held = {proc: {k: v for k, v in tables.items() if v} for proc, tables in state.items()}
                if not any(held.values()):
                    break
                assert asyncio.get_running_loop().time() < deadline, f"entries left: {held}"
                await asyncio.sleep(0.1)

    dirs = runtime_dirs()
    asyncio.run(asyncio.wait_for(body(), 240))
    wait_until(lambda: not live_actors(), 30, "every actor to be dead")
    assert not shm_segments(os.getpid()) and runtime_dirs() == dirs

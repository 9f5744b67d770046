"""``tcp`` on one machine, beyond the conformance kit: what ``auto`` and ``omni plan`` make of it,
chunks taking turns, forged handles, and a client without the secret."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
import torch
from omni_core.config import load_config
from omni_core.plan import build_plan
from omni_core.plan.topology import place_on_nodes
from omni_core.plugins import get_registry
from omni_core.relay.base import InvalidHandle, RelayContext
from omni_core.testing.peer import RelayPeer, tensor_record
from omni_core.testing.relay_conformance import remove_leaked

from omni_tcp import wire
from omni_tcp.plugin import CAPABILITIES
from omni_tcp.relay import Handle, TcpRelay, decode_handle, encode_handle

OPTIONS = {"credits": 4, "timeout": 5.0, "inline_below": 0, "host": "127.0.0.1", "chunk_bytes": 1 << 16}


def two_stages(**fields):
    return load_config({
        "name": "two",
        "stages": [{"name": "a", "factory": "m:A", "next": "b"}, {"name": "b", "factory": "m:B", "terminal": True}],
        **fields,
    }, validate=False)


def test_auto_takes_tcp_across_nodes_and_shm_within_one():
    registry = get_registry()
    assert registry.get("relay", "tcp").capabilities == CAPABILITIES == TcpRelay.capabilities
    plan = build_plan(two_stages(), registry=registry)
    across = place_on_nodes(plan, {"": "x", "a": "x", "b": "y"}, registry)
    assert [(e.relay, e.crosses_nodes, e.ms_per_mib) for e in across.edges] == [("tcp", True, CAPABILITIES.ms_per_mib)]
    within = place_on_nodes(plan, {"": "x", "a": "x", "b": "x"}, registry)
    assert [(e.relay, e.crosses_nodes) for e in within.edges] == [("shm", False)]
    forced = place_on_nodes(build_plan(two_stages(relay="inline"), registry=registry),
                            {"": "x", "a": "x", "b": "y"}, registry)
    assert [e.relay for e in forced.edges] == ["inline"]


@pytest.fixture(scope="module")
def receiver(tmp_path_factory):
    """A receiver in a spawned process, for the whole module."""
    run_id = f"tcp{os.getpid()}"
    peer = RelayPeer.start(TcpRelay, RelayContext(run_id, "receiver", str(tmp_path_factory.mktemp("tcp")), OPTIONS))
    yield peer
    assert peer.stop() == 0
    assert remove_leaked(run_id) == []


@pytest.fixture
def pair(receiver, tmp_path):
    """A fresh sender here (the receiver has never connected to it) and the receiver."""
    sender = TcpRelay(RelayContext(f"tcp{os.getpid()}", "sender", str(tmp_path), OPTIONS))
    yield sender, receiver
    sender.close()


async def _get_and_peek(state, small: bytes, big: bytes):
    """Get ``small``; how many bytes of transfer ``big`` had arrived by then."""
    tensors = await state.relay.get(small)
    h = decode_handle(big)
    arrived = state.relay.open_links()["receiving"][h.address]["arriving"].get(h.ticket, -1)
    records = [tensor_record(t) for t in tensors]
    state.relay.release(small)
    return records, arrived


async def _get(state, handle: bytes):
    tensors = await state.relay.get(handle)
    records = [tensor_record(t) for t in tensors]
    state.relay.release(handle)
    return records


def test_a_small_transfer_overtakes_a_large_one_in_flight(pair):
    """Both put before the receiver connects: the writer sends one 64 KiB chunk of the 32 MiB
    transfer, then the small one whole, so the small one is complete while the large one still
    arrives; both arrive intact."""
    sender, receiver = pair
    big = torch.arange(8 << 20, dtype=torch.float32)
    small = torch.arange(1000, dtype=torch.int64)

    async def put_both():
        return await sender.put(1, [big], "receiver"), await sender.put(2, [small], "receiver")

    big_t, small_t = asyncio.run(put_both())
    records, arrived = receiver.call(_get_and_peek, bytes(small_t.handle), bytes(big_t.handle))
    assert records == [tensor_record(small)]
    assert 0 <= arrived < big.nbytes, f"the small transfer waited for all {arrived} bytes of the large one"
    assert receiver.call(_get, bytes(big_t.handle)) == [tensor_record(big)]


def test_forged_handles_are_refused_before_anything_is_opened(pair):
    sender, receiver = pair
    transfer = asyncio.run(sender.put(1, [torch.ones(1000)], "receiver"))
    h = decode_handle(transfer.handle)

    def forged(**changes):
        fields = {f: getattr(h, f) for f in h.__struct_fields__}
        return encode_handle(Handle(**{**fields, **changes}))

    relay = TcpRelay(RelayContext("x", "checker", "/nonexistent", OPTIONS))
    try:
        for bad, match in ((forged(size=1 << 40), "buffer"), (forged(ticket=0), "ticket"),
                           (forged(secret=b"short"), "ticket"), (forged(address="nowhere"), "host:port"),
                           (forged(dtypes=["object"]), "dtype"), (b"\x93garbage", "malformed"),
                           (forged(address="", ticket=0), "declares")):
            with pytest.raises(InvalidHandle, match=match):
                asyncio.run(relay.get(bad))
        assert relay.open_links()["receiving"] == {}, "a forged handle made the relay connect"
    finally:
        relay.close()
    assert receiver.call(_get, bytes(transfer.handle)) == [tensor_record(torch.ones(1000))]


def test_a_client_without_the_secret_is_refused_and_the_sender_goes_on(pair):
    sender, receiver = pair
    first = asyncio.run(sender.put(1, [torch.ones(5000)], "receiver"))
    h = decode_handle(first.handle)
    host, port = h.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock, \
            pytest.raises(wire.LinkError, match="did not prove"):
        wire.client_handshake(sock, os.urandom(32), "receiver")
    assert receiver.call(_get, bytes(first.handle)) == [tensor_record(torch.ones(5000))]


def test_the_cipher_refuses_tampered_replayed_and_reordered_messages():
    pytest.importorskip("cryptography")
    key = os.urandom(32)
    sender, receiver = wire.Cipher(key, b"s2c\x00", b"c2s\x00"), wire.Cipher(key, b"c2s\x00", b"s2c\x00")
    header = wire.HEADER.pack(wire.DATA, 7, 1, 0, 400, 400, 400)
    data = os.urandom(400)
    first = bytes(sender.seal(header, data))
    out = bytearray(400)
    receiver.open_into(header, first, memoryview(out))
    assert bytes(out) == data and first[:400] != data
    second = bytearray(sender.seal(header, data))
    second[5] ^= 1
    with pytest.raises(wire.LinkError, match="authentication tag"):
        receiver.open_into(header, bytes(second), memoryview(out))
    with pytest.raises(wire.LinkError):  # replayed: the receiver's count moved on
        receiver.open_into(header, first, memoryview(out))
    other = wire.HEADER.pack(wire.DATA, 8, 1, 0, 400, 400, 400)
    fresh = bytes(wire.Cipher(key, b"s2c\x00", b"c2s\x00").seal(header, data))
    wire.Cipher(key, b"c2s\x00", b"s2c\x00").open_into(header, fresh, memoryview(out))  # the control
    with pytest.raises(wire.LinkError):  # a header changed on the way
        wire.Cipher(key, b"c2s\x00", b"s2c\x00").open_into(other, fresh, memoryview(out))

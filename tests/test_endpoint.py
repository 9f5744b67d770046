"""The endpoint's receive path, in-process: what its owner's DataReceiver gets, in which order,
and that no message, bad or unlucky, leaves its request waiting."""

from __future__ import annotations

import asyncio

import pytest
import torch
from fake_endpoint import FakeEndpoint

from omni_core import load_config
from omni_core.plugins import get_registry
from omni_core.runtime import wire
from omni_core.testing.waiting import until

CONFIG = {"name": "ep", "stages": [{"name": "a", "factory": "omni_test_stages:Upper", "terminal": True}]}


class Receiver:
    """Records what the endpoint hands over; ``refuse`` / ``explode`` make it misbehave."""

    def __init__(self) -> None:
        self.delivered: list[tuple[int, object]] = []
        self.rejected: list[tuple[int, BaseException]] = []
        self.ended: set[int] = set()
        self.explode = False

    def accept(self, msg: wire.Data) -> bool:
        return msg.rid not in self.ended

    def wanted(self, rid: int) -> bool:
        return rid not in self.ended

    def deliver(self, msg: wire.Data, payload, inbound) -> None:
        if self.explode:
            raise RuntimeError("a bug in the owner")
        self.delivered.append((msg.rid, payload))

    def reject(self, msg: wire.Data, exc: BaseException) -> None:
        self.rejected.append((msg.rid, exc))


@pytest.fixture
def endpoint():
    ep = FakeEndpoint(load_config(CONFIG), get_registry())
    ep.open(addresses={"": "ipc://caller", "a": "ipc://a"})
    receiver = Receiver()
    ep.on_data(receiver)
    yield ep, receiver
    ep.close()


def run(coro):
    return asyncio.run(coro)


def test_payloads_and_tensors_reach_the_receiver_in_the_order_sent(endpoint):
    ep, receiver = endpoint

    async def main():
        for i in range(5):
            ep.receive_data("result", 1, "a", {"i": i, "t": torch.full((3,), float(i))} if i % 2 else {"i": i})
        await until(lambda: len(receiver.delivered) == 5, "the five payloads delivered")

    run(main())
    assert [p["i"] for _, p in receiver.delivered] == [0, 1, 2, 3, 4]
    assert torch.equal(receiver.delivered[3][1]["t"], torch.full((3,), 3.0))
    assert ep.state() == {"ordered": 0}


def test_a_message_whose_frames_do_not_add_up_fails_its_request_only(endpoint):
    ep, receiver = endpoint
    ep.receive(wire.Data("result", 7, "r7", "a", "a", b"\x80", "inline", b"", 2), [b"x"])
    ep.receive_data("result", 8, "a", {"ok": True})
    assert [rid for rid, _ in receiver.rejected] == [7]
    assert "announced 2 frames and carried 1" in str(receiver.rejected[0][1])
    assert receiver.delivered == [(8, {"ok": True})]


def test_a_payload_that_does_not_decode_and_a_forged_handle_are_rejected(endpoint):
    ep, receiver = endpoint
    ep.receive(wire.Data("result", 1, "r1", "a", "a", b"\xc1"))  # 0xc1: never valid msgpack
    ep.receive(wire.Data("result", 2, "r2", "a", "a", b"\x80", "inline", b"forged", 1), [b"xxxx"])
    assert [rid for rid, _ in receiver.rejected] == [1, 2]
    assert receiver.delivered == []


def test_a_receiver_that_raises_fails_the_request_instead_of_leaving_it_waiting(endpoint):
    ep, receiver = endpoint
    receiver.explode = True
    ep.receive_data("result", 3, "a", {"x": 1})
    ep.receive_data("result", 4, "a", {"t": torch.ones(2)})  # through the relay path
    assert [rid for rid, _ in receiver.rejected] == [3, 4]
    assert all(isinstance(exc, RuntimeError) for _, exc in receiver.rejected)
    receiver.explode = False
    ep.receive_data("result", 5, "a", {"x": 5})
    assert receiver.delivered == [(5, {"x": 5})]


def test_messages_of_a_request_the_receiver_no_longer_wants_are_dropped(endpoint):
    ep, receiver = endpoint
    receiver.ended.add(9)
    ep.receive_data("result", 9, "a", {"x": 1})
    ep.receive_data("result", 9, "a", {"t": torch.ones(2)})
    assert receiver.delivered == [] and receiver.rejected == []


def test_a_message_dropped_unread_releases_its_relay_slot_at_the_sender(endpoint):
    from omni_core.relay.base import RelayContext
    from omni_core.relay.shm import ShmRelay

    ep, receiver = endpoint
    sender = ShmRelay(RelayContext("test-run", "a", "/nonexistent", {"inline_below": 0, "slots": 2}))

    async def main():
        receiver.ended.add(9)
        for _ in range(2):  # both slots: dropped unread, each released at the sender
            transfer = await sender.put(9, [torch.ones(4)], "coordinator")
            ep.receive(wire.Data("result", 9, "r9", "a", "a", b"\x80", "shm", transfer.handle))
            assert sender.debug_state()["sent"] == 0
        split = wire.Data("result", 9, "r9", "a", "a", b"\x80", "+split", b"not a split handle")
        ep.receive(split)  # a handle that does not decode frees nothing and breaks nothing

    try:
        run(main())
        assert receiver.delivered == [] and receiver.rejected == []
    finally:
        sender.close()


def test_other_messages_go_to_the_handler_registered_for_their_type(endpoint):
    ep, _ = endpoint
    got = []
    ep.on(wire.Failed, got.append)
    failed = wire.Failed(1, "a", "ValueError", "bad", "tb")
    ep.receive(failed)
    ep.receive(wire.Bye("a"))  # nobody handles it: dropped with a warning, nothing raised
    assert got == [failed]
    with pytest.raises(TypeError, match="DataReceiver"):
        ep.on(wire.Data, got.append)

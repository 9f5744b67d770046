"""Several control messages posted to one peer in one loop turn (or one inbox drain) leave as
one zmq message (``wire.Batch``) and are handled one by one, in order, each with its own tensor
frames; a batch whose frames do not add up is dropped whole, and the inbox keeps serving."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from omni_core.runtime import wire
from omni_core.runtime.channel import Inbox, Outbox

pytestmark = pytest.mark.timeout(60)


def _data(rid: int, nframes: int) -> wire.Data:
    return wire.Data(
        "work", rid, f"r{rid}", "s", "", b"\x80", "inline" if nframes else "", b"h", nframes
    )


@pytest.fixture
def peer(tmp_path):
    """``(address, a PULL socket bound there, an Outbox)``, closed after the test."""
    address = f"ipc://{tmp_path}/peer"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(address)
    outbox = Outbox(ctx)
    try:
        yield address, pull, outbox
    finally:
        outbox.close(linger_ms=0)
        pull.close(linger=0)
        ctx.term()


def test_messages_posted_during_a_hold_leave_as_one_zmq_message_in_order(peer):
    address, pull, outbox = peer

    async def body():
        outbox.hold()
        outbox.post(address, _data(1, 2), [b"a" * 5, b"b" * 7])
        outbox.post(address, wire.Credit(1, "s", "t", 3))
        outbox.post(address, _data(2, 1), [b"c"])
        outbox.post(address, wire.StreamEnd(2, "s", "t"))
        assert not pull.poll(50), "nothing leaves while held"
        outbox.release()

    asyncio.run(body())
    assert pull.poll(5000)
    frames = pull.recv_multipart()
    assert not pull.poll(100), "one zmq message for the four"
    batch = wire.decode(frames[0])
    assert isinstance(batch, wire.Batch)
    assert [type(m).__name__ for m in batch.messages] == ["Data", "Credit", "Data", "StreamEnd"]
    assert frames[1:] == [b"a" * 5, b"b" * 7, b"c"]


def test_a_long_hold_lets_its_first_messages_go_early_in_batches_that_grow(peer):
    """A drain of 100 messages must not leave as one convoy: the next process would idle until
    the last one is made. They leave after the 16th, 32nd, 64th and 96th post and at the release,
    in order, with their frames."""
    address, pull, outbox = peer

    async def body():
        outbox.hold()
        for rid in range(16):
            outbox.post(address, _data(rid, 1), [rid.to_bytes(2, "little")])
        assert pull.poll(5000), "the first 16 leave while the hold goes on"
        for rid in range(16, 100):
            outbox.post(address, _data(rid, 1), [rid.to_bytes(2, "little")])
        outbox.release()

    asyncio.run(body())
    sizes, rids, frames = [], [], []
    while sum(sizes) < 100 and pull.poll(5000):
        parts = pull.recv_multipart()
        batch = wire.decode(parts[0])
        sizes.append(len(batch.messages))
        rids += [m.rid for m in batch.messages]
        frames += [int.from_bytes(f, "little") for f in parts[1:]]
    assert sizes == [16, 16, 32, 32, 4]
    assert rids == frames == list(range(100))


def test_an_inbox_hands_a_batch_out_message_by_message_and_drops_a_malformed_one(tmp_path):
    address = f"ipc://{tmp_path}/inbox"
    ctx = zmq.Context()
    got: list = []

    async def body():
        inbox = Inbox(
            ctx, address, lambda msg, frames: got.append((msg, [bytes(f.buffer) for f in frames]))
        )
        inbox.start()
        push = ctx.socket(zmq.PUSH)
        push.connect(address)
        try:
            bad = wire.Batch([_data(9, 2), wire.Credit(9, "s", "t", 1)])
            push.send_multipart([wire.encode(bad), b"only one"])  # announces 2 frames, carries 1
            good = wire.Batch(
                [_data(1, 1), wire.Credit(1, "s", "t", 2), _data(2, 2), wire.Forget(2)]
            )
            push.send_multipart([wire.encode(good), b"x", b"y", b"z"])
            push.send(wire.encode(wire.Forget(3)))  # a message on its own still works
            deadline = asyncio.get_running_loop().time() + 10
            while len(got) < 5:
                assert asyncio.get_running_loop().time() < deadline, got
                await asyncio.sleep(0.01)
        finally:
            push.close(linger=0)
            inbox.close()

    try:
        asyncio.run(body())
    finally:
        ctx.term()
    assert [(type(m).__name__, m.rid, frames) for m, frames in got] == [
        ("Data", 1, [b"x"]),
        ("Credit", 1, []),
        ("Data", 2, [b"y", b"z"]),
        ("Forget", 2, []),
        ("Forget", 3, []),
    ]

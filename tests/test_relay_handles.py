"""Forged and corrupted handles fed straight to ``get``: each is refused with ``InvalidHandle``
(a relay error) before anything it names is opened, mapped or allocated, and the relay goes on."""

from __future__ import annotations

import asyncio
import os
import resource
import uuid

import msgspec
import pytest
import torch

from omni_core.errors import OmniError
from omni_core.relay import InvalidHandle, RelayError
from omni_core.relay.base import RelayContext
from omni_core.relay.inline import InlineRelay, Meta, encode_meta, inline_transfer
from omni_core.relay.shm import Handle, ShmRelay, decode_handle, encode_handle
from omni_core.testing.relay_conformance import shm_entries

pytestmark = pytest.mark.timeout(60)

OPTIONS = {"slot_bytes": 1 << 16, "slots": 4, "timeout": 1.0, "inline_below": 0}  # small puts through the pool
GIANT = [[1 << 27]]  # float32: 512 MiB


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_invalid_handle_is_a_relay_error_of_the_project():
    assert issubclass(InvalidHandle, RelayError) and issubclass(RelayError, OmniError)


@pytest.fixture
def run_id():
    run_id = f"hdltest{uuid.uuid4().hex[:8]}"
    yield run_id
    leftovers = shm_entries(run_id)
    for name in leftovers:
        os.unlink(f"/dev/shm/{name}")
    assert leftovers == []


@pytest.fixture
def pair(run_id, tmp_path):
    """A sender and a receiver shm relay of one run, and one real transfer between them."""
    sender = ShmRelay(RelayContext(run_id, "a", str(tmp_path), OPTIONS))
    receiver = ShmRelay(RelayContext(run_id, "b", str(tmp_path), OPTIONS))
    transfer = run(sender.put(7, [torch.arange(16, dtype=torch.float32)], "b"))
    yield sender, receiver, decode_handle(transfer.handle)
    receiver.close()
    sender.close()


def forged(h: Handle, **changes) -> bytes:
    return encode_handle(msgspec.structs.replace(h, **changes))


def refused(relay, handle: bytes, frames=(), match: str | None = None) -> InvalidHandle:
    with pytest.raises(InvalidHandle, match=match) as info:
        run(relay.get(handle, frames))
    return info.value


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- shm --------------------------------------------------------------------------------------------

def test_shm_refuses_a_segment_name_with_a_path_and_touches_no_file(pair, tmp_path):
    _, receiver, h = pair
    victim = tmp_path / "x"
    victim.write_bytes(b"\0" * 8192)
    before = victim.read_bytes()
    traversal = os.path.relpath(victim, "/dev/shm")
    assert traversal.startswith("..")
    for name in (traversal, f"omni-{h.segment.split('-')[1]}-p1-/../../{traversal}", "..", "/etc/passwd"):
        refused(receiver, forged(h, segment=name), match="not one of this run's")
    assert victim.read_bytes() == before
    assert receiver.open_links()["receiving"] == {}


def test_shm_refuses_a_segment_of_another_run(pair):
    _, receiver, h = pair
    other = h.segment.replace("hdltest", "zzztest", 1)
    refused(receiver, forged(h, segment=other), match="not one of this run's")


def test_shm_refuses_sizes_beyond_the_segment_without_allocating(pair):
    _, receiver, h = pair
    before = peak_rss_mib()
    refused(receiver, forged(h, shapes=GIANT), match="exceeds")
    refused(receiver, forged(h, segment="", shapes=GIANT), match="no buffer")
    refused(receiver, forged(h, offsets=[1 << 40]), match="exceeds")
    refused(receiver, forged(h, offsets=[-64]), match="offset")
    refused(receiver, forged(h, offsets=[2]), match="offset")  # not whole float32 elements
    refused(receiver, forged(h, slot=99), match="slot")
    refused(receiver, forged(h, slot=-1), match="slot")
    refused(receiver, forged(h, base=1 << 20), match="span")
    assert peak_rss_mib() - before < 256, "a forged handle made the receiver allocate"


def test_shm_refuses_bad_dtypes_shapes_and_counts(pair):
    _, receiver, h = pair
    refused(receiver, forged(h, dtypes=["object"]), match="dtype")
    refused(receiver, forged(h, shapes=[[-4]]), match="shape")
    refused(receiver, forged(h, shapes=[[1] * 1000]), match="shape")
    refused(receiver, forged(h, dtypes=["float32", "float32"]), match="shapes")
    refused(receiver, forged(h, offsets=[0, 64]), match="offsets")
    refused(receiver, b"\x93\x01\x02", match="malformed")
    refused(receiver, b"not msgpack at all \xff", match="malformed")


def test_shm_goes_on_after_forged_handles(pair):
    sender, receiver, h = pair
    refused(receiver, forged(h, segment="../../x"))
    refused(receiver, forged(h, shapes=GIANT))
    got = run(receiver.get(encode_handle(h)))
    assert torch.equal(got[0], torch.arange(16, dtype=torch.float32))
    receiver.release(encode_handle(h))
    receiver.release(forged(h, segment="../../x"))  # release of a forged handle: nothing happens
    receiver.release(b"garbage")


# -- inline -----------------------------------------------------------------------------------------

def test_inline_refuses_frames_that_do_not_match_the_declared_tensors():
    relay = InlineRelay(RelayContext("r", "b", "/tmp"))
    transfer = inline_transfer([torch.ones(4), torch.zeros(2, dtype=torch.int64)])
    handle, frames = transfer.handle, list(transfer.frames)
    assert [t.tolist() for t in run(relay.get(handle, frames))] == [[1.0] * 4, [0, 0]]
    refused(relay, handle, frames[:1], match="frames")
    refused(relay, handle, [frames[0], b"\0" * 8], match="frame 1")
    refused(relay, handle, [frames[0] + b"\0" * 4, frames[1]], match="frame 0")
    before = peak_rss_mib()
    refused(relay, encode_meta(Meta(["float32"], GIANT)), [b""], match="frame 0")
    assert peak_rss_mib() - before < 256
    refused(relay, encode_meta(Meta(["float32"], [[-1]])), [b""], match="shape")
    refused(relay, encode_meta(Meta(["nope"], [[1]])), [b"\0"], match="dtype")
    refused(relay, b"\xc1", [], match="malformed")


def test_inline_does_not_own_what_it_returns():
    relay = InlineRelay(RelayContext("r", "b", "/tmp"))
    transfer = inline_transfer([torch.ones(4)])
    (t,) = run(relay.get(transfer.handle, list(transfer.frames)))
    assert not relay.owns(t)


def test_shm_debug_state_counts_what_is_held_until_released(pair):
    sender, receiver, h = pair
    assert sender.debug_state() == {"received": 0, "sent": 1}
    run(receiver.get(encode_handle(h)))
    assert receiver.debug_state() == {"received": 1, "sent": 0}
    receiver.release(encode_handle(h))
    assert receiver.debug_state() == {"received": 0, "sent": 0}
    assert sender.debug_state() == {"received": 0, "sent": 0}

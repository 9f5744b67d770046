"""The shm relay: the conformance kit, plus what is particular to shared-memory pools."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import pytest
import torch

from omni_core.relay.base import InvalidHandle, RelayContext, RelayTimeout
from omni_core.relay.shm import ShmRelay, ShmRelayError, decode_handle
from omni_core.relay.shm_segment import MAGIC, parse_name, pid_namespace
from omni_core.testing.peer import PeerState, RelayPeer, put_seeded
from omni_core.testing.relay_conformance import RelayConformance, sample, shm_entries
from omni_core.testing.waiting import until

# inline_below 0: every transfer through the pool, so small puts exercise slots and credits
OPTIONS = {"slot_bytes": 1 << 20, "slots": 4, "timeout": 1.0, "inline_below": 0}

pytestmark = pytest.mark.timeout(120)


class TestShmRelay(RelayConformance):
    relay_name = "shm"
    relay_options = OPTIONS
    credits = 4
    put_timeout = 1.0
    large_bytes = 8 << 20  # twice the pool: the one-off segment path


class TestShmRelayWithSmallTransfersInline(RelayConformance):
    """The kit again with the default ``inline_below``: small puts travel as frames (no credit,
    so the kit's credit tests skip), large ones through the pool and one-off segments."""

    relay_name = "shm"
    relay_options = {"slot_bytes": 1 << 20, "slots": 4, "timeout": 1.0}
    put_timeout = 1.0
    large_bytes = 8 << 20


@pytest.fixture
def run_id():
    run = f"shmtest{uuid.uuid4().hex[:8]}"
    yield run
    leftovers = shm_entries(run)
    for name in leftovers:
        os.unlink(f"/dev/shm/{name}")
    assert leftovers == [], "segments left in /dev/shm"


@pytest.fixture
def make(run_id, tmp_path):
    """``make(process, **options)``: a relay of this run, closed after the test."""
    relays = []

    def build(process: str, **options) -> ShmRelay:
        relays.append(ShmRelay(RelayContext(run_id, process, str(tmp_path), {**OPTIONS, **options})))
        return relays[-1]

    yield build
    for relay in relays:
        relay.close()


def waiting_puts(sender: ShmRelay, target: str = "b") -> int:
    """How many puts of ``sender`` toward ``target`` wait for credits, as the relay says."""
    return sender.open_links()["sending"].get(target, {"waiting": 0})["waiting"]


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# -- commands for peers (run in the peer process) ---------------------------------------------

async def where_tensors_live(state: PeerState, handle: bytes) -> list[str]:
    """For each received tensor, the /dev/shm file its data lies in (per /proc/self/maps)."""
    tensors = await state.relay.get(handle, [])
    with open("/proc/self/maps") as maps:
        ranges = [line.split() for line in maps if "/dev/shm/" in line]
    places = []
    for t in tensors:
        places += [r[5] for r in ranges
                   if int(r[0].split("-")[0], 16) <= t.data_ptr() < int(r[0].split("-")[1], 16)]
    state.relay.release(handle)
    return places


# -- zero copy, reuse, names ------------------------------------------------------------------

def test_receiver_tensors_view_the_senders_pool_and_slots_are_reused(make, run_id, tmp_path):
    sender = make("stage_a")
    peer = RelayPeer.start("shm", RelayContext(run_id, "stage_b", str(tmp_path), OPTIONS))
    try:
        seen = set()
        for i in range(10):
            transfer = run(sender.put(i, [sample(torch.float32, (1000,), seed=i)], "stage_b"))
            handle = decode_handle(transfer.handle)
            seen.add((handle.segment, handle.slot))
            [path] = peer.call(where_tensors_live, transfer.handle)
            assert path == f"/dev/shm/{handle.segment}"
        assert len(seen) == 1, f"released slots were not reused: {seen}"
        assert len(shm_entries(run_id)) == 1
    finally:
        assert peer.stop() == 0


def test_segments_are_named_with_run_id_and_owner_pid(make, run_id):
    sender = make("a")
    assert shm_entries(run_id) == [], "the pool is created on the first put, not before"
    run(sender.put(1, [torch.ones(3)], "b"))
    run(sender.put(1, [torch.ones(3)], "c"))
    names = shm_entries(run_id)
    assert len(names) == 2, "one pool per target process"
    assert {parse_name(n) for n in names} == {(run_id, os.getpid())}


def test_put_copies_so_later_writes_to_the_source_do_not_travel(make):
    sender, receiver = make("a"), make("b")
    source = torch.arange(100, dtype=torch.float32)
    transfer = run(sender.put(1, [source], "b"))
    source.zero_()
    [got] = run(receiver.get(transfer.handle))
    assert torch.equal(got, torch.arange(100, dtype=torch.float32))


def test_tensors_stay_readable_after_both_relays_close(make):
    sender, receiver = make("a"), make("b")
    transfer = run(sender.put(1, [torch.arange(1000)], "b"))
    [got] = run(receiver.get(transfer.handle))
    receiver.close()
    sender.close()
    assert torch.equal(got, torch.arange(1000)), "the mapping must outlive close while viewed"


# -- spans, oversized transfers ---------------------------------------------------------------

def test_tensor_larger_than_a_slot_spans_consecutive_slots_of_the_pool(make, run_id):
    sender, receiver = make("a"), make("b")
    big = sample(torch.float32, ((3 << 20) // 4,))
    transfer = run(sender.put(1, [big], "b"))
    assert len(shm_entries(run_id)) == 1, "a span of the pool, not a new segment"
    [got] = run(receiver.get(transfer.handle))
    assert torch.equal(got, big)
    receiver.release(transfer.handle)

    async def whole_pool_waits_for_a_small_holder():
        small = await sender.put(2, [torch.ones(1)], "b")
        waiting = asyncio.ensure_future(sender.put(3, [sample(torch.uint8, (4 << 20,))], "b"))
        await until(lambda: waiting_puts(sender) == 1, "the whole-pool put waiting for credits")
        assert not waiting.done()
        receiver.release(small.handle)
        await asyncio.wait_for(waiting, 30)

    run(whole_pool_waits_for_a_small_holder())


def test_oversized_transfer_uses_a_one_off_segment_removed_after_release(make, run_id):
    sender, receiver = make("a"), make("b")
    big = sample(torch.float32, ((6 << 20) // 4,))
    transfer = run(sender.put(1, [big], "b"))
    assert [n for n in shm_entries(run_id) if ".big" in n], "no one-off segment"
    assert not [n for n in shm_entries(run_id) if ".pool" in n], "the pool is not needed for it"
    [got] = run(receiver.get(transfer.handle))
    assert torch.equal(got, big)

    async def second_waits_for_first():
        waiting = asyncio.ensure_future(sender.put(2, [big], "b"))
        await until(lambda: waiting_puts(sender) == 1, "the second oversized put waiting")
        assert not waiting.done(), "at most one oversized transfer in flight per target"
        receiver.release(transfer.handle)
        return await asyncio.wait_for(waiting, 30)

    second = run(second_waits_for_first())
    assert len([n for n in shm_entries(run_id) if ".big" in n]) == 1, "the first was not removed"
    receiver.release(second.handle)
    run(sender.put(3, [torch.ones(1)], "b"))
    assert sender.open_links()["sending"]["b"]["oneoff"] == [], "the released one-off is still held"
    assert not [n for n in shm_entries(run_id) if ".big" in n]


# -- back-pressure ----------------------------------------------------------------------------

def test_waiting_put_sleeps_instead_of_spinning(make):
    sender = make("a", timeout=1.5)

    async def wait_out():
        for i in range(OPTIONS["slots"]):
            await sender.put(i, [torch.ones(1)], "b")
        cpu, wall = time.process_time(), time.monotonic()
        with pytest.raises(RelayTimeout):
            await sender.put(9, [torch.ones(1)], "b")
        return time.process_time() - cpu, time.monotonic() - wall

    cpu, wall = run(wait_out())
    assert wall >= 1.4
    assert cpu < 0.3 * wall, f"waiting burnt {cpu:.2f} s of CPU in {wall:.2f} s"


def test_waiting_puts_get_credits_in_arrival_order(make):
    sender, receiver = make("a"), make("b")

    async def go():
        held = [await sender.put(i, [torch.ones(1)], "b") for i in range(OPTIONS["slots"])]
        done = []

        async def put(rid):
            await sender.put(rid, [torch.ones(1)], "b")
            done.append(rid)

        tasks = [asyncio.ensure_future(put(10 + i)) for i in range(3)]
        await until(lambda: waiting_puts(sender) == 3, "the three puts waiting for credits")
        for i, transfer in enumerate(held[:3]):
            receiver.release(transfer.handle)
            await until(lambda i=i: len(done) == i + 1, f"a put given the credit released {i + 1}.")
        await asyncio.gather(*tasks)
        return done

    assert run(go()) == [10, 11, 12]


def test_get_of_a_handle_whose_request_was_cleaned_up_is_a_clear_error(make):
    sender, receiver = make("a"), make("b")
    old = run(sender.put(1, [torch.ones(4)], "b"))
    sender.cleanup(1)
    new = run(sender.put(2, [torch.zeros(4)], "b"))
    assert decode_handle(new.handle).slot == decode_handle(old.handle).slot
    with pytest.raises(ShmRelayError, match="stale"):
        run(receiver.get(old.handle))
    [got] = run(receiver.get(new.handle))
    assert torch.equal(got, torch.zeros(4))


# -- crashes and sweep ------------------------------------------------------------------------

def test_sweep_removes_segments_of_a_sigkilled_owner_only(make, run_id, tmp_path):
    survivor = make("alive")
    run(survivor.put(1, [torch.ones(3)], "x"))
    peer = RelayPeer.start("shm", RelayContext(run_id, "doomed", str(tmp_path), OPTIONS))
    peer.call(put_seeded, 1, "x", 0, [[10]])
    doomed = [n for n in shm_entries(run_id) if parse_name(n)[1] == peer.pid]
    assert len(doomed) == 1
    peer.kill()
    assert not peer.process.is_alive()
    assert ShmRelay.sweep(f"other{run_id}") == []
    removed = ShmRelay.sweep(run_id)
    # A pipeline starting elsewhere on this machine may sweep all runs first: then it is gone anyway.
    assert set(removed) <= set(doomed)
    assert [parse_name(n)[1] for n in shm_entries(run_id)] == [os.getpid()]


def _fake_segment(run_id: str, pid: int, words: dict[int, int]) -> str:
    name = f"omni-{run_id}-p{pid}-fake"
    header = bytearray(4096)
    for index, value in words.items():
        header[index * 8 : index * 8 + 8] = value.to_bytes(8, "little")
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(header)
    return name


def test_sweep_leaves_segments_of_other_pid_namespaces_alone(run_id):
    dead_pid = 999_999_999
    ours = _fake_segment(run_id, dead_pid, {0: MAGIC, 10: pid_namespace()})
    foreign = _fake_segment(run_id, dead_pid + 1, {0: MAGIC, 10: pid_namespace() + 1})
    try:
        assert ShmRelay.sweep(run_id) == [ours]
        assert shm_entries(run_id) == [foreign]
    finally:
        os.unlink(f"/dev/shm/{foreign}")


def test_receiver_unmaps_pools_of_dead_senders(make, run_id, tmp_path):
    receiver, survivor = make("b"), make("a")
    peer = RelayPeer.start("shm", RelayContext(run_id, "doomed", str(tmp_path), OPTIONS))
    handle, _ = peer.call(put_seeded, 1, "b", 0, [[10]])
    run(receiver.get(handle))
    receiver.release(handle)
    doomed = decode_handle(handle).segment
    assert doomed in _mapped_files()
    peer.kill()
    assert not peer.process.is_alive()
    transfer = run(survivor.put(1, [torch.ones(2)], "b"))
    run(receiver.get(transfer.handle))  # mapping a new pool evicts the dead sender's
    assert doomed not in _mapped_files()
    ShmRelay.sweep(run_id)


def _mapped_files() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def test_sweep_ignores_files_that_are_not_segments(run_id):
    path = f"/dev/shm/omni-{run_id}-p999999999-foreign"
    with open(path, "wb") as f:
        f.write(b"not a segment header" * 4)
    try:
        assert ShmRelay.sweep(run_id) == []
    finally:
        os.unlink(path)


# -- options and environment ------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [("slots", 0), ("slot_bytes", "4MiB"), ("timeout", -1), ("slots", True)])
def test_invalid_options_name_the_option(make, key, value):
    with pytest.raises(ValueError, match=f"relay.options.{key}"):
        make("a", **{key: value})


def test_pool_that_does_not_fit_in_dev_shm_is_a_clear_error(make, run_id):
    sender = make("a", slot_bytes=1 << 50, slots=1)
    with pytest.raises(ShmRelayError, match="shm-size"):
        run(sender.put(1, [torch.ones(1)], "b"))
    assert shm_entries(run_id) == []
    run(make("c").put(1, [torch.ones(1)], "b"))  # the run goes on with a pool that fits


@pytest.mark.cuda
def test_cuda_tensors_are_copied_to_host(make):
    sender, receiver = make("a"), make("b")
    source = torch.arange(1000, device="cuda", dtype=torch.float32)
    [got] = run(receiver.get(run(sender.put(1, [source], "b")).handle))
    assert got.device.type == "cpu" and torch.equal(got, source.cpu())


# -- small transfers as frames ------------------------------------------------------------------

def test_small_transfers_travel_as_frames_without_a_slot_and_large_ones_use_the_pool(make, run_id):
    """Below ``inline_below`` a put returns frames and creates no segment; more small puts than
    there are credits never wait; at the threshold the pool is used again."""
    sender, receiver = make("a", inline_below=4096), make("b", inline_below=4096)

    async def go():
        small = torch.arange(1000, dtype=torch.float32)  # 4,000 bytes
        transfers = [await sender.put(rid, [small + rid, torch.tensor(rid)], "b") for rid in range(3 * OPTIONS["slots"])]
        assert all(t.frames for t in transfers) and shm_entries(run_id) == []
        for rid, t in enumerate(transfers):
            got = await receiver.get(t.handle, t.frames)
            assert torch.equal(got[0], small + rid) and got[1].item() == rid
            assert not receiver.owns(got[0])  # the receiver's own memory: nothing to copy out
            receiver.release(t.handle)
        assert receiver.debug_state() == {"received": 0, "sent": 0}
        big = await sender.put(99, [torch.ones(1024, dtype=torch.float32)], "b")  # 4,096 bytes: not below
        assert not big.frames and len(shm_entries(run_id)) == 1
        got = await receiver.get(big.handle, big.frames)
        assert receiver.owns(got[0]) and got[0].sum().item() == 1024
        receiver.release(big.handle)
        receiver.release(big.handle)  # twice: harmless

    run(go())


def test_a_small_transfer_s_frames_are_checked_against_its_handle(make):
    sender, receiver = make("a", inline_below=1 << 16), make("b", inline_below=1 << 16)

    async def go():
        t = await sender.put(1, [torch.zeros(16)], "b")
        with pytest.raises(InvalidHandle, match="frame 0 holds 8 bytes"):
            await receiver.get(t.handle, [b"\0" * 8])
        with pytest.raises(InvalidHandle):  # a pool handle cannot be passed off with frames
            pool = await make("c", inline_below=0).put(2, [torch.zeros(16)], "b")
            await receiver.get(pool.handle, [b"\0" * 64])

    run(go())


def test_inline_below_is_validated_with_its_path():
    from omni_core.config import collect_issues, structure
    from omni_core.plugins import load_plugins

    cfg = structure({"name": "p", "relay": {"backend": "shm", "options": {"inline_below": -1}},
                     "stages": [{"name": "a", "factory": "types:SimpleNamespace", "terminal": True}]})
    (issue,) = collect_issues(cfg, load_plugins(env={"OMNI_LOAD_PLUGINS": ""}).registry)
    assert str(issue).startswith("relay.options.inline_below: expected a non-negative integer, got -1")

"""What is particular to the nccl relay: links and sequence numbers, transfers whose get never
comes, dead and restarted receivers, dead senders, the event loop, files and options.

Every test here runs on CPU tensors (gloo); the CUDA tests at the end need two GPUs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
import traceback
import types
import uuid

import pytest
import torch
from omni_core.relay.base import RelayContext, RelayTimeout
from omni_core.testing import peer as cmd
from omni_core.testing.peer import PeerState, RelayPeer, tensor_record
from omni_core.testing.relay_conformance import sample, shm_entries
from omni_core.testing.waiting import holds_within

from omni_nccl.ledger import Ledger
from omni_nccl.relay import NcclRelay, NcclRelayError, decode_handle

pytestmark = pytest.mark.timeout(120)

OPTIONS = {"credits": 4, "timeout": 1.0, "link_timeout": 30.0}


@pytest.fixture
def run_id():
    return f"nccltest{uuid.uuid4().hex[:8]}"


@pytest.fixture
def runtime_dir(tmp_path):
    path = tmp_path / "runtime"
    path.mkdir(mode=0o700)
    return str(path)


@pytest.fixture
def make(run_id, runtime_dir):
    """``make.relay(process)`` in this process, ``make.peer(process)`` in a spawned one; all
    closed after the test, which then checks that no process, thread or link file is left."""
    relays, peers = [], []
    threads_before = set(threading.enumerate())

    def relay(process: str, **options) -> NcclRelay:
        relays.append(NcclRelay(RelayContext(run_id, process, runtime_dir, {**OPTIONS, **options})))
        return relays[-1]

    def peer(process: str, **options) -> RelayPeer:
        peers.append(RelayPeer.start(NcclRelay, RelayContext(run_id, process, runtime_dir, {**OPTIONS, **options})))
        return peers[-1]

    yield types.SimpleNamespace(relay=relay, peer=peer)
    for r in relays:
        r.close()
    for p in peers:
        p.stop()
        assert not p.process.is_alive(), f"peer {p.process.pid} is still running"
    extra = [t.name for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    assert not extra, f"threads left running: {extra}"
    assert os.listdir(runtime_dir) == [], "link files left in the runtime dir"
    assert shm_entries(run_id) == [], "/dev/shm entries left"


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def wire(transfer) -> tuple[bytes, list]:
    return bytes(transfer.handle), [bytearray(memoryview(f)) for f in transfer.frames]


def records(tensors):
    return [(*tensor_record(t), True) for t in tensors]


# -- commands for peers (run in the peer process) ---------------------------------------------

def link_state(state: PeerState) -> dict[str, tuple[int, int, str | None]]:
    """For each link this peer receives on: (next sequence number, parked transfers, error)."""
    return {name: (link["next"], link["parked"], link["error"])
            for name, link in state.relay.open_links()["receiving"].items()}


def held(sender) -> list[int]:
    """The requests holding credits of ``sender`` toward "b" (cpu)."""
    return link(sender)["held"]


def link(sender) -> dict:
    """What ``sender`` reports of its link to "b" (cpu); an empty one before it has any."""
    return sender.open_links()["sending"].get("b/cpu", {"held": [], "received": 0, "pending": []})


async def get_error(state: PeerState, handle: bytes) -> str:
    try:
        await state.relay.get(handle, [])
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# -- links and sequence numbers ---------------------------------------------------------------

def test_each_target_gets_a_link_numbering_its_transfers_and_gets_in_any_order_match(make):
    sender, b, c = make.relay("a", credits=8), make.peer("b"), make.peer("c")
    sent = [[sample(torch.float32, (10 + i,), seed=i), torch.full((2,), i)] for i in range(5)]
    handles = [run(sender.put(i, tensors, "b")).handle for i, tensors in enumerate(sent)]
    decoded = [decode_handle(h) for h in handles]
    assert [h.seq for h in decoded] == [1, 2, 3, 4, 5]
    assert len({h.link for h in decoded}) == 1 and sender.ctx.run_id in decoded[0].link
    for i in reversed(range(5)):  # the receiver parks the earlier ones until their get
        assert b.call(cmd.get_records, handles[i], []) == records(sent[i])
    to_c = [run(sender.put(9 + i, [torch.full((2,), float(i))], "c")).handle for i in range(2)]
    assert [decode_handle(h).seq for h in to_c] == [1, 2]
    assert decode_handle(to_c[0]).link != decoded[0].link, "one link per target"
    assert c.call(cmd.get_records, to_c[1], []) == records([torch.full((2,), 1.0)])
    assert c.call(cmd.get_records, to_c[0], []) == records([torch.full((2,), 0.0)])


def test_link_files_live_in_the_runtime_dir_named_with_run_and_processes(make, runtime_dir, run_id):
    sender, receiver = make.relay("a"), make.peer("b")
    assert os.listdir(runtime_dir) == [], "links are created on first use"
    handle = run(sender.put(1, [torch.ones(4)], "b")).handle
    receiver.call(cmd.get_records, handle, [])
    names = os.listdir(runtime_dir)
    [ledger] = [n for n in names if not n.endswith(".store")]
    assert ledger.startswith(f"nccl.{run_id}.a.b.cpu.p{os.getpid()}.")
    assert oct(os.stat(os.path.join(runtime_dir, ledger)).st_mode & 0o777) == "0o600"


def test_empty_transfers_need_no_link(make, runtime_dir):
    sender, receiver = make.relay("a"), make.peer("b")
    transfer = run(sender.put(1, [torch.empty(0), torch.empty(2, 0)], "b"))
    assert receiver.call(cmd.get_records, transfer.handle, []) == records([torch.empty(0), torch.empty(2, 0)])
    assert os.listdir(runtime_dir) == []


# -- transfers whose get never comes ------------------------------------------------------------

def test_transfer_nobody_gets_is_taken_off_the_link_and_discarded_once_cleaned_up(make):
    sender, receiver = make.relay("a"), make.peer("b")
    lost = run(sender.put(1, [torch.full((1000,), 1.0)], "b"))  # its message was dropped
    sender.cleanup(1)
    kept = [torch.full((10,), 2.0)]
    handle = run(sender.put(2, kept, "b")).handle
    assert receiver.call(cmd.get_records, handle, []) == records(kept)
    [(next_seq, parked, error)] = receiver.call(link_state).values()
    assert (next_seq, parked, error) == (3, 0, None), "the lost transfer was received and discarded"
    assert held(sender) == []
    assert "stale" in receiver.call(get_error, lost.handle)


def test_parked_transfer_is_delivered_to_a_late_get_and_its_send_completes_before(make):
    sender, receiver = make.relay("a"), make.peer("b")
    first, second = [sample(torch.int64, (100,), seed=1)], [sample(torch.float16, (7,), seed=2)]
    h1, h2 = (run(sender.put(i, t, "b")).handle for i, t in ((1, first), (2, second)))
    assert receiver.call(cmd.get_records, h2, []) == records(second)
    assert holds_within(lambda: link(sender)["received"] == 2, 30, 0.01), \
        "the first transfer was not taken off the link"
    run(sender.put(3, [torch.ones(1)], "b"))  # reaps completed sends
    assert link(sender)["pending"] in ([3], [])
    assert receiver.call(cmd.get_records, h1, []) == records(first)


def test_get_of_a_transfer_the_sender_cleaned_up_is_a_clear_error(make):
    sender, receiver = make.relay("a"), make.peer("b")
    h1 = run(sender.put(1, [torch.ones(5)], "b")).handle
    h2 = run(sender.put(2, [torch.ones(6)], "b")).handle
    receiver.call(cmd.get_records, h2, [])  # parks the first
    sender.cleanup(1)
    error = receiver.call(get_error, h1)
    assert error.startswith("NcclRelayError") and "stale" in error and "request" in error
    assert receiver.call(cmd.get_records, run(sender.put(3, [torch.ones(2)], "b")).handle, []) == records([torch.ones(2)])


def test_receiver_cleanup_frees_parked_transfers_and_their_credits(make):
    sender, receiver = make.relay("a"), make.peer("b")
    run(sender.put(1, [torch.ones(5)], "b"))
    receiver.call(cmd.get_records, run(sender.put(2, [torch.ones(6)], "b")).handle, [])
    assert held(sender) == [1]
    receiver.call(cmd.cleanup, 1)
    assert held(sender) == []


def test_transfers_nobody_receives_are_bounded_by_the_ring(make):
    sender = make.relay("a")  # "b" never joins: nothing drains the link
    ring = sender.ring

    async def go():
        for i in range(ring):
            await sender.put(i, [torch.ones(1)], "b")
            sender.cleanup(i)  # frees the credit, but the transfer stays on the link
        started = time.monotonic()
        with pytest.raises(RelayTimeout, match="'b'"):
            await sender.put(ring, [torch.ones(1)], "b")
        return time.monotonic() - started

    assert run(go()) < OPTIONS["timeout"] + 2


# -- dead and restarted peers -----------------------------------------------------------------

def test_dead_receiver_fails_put_quickly_and_a_restarted_one_gets_a_new_link(make):
    sender, doomed = make.relay("a"), make.peer("b")
    handles = [run(sender.put(i, [torch.full((4,), float(i))], "b")).handle for i in range(4)]
    for handle in handles:
        doomed.call(cmd.get_records, handle, [], False)  # held, never released
    doomed.kill()

    async def put_to_dead():
        started = time.monotonic()
        with pytest.raises(RelayTimeout) as info:
            await sender.put(9, [torch.ones(1)], "b")
        return time.monotonic() - started, str(info.value)

    elapsed, message = run(put_to_dead())
    assert elapsed < OPTIONS["timeout"] + 2
    assert "'b'" in message and "is dead" in message and "[0, 1, 2, 3]" in message
    for i in range(4):
        sender.cleanup(i)
    transfer = run(sender.put(10, [torch.arange(6)], "b"))
    assert decode_handle(transfer.handle).link != decode_handle(handles[0]).link, "a new link generation"
    restarted = make.peer("b")
    assert restarted.call(cmd.get_records, transfer.handle, []) == records([torch.arange(6)])


def test_receiver_that_closed_its_relay_gets_a_new_link_on_the_next_put(make):
    sender, receiver = make.relay("a"), make.peer("b")
    first = run(sender.put(1, [torch.ones(3)], "b")).handle
    receiver.call(cmd.get_records, first, [])
    receiver.call(cmd.reset_relay)
    second = run(sender.put(2, [torch.zeros(3)], "b")).handle
    assert decode_handle(second).link != decode_handle(first).link
    assert receiver.call(cmd.get_records, second, []) == records([torch.zeros(3)])


def test_get_from_a_sender_killed_before_delivery_is_a_clear_error(make, runtime_dir):
    receiver, sender = make.relay("b"), make.peer("a")
    handle, _ = sender.call(cmd.put_seeded, 1, "b", 0, [[100]])
    sender.kill()

    async def get():
        started = time.monotonic()
        with pytest.raises(NcclRelayError, match="'a'.*closed its relay or died") as info:
            await receiver.get(handle, [])
        return time.monotonic() - started, info

    elapsed, _ = run(get())
    assert elapsed < 5
    leftovers = os.listdir(runtime_dir)  # a crash leaves its link file; the runner removes the dir
    assert leftovers and all(f".p{sender.process.pid}." in n for n in leftovers)
    for name in leftovers:
        os.unlink(os.path.join(runtime_dir, name))


def stop_all_threads(pid: int, timeout: float = 10) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped: the signal is
    asynchronous, and a thread that runs on another core goes on for a moment (long enough, on a
    loaded machine, for a link thread to see its receiver join and start connecting)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if states and all(state in "tT" for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: thread states {states}"
        time.sleep(1e-3)


def test_close_does_not_wait_for_a_sender_that_never_connects(make):
    receiver, sender = make.relay("b"), make.peer("a")
    handle, _ = sender.call(cmd.put_seeded, 1, "b", 0, [[10]])
    stop_all_threads(sender.process.pid)  # alive, but its link never connects
    try:
        async def give_up():
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(receiver.get(handle, []), 0.5)

        run(give_up())
        closing = threading.Thread(target=receiver.close)
        closing.start()
        closing.join(2)
        stuck = closing.is_alive() and "\n".join(
            f"{t.name}:\n{''.join(traceback.format_stack(sys._current_frames()[t.ident]))}"
            for t in threading.enumerate() if t.ident in sys._current_frames())
        closing.join()
        assert not stuck, f"close waited for the link's rendezvous:\n{stuck}"
    finally:
        os.kill(sender.process.pid, signal.SIGCONT)


# -- the event loop ---------------------------------------------------------------------------

def test_event_loop_keeps_running_while_a_link_connects_and_a_large_transfer_arrives(make):
    receiver, sender = make.relay("b"), make.peer("a")
    shapes = [[32 << 20]]  # 128 MiB of float32
    handle, _ = sender.call(cmd.put_seeded, 1, "b", 5, shapes, timeout=60)

    async def go():
        gaps, stop = [], asyncio.Event()

        async def ticker():
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.ensure_future(ticker())
        started = time.monotonic()
        tensors = await receiver.get(handle, [])
        elapsed = time.monotonic() - started
        stop.set()
        await tick
        got = [tensor_record(t) for t in tensors]
        receiver.release(handle)
        return elapsed, gaps, got

    elapsed, gaps, got = run(go())
    assert got == cmd.seeded_records(5, shapes)
    # A get that blocked the loop would leave one gap as long as the whole get (or no tick).
    assert len(gaps) >= 3, f"the loop ticked {len(gaps)} times in {elapsed:.2f} s"
    assert max(gaps) < max(0.5 * elapsed, 0.1), f"the loop stalled {max(gaps):.3f} s of {elapsed:.3f} s"


# -- options, errors --------------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [("credits", 0), ("credits", 2.5), ("timeout", -1),
                                       ("link_timeout", "60"), ("credits", True)])
def test_invalid_options_name_the_option(make, key, value):
    with pytest.raises(ValueError, match=f"relay.options.{key}"):
        make.relay("a", **{key: value})


def test_other_relays_options_are_ignored(make):
    relay = make.relay("a", slot_bytes=1 << 20, slots=8)
    assert (relay.credits, relay.timeout, relay.link_timeout) == (4, 1.0, 30.0)


def test_put_checks_every_item_before_taking_a_credit(make):
    sender = make.relay("a")
    with pytest.raises(TypeError, match="item 1 is a str"):
        run(sender.put(1, [torch.ones(2), "text"], "b"))
    with pytest.raises(TypeError, match="item 0 is on meta"):
        run(sender.put(1, [torch.empty(2, device="meta")], "b"))
    with pytest.raises(ValueError, match="target"):
        run(sender.put(1, [torch.ones(2)], ""))
    assert held(sender) == []


def test_put_after_close_is_an_error(make):
    sender = make.relay("a")
    sender.close()
    with pytest.raises(NcclRelayError, match="after close"):
        run(sender.put(1, [torch.ones(2)], "b"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a process without CUDA")
def test_cuda_link_on_a_process_without_cuda_is_a_clear_error(make, runtime_dir, run_id):
    receiver = make.relay("b")
    name = f"nccl.{run_id}.a.b.cuda.p{os.getpid()}.fake.g1"
    ledger = Ledger.create(os.path.join(runtime_dir, name), 4, 16, "cuda")
    try:
        from omni_nccl.relay import Handle, encode_handle

        handle = encode_handle(Handle(name, "a", 1, 0, 1, 1, 4, [0], ["float32"], [[1]], [False]))
        with pytest.raises(NcclRelayError, match="no CUDA device"):
            run(receiver.get(handle, []))
    finally:
        ledger.unlink()
        ledger.close()


# -- CUDA: NCCL between two GPUs --------------------------------------------------------------

def use_gpu(state: PeerState, index: int) -> None:
    torch.cuda.set_device(index)


async def put_cuda(state: PeerState, request_id: int, target: str, seed: int, shapes: list):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(tuple(s), generator=gen).cuda() for s in shapes] + [torch.arange(3)]
    transfer = await state.relay.put(request_id, tensors, target)
    return bytes(transfer.handle)


async def get_devices(state: PeerState, handle: bytes) -> list:
    tensors = await state.relay.get(handle, [])
    out = [(t.device.type, tensor_record(t)) for t in tensors]
    state.relay.release(handle)
    return out


needs_two_gpus = pytest.mark.cuda(devices=2, reason="NCCL needs a GPU per rank")


@needs_two_gpus
def test_cuda_tensors_travel_over_nccl_and_cpu_ones_come_back_to_the_host(make):
    torch.cuda.set_device(0)
    sender = make.relay("a")
    receiver = make.peer("b")
    receiver.call(use_gpu, 1)
    tensors = [sample(torch.float32, (1000,)).cuda(), sample(torch.bfloat16, (3, 5)).cuda(), torch.arange(7)]
    transfer = run(sender.put(1, tensors, "b"))
    assert ".cuda." in decode_handle(transfer.handle).link
    got = receiver.call(get_devices, transfer.handle)
    assert [d for d, _ in got] == ["cuda", "cuda", "cpu"]
    assert [r for _, r in got] == [tensor_record(t) for t in tensors]


@needs_two_gpus
def test_nccl_link_carries_many_transfers_in_order_both_ways(make):
    torch.cuda.set_device(0)
    relay = make.relay("a")
    other = make.peer("b")
    other.call(use_gpu, 1)

    async def go():
        for i in range(20):
            tensors = [sample(torch.float32, (100 + i,), seed=i).cuda()]
            transfer = await relay.put(i, tensors, "b")
            got = await other.acall(get_devices, transfer.handle)
            assert [r for _, r in got] == [tensor_record(t) for t in tensors]
        handle = await other.acall(put_cuda, 50, "a", 3, [[64, 64]])
        back = await relay.get(handle, [])
        assert back[0].device.type == "cuda" and back[1].device.type == "cpu"
        relay.release(handle)

    run(go())


def test_nccl_on_one_gpu_for_both_ends_points_to_cuda_ipc():
    from omni_nccl.relay import failure_hint

    hint = failure_hint(RuntimeError("NCCL error: invalid usage, Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000"))
    assert "same GPU" in hint and "cuda_ipc" in hint
    assert failure_hint(RuntimeError("Connection closed by peer")) == ""

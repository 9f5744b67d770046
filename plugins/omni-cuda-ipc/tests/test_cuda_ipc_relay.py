"""What is particular to cuda_ipc, on a GPU machine (skipped without CUDA): zero copy on one GPU,
the reader waiting for the writer's event, memory going back after release and after an abort,
stale and broken handles, dead receivers, and peer copies across two GPUs."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import types
import uuid

import msgspec
import pytest
import torch
from omni_core.relay.base import RelayContext, RelayTimeout
from omni_core.testing import peer as cmd
from omni_core.testing.peer import PeerState, RelayPeer, tensor_record
from omni_core.testing.relay_conformance import shm_entries

from omni_cuda_ipc.relay import CudaIpcRelay, decode_handle, encode_handle

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.cuda(reason="cuda_ipc moves CUDA tensors"),
]

OPTIONS = {"credits": 4, "timeout": 1.0}


@pytest.fixture
def make(tmp_path):
    """``make.relay(process)`` here, ``make.peer(process)`` in a spawned process; all closed
    after the test, which then checks that no process, thread or link file is left."""
    run_id, runtime_dir = f"cipctest{uuid.uuid4().hex[:8]}", str(tmp_path)
    relays, peers = [], []
    threads_before = set(threading.enumerate())

    def relay(process: str, **options) -> CudaIpcRelay:
        relays.append(CudaIpcRelay(RelayContext(run_id, process, runtime_dir, {**OPTIONS, **options})))
        return relays[-1]

    def peer(process: str, **options) -> RelayPeer:
        peers.append(RelayPeer.start(CudaIpcRelay, RelayContext(run_id, process, runtime_dir, {**OPTIONS, **options})))
        return peers[-1]

    yield types.SimpleNamespace(relay=relay, peer=peer, runtime_dir=runtime_dir)
    for r in relays:
        r.close()
    for p in peers:
        p.stop()
        assert not p.process.is_alive()
    extra = [t.name for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    assert not extra, f"threads left running: {extra}"
    assert [n for n in os.listdir(runtime_dir) if n.startswith("cuda_ipc.")] == [], "link files left"
    assert shm_entries(run_id) == [], "/dev/shm entries left"


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def records(tensors):
    return [(*tensor_record(t), True) for t in tensors]


# -- commands for peers -----------------------------------------------------------------------

async def get_and_describe(state: PeerState, handle: bytes) -> list:
    tensors = await state.relay.get(handle, [])
    out = [(str(t.device), tensor_record(t)) for t in tensors]
    state.relay.release(handle)
    return out


async def get_error(state: PeerState, handle: bytes) -> str:
    try:
        await state.relay.get(handle, [])
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def use_gpu(state: PeerState, index: int) -> None:
    torch.cuda.set_device(index)


# -- one GPU ----------------------------------------------------------------------------------

def test_same_gpu_is_zero_copy_the_receiver_reads_the_senders_memory(make):
    sender, receiver = make.relay("a"), make.peer("b")
    source = torch.zeros(1 << 20, device="cuda")
    transfer = run(sender.put(1, [source], "b"))
    source.fill_(5.0)  # after put: a copying relay would not show this
    torch.cuda.synchronize()
    [(device, record)] = receiver.call(get_and_describe, transfer.handle)
    assert device == "cuda:0" and record == tensor_record(torch.full((1 << 20,), 5.0))


def test_reader_waits_for_the_writers_unfinished_kernels(make):
    sender, receiver = make.relay("a"), make.peer("b")
    target = torch.zeros(1 << 22, device="cuda")
    torch.cuda._sleep(int(2e9))  # about a second of GPU time before the write
    target.fill_(3.0)
    transfer = run(sender.put(1, [target], "b"))  # the host does not wait for the GPU
    [(_, record)] = receiver.call(get_and_describe, transfer.handle)
    assert record == tensor_record(torch.full((1 << 22,), 3.0))


def test_non_contiguous_and_empty_tensors_arrive_contiguous(make):
    sender, receiver = make.relay("a"), make.peer("b")
    base = torch.arange(48, dtype=torch.float32, device="cuda").view(6, 8)
    tensors = [base.t(), base[::2, 1::3], torch.empty(0, device="cuda"), torch.ones(3, 0, device="cuda")]
    got = receiver.call(cmd.get_records, run(sender.put(1, tensors, "b")).handle, [])
    assert got == records(tensors)


def test_memory_goes_back_after_release_and_after_an_abort(make):
    sender, receiver = make.relay("a"), make.peer("b")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    big = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
    delivered = run(sender.put(1, [big], "b"))
    receiver.call(get_and_describe, delivered.handle)  # got and released
    aborted = run(sender.put(2, [big], "b"))
    del big  # only the relay's pins keep the memory now
    sender.cleanup(2)  # nobody opened it: the sender returns torch's count
    run(sender.put(3, [torch.ones(1, device="cuda")], "b"))  # reclaims the released slot
    deadline = time.monotonic() + 10
    while torch.cuda.memory_allocated() > before + (1 << 20) and time.monotonic() < deadline:
        torch.cuda.ipc_collect()
        time.sleep(0.05)
    assert torch.cuda.memory_allocated() <= before + (1 << 20), "shared memory was not freed"
    assert "stale" in receiver.call(get_error, aborted.handle)


def test_a_broken_handle_fails_alone_and_the_relay_goes_on(make):
    sender, receiver = make.relay("a"), make.peer("b")
    good = run(sender.put(1, [torch.ones(10, device="cuda")], "b"))
    h = decode_handle(good.handle)
    broken = msgspec.structs.replace(h, shared=[msgspec.structs.replace(h.shared[0], handle=bytes(64))])
    error = receiver.call(get_error, encode_handle(broken))
    assert error.startswith("CudaIpcRelayError") and "cannot open" in error
    again = run(sender.put(2, [torch.full((10,), 2.0, device="cuda")], "b"))
    assert receiver.call(cmd.get_records, again.handle, []) == records([torch.full((10,), 2.0)])


def test_dead_receiver_fails_put_and_its_credits_come_back_with_cleanup(make):
    sender, doomed = make.relay("a"), make.peer("b")
    for i in range(OPTIONS["credits"]):
        doomed.call(cmd.get_records, run(sender.put(i, [torch.ones(4, device="cuda")], "b")).handle, [], False)
    doomed.kill()
    with pytest.raises(RelayTimeout, match="'b'.*is dead"):
        run(sender.put(9, [torch.ones(1, device="cuda")], "b"))
    for i in range(OPTIONS["credits"]):
        sender.cleanup(i)
    transfer = run(sender.put(10, [torch.arange(5, device="cuda")], "b"))
    restarted = make.peer("b")
    assert restarted.call(cmd.get_records, transfer.handle, []) == records([torch.arange(5)])


# -- two GPUs ---------------------------------------------------------------------------------

@pytest.mark.cuda(devices=2, reason="a peer copy needs two CUDA devices")
def test_across_gpus_the_receiver_gets_a_copy_on_its_own_gpu(make):
    torch.cuda.set_device(0)
    sender, receiver = make.relay("a"), make.peer("b")
    receiver.call(use_gpu, 1)
    source = torch.randn(1000, 7, device="cuda:0")
    tensors = [source, torch.arange(5, device="cuda:0"), torch.empty(0, device="cuda:0")]
    transfer = run(sender.put(1, tensors, "b"))
    got = receiver.call(get_and_describe, transfer.handle)
    assert [d for d, _ in got] == ["cuda:1"] * 3
    assert [r for _, r in got] == [tensor_record(t) for t in tensors]
    source.zero_()  # a copy: later writes do not show on the receiver's side
    torch.cuda.synchronize()
    again = receiver.call(get_and_describe, run(sender.put(2, [source], "b")).handle)
    assert again[0][1] == tensor_record(torch.zeros(1000, 7))

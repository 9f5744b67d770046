"""The parts of the cuda_ipc relay that need no GPU: handle encoding, the ledger's bookkeeping and
claims, options, and the errors a wrong tensor or a missing CUDA device give."""

from __future__ import annotations

import asyncio
import multiprocessing
import os

import msgspec
import pytest
import torch
from omni_core.relay.base import RelayContext
from omni_core.relay.kit import BufferPool

from omni_cuda_ipc.ledger import Ledger, LedgerError, process_alive
from omni_cuda_ipc.relay import (
    CudaIpcRelay,
    CudaIpcRelayError,
    Handle,
    Shared,
    byte_layout,
    check_tensors,
    contiguous_strides,
    decode_handle,
    encode_handle,
    parse_options,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "cuda_ipc.run.a.b.gpu0.p1.x.g1")


# -- handles ------------------------------------------------------------------------------------

def test_handle_round_trips_with_its_shares_and_empty_tensors():
    shared = Shared(b"\x01" * 64, 4096, 512, b"/torch_123_456_0", 7, 16)
    handle = Handle("cuda_ipc.run.a.b.gpu0.p1.x.g1", "a", 3, 99, 12, "GPU-1234", b"\x02" * 64,
                     ["float32", "int8"], [[4, 4], [0]], [shared, None])
    wire = encode_handle(handle)
    assert isinstance(wire, bytes) and len(wire) < 400, "handles ride in control messages"
    back = decode_handle(wire)
    assert back == handle and back.shared[0].counter == b"/torch_123_456_0"


def test_a_handle_of_another_relay_is_rejected():
    with pytest.raises(msgspec.ValidationError):
        decode_handle(msgspec.msgpack.encode(["segment", 0, 1, 2]))


def test_receive_buffer_layout_aligns_every_tensor():
    offsets, size = byte_layout(["float32", "uint8", "float64", "bool"], [[3], [5], [2, 2], [0]])
    assert offsets == [0, 256, 512, 768] and size == 768
    assert all(o % 256 == 0 for o in offsets)


def test_contiguous_strides():
    assert contiguous_strides([2, 3, 4]) == (12, 4, 1)
    assert contiguous_strides([]) == ()
    assert contiguous_strides([3, 0, 2]) == (2, 2, 1)
    assert torch.empty(3, 0, 2).stride() == contiguous_strides([3, 0, 2])


def test_receive_pool_reuses_the_smallest_fitting_buffer_and_keeps_a_few():
    pool = BufferPool(keep=2, granule=1 << 16)
    small, large = pool.take(1000, torch.device("cpu")), pool.take(1 << 20, torch.device("cpu"))
    assert small.numel() == 1 << 16 and large.numel() == 1 << 20
    pool.give(large)
    pool.give(small)
    assert pool.take(600_000, torch.device("cpu")) is large
    assert pool.take(30_000, torch.device("cpu")) is small
    fresh = pool.take(30_000, torch.device("cpu"))
    for buffer in (small, large, fresh):
        pool.give(buffer)
    assert len(pool.free) == 2 and any(b is large for b in pool.free), "the smallest goes first"


# -- options and tensors ----------------------------------------------------------------------

def test_options_defaults_and_other_relays_keys():
    assert parse_options({}) == (32, 30.0)
    assert parse_options({"credits": 4, "timeout": 2, "slot_bytes": 1 << 20, "link_timeout": 9}) == (4, 2.0)


@pytest.mark.parametrize("key,value", [("credits", 0), ("credits", 1.5), ("timeout", 0), ("credits", True)])
def test_invalid_options_name_the_option(key, value):
    with pytest.raises(ValueError, match=f"relay.options.{key}"):
        parse_options({key: value})


def test_cpu_tensors_are_a_clear_error():
    with pytest.raises(TypeError, match=r"item 1 is on cpu; this relay moves CUDA tensors only"):
        check_tensors([_FakeCuda(), torch.ones(2)])
    with pytest.raises(TypeError, match="item 0 is a str"):
        check_tensors(["text"])
    with pytest.raises(TypeError, match="item 0 is on meta"):
        check_tensors([torch.empty(1, device="meta")])
    assert check_tensors([_FakeCuda()]) == torch.device("cuda", 0)
    assert check_tensors([]) is None


class _FakeCuda(torch.Tensor):
    """Passes for a CUDA tensor in ``check_tensors`` on a machine without CUDA."""

    @staticmethod
    def __new__(cls):
        return torch.Tensor._make_subclass(cls, torch.ones(1))

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_put_of_cpu_tensors_fails_before_touching_cuda(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    relay = CudaIpcRelay(RelayContext("run", "a", str(tmp_path), {}))
    with pytest.raises(TypeError, match="item 0 is on cpu"):
        asyncio.run(relay.put(1, [torch.ones(3)], "b"))
    assert os.listdir(tmp_path) == [], "no link was created for a failed put"
    relay.close()
    relay.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_building_the_relay_without_cuda_is_a_clear_error(tmp_path):
    with pytest.raises(CudaIpcRelayError, match="process 'stage_b' has no usable CUDA device.*shm or nccl"):
        CudaIpcRelay(RelayContext("run", "stage_b", str(tmp_path), {}))


def test_capabilities_and_sweep():
    caps = CudaIpcRelay.capabilities
    assert CudaIpcRelay.name == "cuda_ipc"
    assert caps.devices == {"cuda"} and caps.scopes == {"node"} and caps.priority > 10
    assert CudaIpcRelay.sweep("any-run") == [] and CudaIpcRelay.sweep() == []


# -- the ledger ---------------------------------------------------------------------------------

def test_ledger_header_and_files(path):
    sender = Ledger.create(path, credits=8)
    receiver = Ledger.open(path)
    assert receiver.credits == 8 and receiver.sender[0] == os.getpid()
    assert not os.path.exists(path + ".tmp")
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    with pytest.raises(FileExistsError):
        Ledger.create(path, credits=8)
    sender.unlink()
    assert not os.path.exists(path)
    assert receiver.credits == 8, "mappings outlive the file"
    for ledger in (sender, receiver):
        ledger.close()
        ledger.close()


def test_ledger_refuses_missing_and_foreign_files(path, tmp_path):
    with pytest.raises(LedgerError, match="does not exist"):
        Ledger.open(path)
    foreign = tmp_path / "foreign"
    foreign.write_bytes(bytes(4096))
    with pytest.raises(LedgerError, match="not a cuda_ipc link ledger"):
        Ledger.open(str(foreign))


def test_claim_then_abandon_leaves_the_count_to_the_receiver(path):
    sender, receiver = Ledger.create(path, 4), Ledger.open(path)
    sender.issue(1, 10)
    assert receiver.claim(1, 10)
    assert sender.abandon(1, 10) is True, "the receiver opened it: it returns torch's count"
    sender.close()
    receiver.close()


def test_abandon_then_claim_refuses_the_receiver(path):
    sender, receiver = Ledger.create(path, 4), Ledger.open(path)
    sender.issue(1, 10)
    assert sender.abandon(1, 10) is False, "nobody opened it: the sender returns torch's count"
    assert receiver.claim(1, 10) is False
    sender.issue(1, 11)  # the slot is reused: an old handle still cannot claim it
    assert receiver.claim(1, 10) is False and receiver.claim(1, 11) is True
    receiver.release(1, 11)
    assert sender.released(1) == 11 and sender.taken(1) == 11
    sender.close()
    receiver.close()


def test_claims_and_abandons_racing_across_processes_never_both_win(path):
    slots = 4096
    sender = Ledger.create(path, slots)
    for slot in range(slots):
        sender.issue(slot, 1000 + slot)
    ctx = multiprocessing.get_context("spawn")
    results, ready, go = ctx.Queue(), ctx.Event(), ctx.Event()
    racer = ctx.Process(target=_claim_all, args=(path, slots, results, ready, go))
    racer.start()
    assert ready.wait(60)
    go.set()
    # From the other end: the two meet somewhere in the middle.
    abandoned_unclaimed = {slot for slot in reversed(range(slots)) if not sender.abandon(slot, 1000 + slot)}
    claimed = results.get(timeout=60)
    racer.join(60)
    assert racer.exitcode == 0
    assert claimed.isdisjoint(abandoned_unclaimed), "a transfer both opened and given back"
    assert claimed | abandoned_unclaimed == set(range(slots)), "a transfer nobody accounts for"
    sender.close()


def test_receiver_join_close_and_death_show_in_the_ledger(path):
    sender = Ledger.create(path, 2)
    joined = multiprocessing.get_context("spawn").Process(target=_join, args=(path,))
    joined.start()
    joined.join(60)
    assert joined.exitcode == 0
    assert sender.receiver[0] == joined.pid and sender.receiver_gone()
    assert not process_alive(*sender.receiver)
    mine = Ledger.open(path)
    mine.join()
    assert not sender.receiver_gone()
    mine.mark_receiver_closed()
    assert sender.receiver_gone() and sender.receiver_closed
    assert not mine.sender_gone()
    sender.mark_sender_closed()
    assert mine.sender_gone() and mine.sender_closed
    mine.close()
    sender.close()


def _claim_all(path: str, slots: int, results, ready, go) -> None:
    ledger = Ledger.open(path)
    ready.set()
    go.wait(60)
    results.put({slot for slot in range(slots) if ledger.claim(slot, 1000 + slot)})
    ledger.close()


def _join(path: str) -> None:
    ledger = Ledger.open(path)
    ledger.join()
    ledger.close()

"""``Relay.owns`` and ``detach``: which received tensors view relay memory, and copying exactly
those (and whatever views them) out of a result before the relay reuses the memory."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest
import torch

from omni_core.relay import Relay, detach, lent_storages, storage_key
from omni_core.relay.base import RelayContext
from omni_core.relay.shm import ShmRelay

pytestmark = pytest.mark.timeout(60)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.fixture
def received(tmp_path):
    """Two tensors received through shm, the relay that owns them, and their lent storages."""
    run_id = f"lifetest{uuid.uuid4().hex[:8]}"
    opts = {"slot_bytes": 1 << 16, "slots": 2, "inline_below": 0}  # small tensors through the pool too
    sender = ShmRelay(RelayContext(run_id, "a", str(tmp_path), opts))
    receiver = ShmRelay(RelayContext(run_id, "b", str(tmp_path), opts))
    handle = run(sender.put(1, [torch.arange(8.0), torch.ones(2, 3, dtype=torch.int64)], "b")).handle
    tensors = run(receiver.get(handle))
    yield receiver, tensors, lent_storages(receiver, tensors)
    del tensors
    receiver.release(handle)
    receiver.close()
    sender.close()


def test_shm_owns_what_it_returned_and_nothing_else(received):
    relay, (x, y), lent = received
    assert relay.owns(x) and relay.owns(y[1:]) and relay.owns(x[2:5])
    assert not relay.owns(torch.arange(8.0)) and not relay.owns(torch.empty(0))
    assert lent == {storage_key(x)}, "both tensors view one pool: one storage"


def test_detach_copies_every_view_of_lent_memory_and_nothing_else(received):
    _, (x, y), lent = received
    own = torch.zeros(3)
    result = {"x": x, "tail": x[4:], "strided": y.t(), "own": own, "nested": [(y, 1), "s"], "n": None,
              "array": x.numpy()[2:], "own_array": np.zeros(2)}
    out = detach(result, lent)
    for key in ("x", "tail", "strided"):
        assert storage_key(out[key]) not in lent and torch.equal(out[key], result[key])
    assert out["strided"].is_contiguous()
    assert out["own"] is own and out["own_array"] is result["own_array"]
    assert isinstance(out["nested"][0], tuple) and out["nested"][1] == "s"
    assert storage_key(out["nested"][0][0]) not in lent and torch.equal(out["nested"][0][0], y)
    assert not np.shares_memory(out["array"], x.numpy()) and np.array_equal(out["array"], x.numpy()[2:])
    x.fill_(-1)  # the relay reuses the slot
    assert torch.equal(out["x"], torch.arange(8.0)) and torch.equal(out["tail"], torch.arange(4.0, 8.0))


def test_detach_with_nothing_lent_returns_the_object_itself():
    payload = {"x": torch.ones(2), "l": [torch.zeros(1)]}
    assert detach(payload, set()) is payload
    assert detach(payload, {("cpu", -1, 1, 8)}) is payload, "untouched containers are not rebuilt"


def test_a_relay_that_releases_owns_by_default_whatever_the_device():
    class Slots(Relay):
        name = "slots"

        async def put(self, request_id, tensors, target):
            raise NotImplementedError

        async def get(self, handle, frames=()):
            raise NotImplementedError

        def release(self, handle):
            pass

    class NoSlots(Slots):
        release = Relay.release

    ctx = RelayContext("r", "p", "/tmp")
    assert Slots(ctx).owns(torch.ones(1)) and not Slots(ctx).owns(torch.empty(0))
    assert not NoSlots(ctx).owns(torch.ones(1))


@pytest.mark.cuda
def test_detach_copies_lent_cuda_tensors_on_their_device():
    x = torch.arange(16.0, device="cuda")
    lent = {storage_key(x)}
    out = detach({"x": x[3:], "cpu": x.cpu()}, lent)
    assert out["x"].is_cuda and storage_key(out["x"]) not in lent and torch.equal(out["x"], x[3:])
    assert storage_key(out["cpu"]) not in lent
    assert ("cpu", -1, x.untyped_storage().data_ptr(), x.untyped_storage().nbytes()) not in lent

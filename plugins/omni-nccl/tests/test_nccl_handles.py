"""Forged nccl handles fed straight to ``get``: refused with ``InvalidHandle`` before a link file
is opened or a buffer allocated; a forged sequence number fails at once instead of waiting for a
transfer that never comes; the link goes on serving real handles."""

from __future__ import annotations

import asyncio
import os
import uuid

import attrs
import msgspec
import pytest
import torch
from omni_core.relay import InvalidHandle
from omni_core.relay.base import RelayContext
from omni_core.testing import peer as cmd
from omni_core.testing.peer import RelayPeer, tensor_record

from omni_nccl.relay import Handle, NcclRelay, decode_handle, encode_handle

pytestmark = pytest.mark.timeout(120)

OPTIONS = {"credits": 4, "timeout": 1.0, "link_timeout": 30.0}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.fixture
def ctx(tmp_path):
    runtime_dir = tmp_path / "runtime"
    runtime_dir.mkdir(mode=0o700)
    return RelayContext(f"nccltest{uuid.uuid4().hex[:8]}", "b", str(runtime_dir), OPTIONS)


def handle(ctx: RelayContext, **changes) -> bytes:
    fields = dict(link=f"nccl.{ctx.run_id}.a.b.cpu.p1.abc.g1", sender="a", seq=1, slot=0, ticket=1,
                  request_id=1, nbytes=64, offsets=[0], dtypes=["float32"], shapes=[[16]], host=[True])
    return encode_handle(Handle(**{**fields, **changes}))


def refused(relay, raw: bytes, match: str):
    with pytest.raises(InvalidHandle, match=match):
        run(relay.get(raw, []))


def test_forged_handles_are_refused_before_any_file_is_opened(ctx, tmp_path):
    relay = NcclRelay(ctx)
    victim = tmp_path / "victim"
    victim.write_bytes(b"\0" * 4096)
    try:
        for link in ("../victim", f"nccl.{ctx.run_id}/../../victim", "nccl.otherrun.a.b.cpu.p1.x.g1", ""):
            if link:
                refused(relay, handle(ctx, link=link), "not one of this run's")
        refused(relay, handle(ctx, link="", shapes=[[1 << 27]]), "no buffer")
        refused(relay, handle(ctx, shapes=[[1 << 27]]), "exceeds")
        refused(relay, handle(ctx, offsets=[1 << 40]), "exceeds")
        refused(relay, handle(ctx, nbytes=-1), "bytes")
        refused(relay, handle(ctx, dtypes=["object"]), "dtype")
        refused(relay, handle(ctx, host=[True, False]), "host flags")
        refused(relay, b"\xc1", "malformed")
        assert relay.open_links()["receiving"] == {} and os.listdir(ctx.runtime_dir) == []
        assert victim.read_bytes() == b"\0" * 4096
    finally:
        relay.close()


def test_forged_sequence_number_and_slot_fail_at_once_and_the_link_goes_on(ctx):
    sender = NcclRelay(attrs.evolve(ctx, process="a"))
    receiver = RelayPeer.start(NcclRelay, ctx)
    try:
        real = run(sender.put(1, [torch.arange(16, dtype=torch.float32)], "b")).handle
        h = decode_handle(real)
        for bad, match in ((msgspec.structs.replace(h, seq=10**9), "never posted"),
                           (msgspec.structs.replace(h, seq=0), "never posted"),
                           (msgspec.structs.replace(h, slot=99), "slot")):
            error = receiver.call(get_error, encode_handle(bad))
            assert error.startswith("InvalidHandle") and match in error, error
        got = receiver.call(cmd.get_records, real, [])
        assert got == [(*tensor_record(torch.arange(16, dtype=torch.float32)), True)]
    finally:
        receiver.stop()
        sender.close()


async def get_error(state, raw: bytes) -> str:
    try:
        await state.relay.get(raw, [])
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"

"""Forged cuda_ipc handles: refused with ``InvalidHandle`` by the checks that run before any
ledger, CUDA allocation or torch reference-count file is opened (these need no GPU)."""

from __future__ import annotations

import msgspec
import pytest
from omni_core.relay import InvalidHandle

from omni_cuda_ipc.relay import Handle, Shared, check_handle, encode_handle

RUN = "run1"
GOOD_SHARE = Shared(b"\x01" * 64, 4096, 0, b"/torch_123_456_0", 7, 0)


def handle(**changes) -> bytes:
    fields = dict(link=f"cuda_ipc.{RUN}.a.b.gpu0.p1.abc.g1", sender="a", slot=0, ticket=1, request_id=1,
                  device="GPU-1", event=b"\x02" * 64, dtypes=["float32"], shapes=[[16]], shared=[GOOD_SHARE])
    return encode_handle(Handle(**{**fields, **changes}))


def share(**changes) -> Shared:
    return msgspec.structs.replace(GOOD_SHARE, **changes)


def test_a_real_looking_handle_passes():
    assert check_handle(handle(), RUN).slot == 0
    assert check_handle(handle(link="", shapes=[[0]], shared=[None]), RUN).link == ""


@pytest.mark.parametrize(("changes", "match"), [
    ({"link": "../../tmp/x"}, "not one of this run's"),
    ({"link": f"cuda_ipc.{RUN}.a/../../x"}, "not one of this run's"),
    ({"link": "cuda_ipc.otherrun.a.b.gpu0.p1.abc.g1"}, "not one of this run's"),
    ({"link": "", "shapes": [[1 << 27]], "shared": [None]}, "no buffer"),
    ({"shapes": [[1 << 27]]}, "exceeds its shared storage"),
    ({"shared": [share(tensor_offset=4096)]}, "exceeds its shared storage"),
    ({"shared": [share(size=-1)]}, "exceeds"),
    ({"shared": [None]}, "no share"),
    ({"shared": [share(counter=b"/../../tmp/x")]}, "invalid share"),
    ({"shared": [share(counter=b"/etc/passwd")]}, "invalid share"),
    ({"shared": [share(handle=b"\x01" * 3)]}, "invalid share"),
    ({"event": b"\x00"}, "event"),
    ({"shared": [GOOD_SHARE, GOOD_SHARE]}, "shares"),
    ({"dtypes": ["object"]}, "dtype"),
    ({"shapes": [[-1]]}, "shape"),
])
def test_forged_handles_are_refused(changes, match):
    with pytest.raises(InvalidHandle, match=match):
        check_handle(handle(**changes), RUN)


def test_malformed_bytes_are_refused():
    with pytest.raises(InvalidHandle, match="malformed"):
        check_handle(b"\x93\x01", RUN)


@pytest.mark.cuda
def test_a_relay_refuses_forged_handles_before_opening_anything(tmp_path):
    import asyncio

    from omni_core.relay.base import RelayContext

    from omni_cuda_ipc.relay import CudaIpcRelay

    relay = CudaIpcRelay(RelayContext(RUN, "b", str(tmp_path), {}))
    try:
        for raw in (handle(link="../../tmp/x"), handle(shared=[share(counter=b"/../x")]),
                    handle(link="", shapes=[[1 << 27]], shared=[None])):
            with pytest.raises(InvalidHandle):
                asyncio.run(relay.get(raw, []))
        assert relay.open_links()["receiving"] == {}
    finally:
        relay.close()

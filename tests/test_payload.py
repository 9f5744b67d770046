"""Payload packing: the msgpack skeleton plus out-of-band tensors, errors naming the bad path,
and no reference cycle keeping packed tensors alive."""

from __future__ import annotations

import gc
import weakref
from fractions import Fraction

import numpy as np
import pytest
import torch

from omni_core.relay.payload import PayloadError, pack, unpack


def test_round_trip_keeps_structure_and_tensor_identity():
    t = torch.arange(6).reshape(2, 3)
    payload = {"t": t, "a": np.ones(3, dtype=np.float32), "nested": [1, "x", b"\x00", None, (2, 3)]}
    skeleton, tensors = pack(payload)
    assert tensors[0] is t and len(tensors) == 2
    out = unpack(skeleton, tensors)
    assert out["t"] is t and isinstance(out["a"], np.ndarray)
    assert out["nested"] == [1, "x", b"\x00", None, [2, 3]]


def test_unsendable_values_name_their_path_and_the_fix():
    with pytest.raises(PayloadError, match=r"payload\['a'\]\[1\]\['z'\].*allow_pickle"):
        pack({"a": [1, {"z": object()}]})


def test_pickle_only_when_allowed_on_both_sides():
    skeleton, tensors = pack({"f": Fraction(1, 3)}, allow_pickle=True)
    assert unpack(skeleton, tensors, allow_pickle=True) == {"f": Fraction(1, 3)}
    with pytest.raises(PayloadError, match="does not allow pickle"):
        unpack(skeleton, tensors)


def test_packed_tensors_are_freed_without_the_cyclic_collector():
    gc.disable()
    try:
        t = torch.ones(1000)
        ref = weakref.ref(t)
        skeleton, tensors = pack({"t": t})
        del t, tensors
        assert ref() is None
    finally:
        gc.enable()


def _nested(depth: int) -> list:
    root: list = []
    cur = root
    for _ in range(depth):
        cur.append([])
        cur = cur[0]
    return root


@pytest.mark.parametrize(("value", "path", "reason"), [
    ({"s": [1, {1, 2}]}, r"\['s'\]\[1\]", "a set would arrive as a list"),
    ({"f": frozenset()}, r"\['f'\]", "a frozenset would arrive as a list"),
    ({"m": torch.empty(3, device="meta")}, r"\['m'\]", "meta device"),
    ({"x": [torch.eye(3).to_sparse()]}, r"\['x'\]\[0\]", "sparse_coo tensor cannot be sent; send t.to_dense"),
    ({"c": torch.ones(2, dtype=torch.complex64).conj()}, r"\['c'\]", "resolve_conj"),
    ({"n": torch.ones(2).neg().conj()}, None, None),  # a plain real tensor: conj() is a no-op
    ({"n": torch.ones(2, dtype=torch.complex64)._neg_view()}, r"\['n'\]", "resolve_neg"),
])
def test_values_that_would_arrive_wrong_or_not_at_all_are_refused_with_their_path(value, path, reason):
    for allow_pickle in (False, True):
        if path is None:
            pack(value, allow_pickle=allow_pickle)
            continue
        with pytest.raises(PayloadError, match=rf"at payload{path}: .*{reason}"):
            pack(value, allow_pickle=allow_pickle)


def test_nesting_past_the_limit_is_refused_and_at_the_limit_sent():
    from omni_core.relay.payload import MAX_DEPTH

    # the dict and MAX_DEPTH - 1 lists: MAX_DEPTH containers
    skeleton, tensors = pack({"a": _nested(MAX_DEPTH - 2)})
    assert unpack(skeleton, tensors)["a"] == _nested(MAX_DEPTH - 2)
    for depth in (MAX_DEPTH - 1, 700, 5000):  # no RecursionError, however deep
        with pytest.raises(PayloadError, match=rf"nests deeper than {MAX_DEPTH}"):
            pack({"a": _nested(depth)})

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

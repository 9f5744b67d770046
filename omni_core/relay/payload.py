"""Split a payload into a msgpack skeleton and the tensors that travel out of band.

A payload is any nesting of dict / list / tuple with torch tensors, numpy arrays, bytes, str,
numbers, bools and None. ``pack`` returns ``(skeleton, tensors)``: the skeleton is msgpack bytes in
which each tensor is a small extension record pointing at its index in ``tensors``; numpy arrays
travel as tensors (zero-copy ``torch.from_numpy``) and come back as arrays. Tuples come back as
lists (msgpack has one array type). Anything else is a :class:`PayloadError` naming its path inside
the payload, unless the pipeline sets ``allow_pickle: true``.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import msgspec
import numpy as np
import torch

_TENSOR, _NDARRAY, _PICKLE = 1, 2, 3


class PayloadError(TypeError):
    """A payload holds something omni cannot send between processes."""


class _PackState(threading.local):
    """What the encoder's hook of the current ``pack`` call collects (one per thread)."""

    tensors: list | None = None
    allow_pickle: bool = False


_state = _PackState()


def _hook(obj: Any) -> Any:
    tensors = _state.tensors
    assert tensors is not None, "the encoder's hook runs only inside pack()"
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return msgspec.msgpack.Ext(_TENSOR, (len(tensors) - 1).to_bytes(4, "little"))
    if isinstance(obj, np.ndarray):
        try:
            tensor = torch.from_numpy(np.ascontiguousarray(obj))
        except TypeError as exc:
            raise PayloadError(f"numpy array of dtype {obj.dtype} cannot travel: {exc}") from None
        tensors.append(tensor)
        return msgspec.msgpack.Ext(_NDARRAY, (len(tensors) - 1).to_bytes(4, "little"))
    if isinstance(obj, np.generic):
        return obj.item()
    if _state.allow_pickle:
        return msgspec.msgpack.Ext(_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    raise PayloadError(f"cannot send a {type(obj).__module__}.{type(obj).__qualname__}")


# One module-level encoder whose hook reads per-thread state: no encoder per call, and no
# reference cycle (encoder -> bound hook -> packer -> tensors) that would keep every packed tensor
# alive until the cyclic garbage collector runs.
_encoder = msgspec.msgpack.Encoder(enc_hook=_hook)


def pack(payload: Any, *, allow_pickle: bool = False) -> tuple[bytes, list[torch.Tensor]]:
    """``(skeleton, tensors)`` for ``payload``; :class:`PayloadError` names the bad path."""
    tensors: list[torch.Tensor] = []
    outer = (_state.tensors, _state.allow_pickle)  # a hook may pack again (pickle of a payload)
    _state.tensors, _state.allow_pickle = tensors, allow_pickle
    try:
        return _encoder.encode(payload), tensors
    except (TypeError, ValueError, OverflowError) as exc:
        path = find_unsendable(payload, allow_pickle=allow_pickle)
        where = f" at payload{path}" if path is not None else ""
        hint = (
            "payloads may hold dict, list, tuple, str, int, float, bool, None, bytes, torch tensors "
            "and numpy arrays; convert it, or set 'allow_pickle: true' in the pipeline config"
        )
        raise PayloadError(f"payload cannot be encoded{where}: {exc}; {hint}") from None
    finally:
        _state.tensors, _state.allow_pickle = outer


class _UnpackState(threading.local):
    """What the decoder's hook of the current ``unpack`` call reads (one per thread)."""

    tensors: list | None = None
    allow_pickle: bool = False


_ustate = _UnpackState()


def _ext_hook(code: int, data: memoryview) -> Any:
    tensors = _ustate.tensors
    assert tensors is not None, "the decoder's hook runs only inside unpack()"
    if code == _TENSOR:
        return tensors[int.from_bytes(data, "little")]
    if code == _NDARRAY:
        return tensors[int.from_bytes(data, "little")].numpy()
    if code == _PICKLE:
        if not _ustate.allow_pickle:
            raise PayloadError("received a pickled value but this pipeline does not allow pickle")
        return pickle.loads(data)
    raise PayloadError(f"unknown payload extension {code}")


# One module-level decoder, as for the encoder: no decoder and hook closure per call.
_decode = msgspec.msgpack.Decoder(ext_hook=_ext_hook).decode


def unpack(skeleton: bytes, tensors: list[torch.Tensor], *, allow_pickle: bool = False) -> Any:
    """Rebuild the payload from ``pack``'s output (tensors in the same order)."""
    outer = (_ustate.tensors, _ustate.allow_pickle)  # a hook may unpack again (pickle of a payload)
    _ustate.tensors, _ustate.allow_pickle = tensors, allow_pickle
    try:
        return _decode(skeleton)
    finally:
        _ustate.tensors, _ustate.allow_pickle = outer


_LEAVES = (str, bytes, bytearray, int, float, bool, type(None), torch.Tensor, np.ndarray, np.generic)


def find_unsendable(payload: Any, *, allow_pickle: bool = False, _path: str = "") -> str | None:
    """The path (``["audio"][0]``) of the first value ``pack`` cannot send, or None."""
    if isinstance(payload, dict):
        for key, value in payload.items():
            if not isinstance(key, (str, int, bytes, float, bool)):
                return f"{_path}[{key!r}] (key)"
            found = find_unsendable(value, allow_pickle=allow_pickle, _path=f"{_path}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(payload, (list, tuple)):
        for i, value in enumerate(payload):
            found = find_unsendable(value, allow_pickle=allow_pickle, _path=f"{_path}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(payload, int) and not isinstance(payload, bool) and not -(2**63) <= payload < 2**64:
        return _path
    if isinstance(payload, _LEAVES) or allow_pickle:
        return None
    return _path

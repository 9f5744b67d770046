"""Split a payload into a msgpack skeleton and the tensors that travel out of band.

A payload is any nesting of dict / list / tuple with torch tensors, numpy arrays, bytes, str,
numbers, bools and None. ``pack`` returns ``(skeleton, tensors)``: the skeleton is msgpack bytes in
which each tensor is a small extension record pointing at its index in ``tensors``; numpy arrays
travel as tensors (zero-copy ``torch.from_numpy``) and come back as arrays. Tuples come back as
lists (msgpack has one array type). Anything else is a :class:`PayloadError` naming its path inside
the payload, unless the pipeline sets ``allow_pickle: true``.

Refused before anything is sent, whatever ``allow_pickle`` says (a :class:`PayloadError` with the
path): sets (they would silently arrive as lists; send a sorted list), nesting deeper than
:data:`MAX_DEPTH` containers, and tensors that have no bytes to send as they are: on the ``meta``
device, sparse or other non-strided layouts, and lazy conjugate or negative views (call
``resolve_conj()`` / ``resolve_neg()``).
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import msgspec
import numpy as np
import torch

_TENSOR, _NDARRAY, _PICKLE = 1, 2, 3

#: The deepest nesting of containers (dict, list, tuple) a payload may have.
MAX_DEPTH = 128


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
        if obj.layout is not torch.strided or obj.is_meta or obj.is_conj() or obj.is_neg():
            raise PayloadError(tensor_problem(obj))
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
    if not _plain(payload):
        found = find_refused(payload)
        if found is not None:
            raise PayloadError(f"payload cannot be sent at payload{found[0]}: {found[1]}")
    outer = (_state.tensors, _state.allow_pickle)  # a hook may pack again (pickle of a payload)
    _state.tensors, _state.allow_pickle = tensors, allow_pickle
    try:
        return _encoder.encode(payload), tensors
    except (TypeError, ValueError, OverflowError) as exc:
        found = find_refused(payload)
        if found is not None:
            raise PayloadError(f"payload cannot be sent at payload{found[0]}: {found[1]}") from None
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
_SCALARS = frozenset({str, int, float, bool, type(None), bytes})
_FLAT = _SCALARS | {torch.Tensor}


def tensor_problem(t: torch.Tensor) -> str:
    """Why tensor ``t`` cannot be sent as it is (``""``: it can)."""
    if t.is_meta:
        return "a tensor on the meta device has no data to send; materialise it (torch.empty_like(t, device='cpu'))"
    if t.layout is not torch.strided:
        return f"a {t.layout} tensor cannot be sent; send t.to_dense() (or its indices and values)"
    if t.is_conj():
        return "a lazy conjugate view cannot be sent; send t.resolve_conj()"
    if t.is_neg():
        return "a lazy negative view cannot be sent; send t.resolve_neg()"
    return ""


def _plain(payload: Any) -> bool:
    """The fast check ``pack`` runs first: no set, no nesting past :data:`MAX_DEPTH` (False
    sends it to :func:`find_refused` for the path and the reason). Tensors are checked by the
    encoder's hook, which sees each of them anyway."""
    if type(payload) is dict:  # the common payload: a dict of tensors, scalars and lists of scalars
        for value in payload.values():
            kind = type(value)
            if kind not in _FLAT and not ((kind is list or kind is tuple) and _FLAT.issuperset(map(type, value))):
                break
        else:
            return True
    stack = [(payload, 0)]
    pop, push = stack.pop, stack.append
    while stack:
        obj, depth = pop()
        kind = type(obj)
        if kind is dict:
            items = obj.values()
        elif kind is list or kind is tuple:
            items = obj
        elif kind is torch.Tensor:
            continue
        elif isinstance(obj, (set, frozenset, dict, list, tuple)):
            return False  # subclasses: the slow path looks closer
        else:
            continue
        if depth >= MAX_DEPTH:
            return False
        for value in items:
            if type(value) not in _SCALARS:
                push((value, depth + 1))
    return True


def find_refused(payload: Any, _path: str = "", _depth: int = 0) -> tuple[str, str] | None:
    """``(path, why)`` of the first thing ``pack`` refuses whatever ``allow_pickle`` says (a
    set, a tensor that cannot be sent as it is, nesting past :data:`MAX_DEPTH`), or None."""
    if isinstance(payload, (set, frozenset)):
        return _path, (f"a {type(payload).__name__} would arrive as a list; send a list "
                       "(sorted, if the order must be stable)")
    if isinstance(payload, torch.Tensor):
        why = tensor_problem(payload)
        return (_path, why) if why else None
    if isinstance(payload, (dict, list, tuple)):
        if _depth >= MAX_DEPTH:
            return _path, f"the payload nests deeper than {MAX_DEPTH} containers (omni_core.relay.payload.MAX_DEPTH)"
        items = payload.items() if isinstance(payload, dict) else enumerate(payload)
        for key, value in items:
            found = find_refused(value, f"{_path}[{key!r}]", _depth + 1)
            if found is not None:
                return found
    return None


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

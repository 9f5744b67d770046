"""The ``inline`` relay: tensors travel as zero-copy zmq frames of the control message itself.

Works for any edge the control plane reaches (same node or across nodes); the fallback of ``auto``.
The sender copies each tensor's bytes once into its frame (zmq then sends that frame without
another copy); the receiver's tensors are views of the received frames, so ``release`` has nothing
to free.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from .base import InvalidHandle, Relay, Transfer

# the dtype table lived here; its names stay importable from this module
from .dtypes import DTYPES as _DTYPES  # noqa: F401
from .dtypes import dtype_from_name, dtype_name  # noqa: F401
from .specs import INLINE_CAPABILITIES

# Received frames are ours alone (zmq hands each receiver its own buffer), so a tensor viewing one
# may be written to; torch's warning about non-writable buffers does not apply.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class Meta(msgspec.Struct, array_like=True):
    dtypes: list[str]
    shapes: list[list[int]]


# The handle's wire format, public: the tests that forge handles write it with these.
encode_meta = msgspec.msgpack.Encoder().encode
decode_meta = msgspec.msgpack.Decoder(Meta).decode

def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor (made contiguous first when it is not)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.view(-1).view(torch.uint8).numpy().data  # the array's memoryview


def tensor_frame(tensor: torch.Tensor) -> bytes:
    """A copy of a tensor's bytes, for a frame: one ``memcpy`` for a plain contiguous CPU tensor
    (no chain of views), :func:`tensor_bytes` for anything else."""
    if (tensor.layout is torch.strided and tensor.device.type == "cpu" and tensor.is_contiguous()
            and not tensor.is_conj() and not tensor.is_neg()):
        nbytes = tensor.nbytes
        return ctypes.string_at(tensor.data_ptr(), nbytes) if nbytes else b""
    return tensor_bytes(tensor).tobytes()


def tensor_from_buffer(buf: Any, dtype: torch.dtype, shape: Sequence[int], nbytes: int) -> torch.Tensor:
    """A tensor viewing ``buf`` of ``nbytes`` bytes (no copy)."""
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    if dtype in _DIRECT:
        flat = torch.frombuffer(buf, dtype=dtype)
        return flat if len(shape) == 1 else flat.view(shape)  # 1-D: frombuffer's shape already
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).view(tuple(shape))


# dtypes torch.frombuffer reads directly (the others go through uint8 bytes).
_DIRECT = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                     torch.int16, torch.int8, torch.uint8, torch.bool})

#: Handles (and their checked specs) of the tensor layouts seen last: a stream sends the same
#: dtypes and shapes chunk after chunk, so neither side encodes, decodes or checks them again.
_HANDLES: dict[tuple, bytes] = {}
_SPECS: dict[bytes, list] = {}
_CACHE_SIZE = 256


def inline_transfer(tensors: Sequence[torch.Tensor]) -> Transfer:
    """Tensors as frames of their own bytes. The bytes are copied here, once: zmq sends frames
    later from its I/O thread, and the caller may change or free its tensors as soon as ``put``
    returned (a stage reusing an output buffer, a relay slot being released)."""
    key = tuple((t.dtype, t.shape) for t in tensors)
    handle = _HANDLES.get(key)
    if handle is None:
        handle = encode_meta(Meta([dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors]))
        if len(_HANDLES) >= _CACHE_SIZE:
            _HANDLES.clear()
        _HANDLES[key] = handle
    return Transfer(handle, [tensor_frame(t) for t in tensors])


def inline_tensors(handle: bytes, frames: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors of an ``inline_transfer``, after checking the handle against the frames: one
    frame per declared tensor, each exactly its dtype times shape in bytes (so a forged handle
    can neither read past a frame nor make this process allocate what it declares)."""
    specs = _SPECS.get(handle) if type(handle) is bytes else None
    if specs is None:
        from .checks import decode, tensor_specs

        meta = decode(decode_meta, handle, "inline")
        specs = tensor_specs(meta.dtypes, meta.shapes, "inline")
        if type(handle) is bytes:
            if len(_SPECS) >= _CACHE_SIZE:
                _SPECS.clear()
            _SPECS[handle] = specs
    if len(frames) != len(specs):
        raise InvalidHandle(f"inline relay: {len(frames)} frames for {len(specs)} tensors")
    out = []
    for i, (frame, (dtype, shape, nbytes)) in enumerate(zip(frames, specs, strict=True)):
        size = memoryview(frame).nbytes
        if size != nbytes:
            raise InvalidHandle(f"inline relay: frame {i} holds {size} bytes but its tensor "
                                f"({dtype_name(dtype)} {list(shape)}) needs {nbytes}")
        out.append(tensor_from_buffer(frame, dtype, shape, size))
    return out


class InlineRelay(Relay):
    """Tensors as extra zmq frames: no shared state, nothing to clean up."""

    name = "inline"
    capabilities = INLINE_CAPABILITIES  # as registered (omni_core.builtin.relays)

    async def put(self, request_id: int, tensors: Sequence[torch.Tensor], target: str) -> Transfer:
        return inline_transfer(tensors)

    async def get(self, handle: bytes, frames: Sequence[Any] = ()) -> list[torch.Tensor]:
        return inline_tensors(handle, frames)

    def owns(self, tensor: Any) -> bool:
        return False  # views of received frames, which belong to this process alone

    def open_links(self) -> dict[str, dict[str, dict[str, Any]]]:
        """What this relay holds open toward other processes (as every relay of omni's says, for
        leak checks): nothing, ever."""
        return {"sending": {}, "receiving": {}}

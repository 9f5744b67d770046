"""Received-tensor lifetime, on every device.

A relay's ``get`` may return tensors that view memory it reuses after ``release``: a slot of an
``shm`` pool (CPU), a sender's CUDA allocation opened through IPC or a pooled receive buffer
(``cuda_ipc``), a pooled staging buffer (``nccl``). The relay says which through
:meth:`~omni_core.relay.base.Relay.owns`. The runtime records them when it receives::

    tensors = await relay.get(handle, frames)
    lent |= lent_storages(relay, tensors)          # before the call runs

and, before anything the call produced outlives the call (its result, forwarded or returned to
the caller, an emitted chunk handed to a stage of the same process), detaches it::

    result = detach(result, lent)                  # then release the handles

``detach`` copies each tensor whose storage is lent (a view, a slice or the tensor itself: what
matters is the storage it views) to fresh memory on the same device, and leaves everything else
alone, without a copy. The copy is what lets a CUDA tensor received through IPC be shared again
(torch refuses to re-share a storage it opened from another process) and what keeps a pooled
buffer from being overwritten while a later stage still reads it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import torch

StorageKey = tuple[str, int, int, int]


def storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """``(device type, device index, storage address, storage bytes)``: one key for every view
    of a storage; None for a tensor without bytes."""
    if not tensor.numel():
        return None
    device, storage = tensor.device, tensor.untyped_storage()
    return device.type, -1 if device.index is None else device.index, storage.data_ptr(), storage.nbytes()


def lent_storages(relay: Any, tensors: Iterable[torch.Tensor]) -> set[StorageKey]:
    """The keys of the storages among ``tensors`` (just returned by ``relay.get``) that the relay
    owns: what must be copied out of anything that outlives the call."""
    out: set[StorageKey] = set()
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() and relay.owns(t):
            key = storage_key(t)
            assert key is not None, "a tensor with elements has bytes"
            out.add(key)
    return out


def is_lent(tensor: torch.Tensor, lent: Collection[StorageKey]) -> bool:
    return bool(lent) and storage_key(tensor) in lent


def detach(obj: Any, lent: Collection[StorageKey]) -> Any:
    """``obj`` with every tensor that views a lent storage replaced by a copy (same device, dtype,
    shape and values; contiguous). Containers (dict, list, tuple) are rebuilt only where they hold
    such a tensor; numpy arrays viewing lent memory are copied too. With nothing lent, ``obj``
    itself."""
    if not lent:
        return obj
    return _walk(obj, lent)


def _walk(obj: Any, lent: Collection[StorageKey]) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone(memory_format=torch.contiguous_format) if storage_key(obj) in lent else obj
    if isinstance(obj, dict):
        items = {k: _walk(v, lent) for k, v in obj.items()}
        return obj if all(items[k] is v for k, v in obj.items()) else items
    if isinstance(obj, (list, tuple)):
        walked = [_walk(v, lent) for v in obj]
        if all(a is b for a, b in zip(walked, obj, strict=True)):
            return obj
        return walked if isinstance(obj, list) else tuple(walked)
    if type(obj).__module__ == "numpy" and hasattr(obj, "__array_interface__"):
        return _ndarray(obj, lent)
    return obj


def _ndarray(array: Any, lent: Collection[StorageKey]) -> Any:
    """A copy of a numpy array whose memory lies in a lent CPU storage (``unpack`` rebuilds
    received arrays as views of received tensors), else the array itself."""
    if not array.size:
        return array
    start = array.__array_interface__["data"][0]
    for device, _, base, nbytes in lent:
        if device == "cpu" and base <= start < base + nbytes:
            return array.copy()
    return array

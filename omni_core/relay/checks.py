"""Receiving-side validation of relay handles: nothing from a socket is trusted beyond its schema.

A handle is bytes from another process. Before a relay maps, opens, allocates or views anything a
handle names, it checks it here: names of shared resources (a segment in ``/dev/shm``, a ledger in
the runtime dir) must be plain names of this run (no path separator, the run's prefix), and every
size is bounded by what it will be read from (the segment, the pool, the received frame) and by
the declared dtype and shape. A handle that fails raises :class:`~.base.InvalidHandle`, which the
runtime turns into a failure of that one request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch

from .base import InvalidHandle
from .dtypes import DTYPES

MAX_DIMS = 64
MAX_TENSORS = 1 << 16
_MAX_DIM = 1 << 62


def decode(decoder: Callable[[bytes], Any], handle: Any, relay: str) -> Any:
    """``decoder(handle)``, with a malformed handle reported as :class:`InvalidHandle`."""
    try:
        return decoder(bytes(handle))
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError) as exc:
        raise InvalidHandle(f"{relay} relay: malformed handle ({exc})") from None


def resource_name(name: Any, prefix: str, relay: str, what: str) -> str:
    """``name`` if it is a plain file name (no separator, NUL, ``.``/``..``) starting with
    ``prefix`` (this run's); else :class:`InvalidHandle`."""
    if (not isinstance(name, str) or not name or "/" in name or "\\" in name or "\0" in name
            or name in (".", "..") or not name.startswith(prefix) or len(name) > 255):
        raise InvalidHandle(
            f"{relay} relay: handle names {what} {name!r}, which is not one of this run's "
            f"(expected a plain name starting with {prefix!r})")
    return name


def tensor_specs(dtypes: Sequence[Any], shapes: Sequence[Any], relay: str,
                 *more: tuple[str, Sequence[Any]]) -> list[tuple[torch.dtype, tuple[int, ...], int]]:
    """``(dtype, shape, nbytes)`` of each declared tensor, after checking that ``dtypes``,
    ``shapes`` and every list in ``more`` (``(name, list)`` pairs) have one entry per tensor,
    that each dtype is one relays move and each shape a short list of non-negative ints."""
    count = len(dtypes)
    if count > MAX_TENSORS:
        raise InvalidHandle(f"{relay} relay: handle declares {count} tensors")
    for name, values in (("shapes", shapes), *more):
        if len(values) != count:
            raise InvalidHandle(
                f"{relay} relay: handle declares {count} dtypes but {len(values)} {name}")
    out = []
    for i, (dt, shape) in enumerate(zip(dtypes, shapes, strict=True)):
        dtype = DTYPES.get(dt) if isinstance(dt, str) else None
        if dtype is None:
            raise InvalidHandle(f"{relay} relay: tensor {i} has unsupported dtype {dt!r}")
        if len(shape) > MAX_DIMS or not all(
                type(d) is int and 0 <= d < _MAX_DIM for d in shape):
            raise InvalidHandle(f"{relay} relay: tensor {i} has an invalid shape {list(shape)!r}")
        numel = 1
        for d in shape:
            numel *= d
        out.append((dtype, tuple(shape), numel * dtype.itemsize))
    return out


def no_bytes(specs: Sequence[tuple[torch.dtype, tuple[int, ...], int]], relay: str) -> None:
    """A handle without a buffer may only declare empty tensors."""
    total = sum(nbytes for _, _, nbytes in specs)
    if total:
        raise InvalidHandle(
            f"{relay} relay: handle names no buffer but declares {total} bytes of tensors")


def spans(specs: Sequence[tuple[torch.dtype, tuple[int, ...], int]], offsets: Sequence[Any],
          limit: int, relay: str, where: str) -> None:
    """Each tensor ``[offset, offset + nbytes)`` lies in ``[0, limit)`` and its offset is a whole
    number of its elements (so a view needs no copy)."""
    for i, ((dtype, _, nbytes), offset) in enumerate(zip(specs, offsets, strict=True)):
        if type(offset) is not int or offset < 0 or offset % dtype.itemsize:
            raise InvalidHandle(f"{relay} relay: tensor {i} has an invalid offset {offset!r}")
        if offset + nbytes > limit:
            raise InvalidHandle(
                f"{relay} relay: tensor {i} ({nbytes} bytes at offset {offset}) exceeds {where} "
                f"({limit} bytes)")


def index(value: Any, bound: int, relay: str, what: str) -> int:
    """``value`` if it is an int in ``[0, bound)``."""
    if type(value) is not int or not 0 <= value < bound:
        raise InvalidHandle(f"{relay} relay: handle has {what} {value!r} (expected 0 to {bound - 1})")
    return value

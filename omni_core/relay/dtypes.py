"""The tensor dtypes relays move, by name: the one table the relays (inline, shm, plugins') and
the handle checks (:mod:`omni_core.relay.checks`) share."""

from __future__ import annotations

import torch

#: dtype name (``"float32"``) → torch dtype. Byte views need a dtype of the same size to
#: reinterpret; bool and complex go through uint8.
DTYPES = {str(dt).removeprefix("torch."): dt for dt in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {name!r}") from None

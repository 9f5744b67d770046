"""Payloads as JSON: the one encoding of tensors, arrays and bytes that omni's JSON speaks
(``omni serve`` requests and responses; ``omni run``'s output).

- a torch tensor or numpy array → ``{"dtype": "float32", "shape": [2, 3], "data": BASE64}``: the
  elements in C order, little-endian, base64 (standard alphabet, padded). ``dtype`` is torch's
  name without ``torch.`` (``float32``, ``int64``, ``bfloat16``, ``bool`` ...);
- ``bytes`` → ``{"base64": BASE64}``;
- numpy scalars → plain numbers; tuples → lists; mapping keys → strings.

:func:`from_jsonable` turns such objects back into torch tensors and bytes, so a client can send
tensors in (``{"input": {"features": {"dtype": ..., "shape": ..., "data": ...}}}``).
"""

from __future__ import annotations

import base64
import sys
from collections.abc import Mapping
from typing import Any

TENSOR_KEYS = frozenset({"dtype", "shape", "data"})


def _tensor_json(tensor: Any) -> dict[str, Any]:
    import torch

    t = tensor.detach().cpu().contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    if sys.byteorder != "little" and t.element_size() > 1:  # pragma: no cover (big-endian hosts)
        raw = raw.numpy().byteswap()
    data = raw.numpy().tobytes() if hasattr(raw, "numpy") else raw.tobytes()
    return {"dtype": dtype, "shape": list(t.shape), "data": base64.b64encode(data).decode()}


def to_jsonable(value: Any) -> Any:
    """``value`` with tensors, arrays and bytes encoded as described above."""
    if type(value) in (str, int, float, bool) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"base64": base64.b64encode(bytes(value)).decode()}
    module = type(value).__module__
    if module.startswith("torch") and hasattr(value, "detach"):
        return _tensor_json(value)
    if module.startswith("numpy"):
        import numpy as np
        import torch

        if isinstance(value, np.ndarray):
            return _tensor_json(torch.from_numpy(np.ascontiguousarray(value)))
        if isinstance(value, np.generic):
            return value.item()
    return value


class EncodingError(ValueError):
    """A JSON value that looks like an encoded tensor but is not a valid one."""


def _tensor_from(obj: Mapping[str, Any], path: str) -> Any:
    import torch

    dtype_name, shape, data = obj["dtype"], obj["shape"], obj["data"]
    dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise EncodingError(f"{path}.dtype: unknown dtype {dtype_name!r} (use a torch dtype name such as 'float32')")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise EncodingError(f"{path}.shape: expected a list of non-negative integers, got {shape!r}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (TypeError, ValueError):
        raise EncodingError(f"{path}.data: not valid base64") from None
    count = 1
    for n in shape:
        count *= n
    size = torch.empty((), dtype=dtype).element_size()
    if len(raw) != count * size:
        raise EncodingError(f"{path}.data: {len(raw)} bytes, but shape {shape} of {dtype_name} needs {count * size}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    storage_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    tensor = torch.frombuffer(bytearray(raw), dtype=storage_dtype).reshape(shape)
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def from_jsonable(value: Any, path: str = "input") -> Any:
    """JSON data with the encoding above turned back into tensors and bytes."""
    if isinstance(value, dict):
        if set(value) == TENSOR_KEYS:
            return _tensor_from(value, path)
        if set(value) == {"base64"} and isinstance(value["base64"], str):
            try:
                return base64.b64decode(value["base64"], validate=True)
            except ValueError:
                raise EncodingError(f"{path}.base64: not valid base64") from None
        return {k: from_jsonable(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [from_jsonable(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return value

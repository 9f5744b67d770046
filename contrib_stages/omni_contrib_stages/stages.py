"""Reusable stages: a ``torch.nn.Module`` by dotted path, a plain Python function, tee and collect.

All of them follow one convention for what they read and what they pass on:

- ``input_key`` unset: the stage works on the whole payload; set: on ``payload[input_key]``.
- ``output_key`` unset: the stage passes on what the module or function returned; set: it passes
  on the payload (a dict) with the input key removed and the output stored under ``output_key``,
  so everything else the payload carried travels along.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from omni_core.kits import MicroBatcher
from omni_core.registry import import_ref

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64,
}


def _resolve(ref: Any, what: str, stage_name: str) -> Any:
    if callable(ref):
        return ref
    if not isinstance(ref, str) or ":" not in ref:
        raise ValueError(f"stage {stage_name!r}: {what} must be a 'package.module:attr' path, got {ref!r}")
    return import_ref(ref)


def _take_input(payload: Any, input_key: str | None, stage_name: str) -> Any:
    if input_key is None:
        return payload
    if not isinstance(payload, Mapping):
        raise TypeError(f"stage {stage_name!r} reads payload[{input_key!r}] but the payload is a {type(payload).__name__}")
    if input_key not in payload:
        raise KeyError(f"stage {stage_name!r}: the payload has no key {input_key!r} (input_key); it has {sorted(map(str, payload))}")
    return payload[input_key]


def _put_output(payload: Any, output: Any, input_key: str | None, output_key: str | None, stage_name: str) -> Any:
    if output_key is None:
        return output
    if not isinstance(payload, Mapping):
        raise TypeError(f"stage {stage_name!r} stores its output under {output_key!r} but the payload is a {type(payload).__name__}")
    result = {k: v for k, v in payload.items() if k != input_key}
    result[output_key] = output
    return result


# -- torch modules ---------------------------------------------------------------------------------


def _split_rows(output: Any, n: int, out_device: torch.device | None) -> list[Any]:
    """One entry per batch row of a module's output (a tensor, or a tuple/list/dict of them)."""
    if isinstance(output, torch.Tensor):
        if output.dim() == 0 or output.shape[0] != n:
            raise ValueError(f"the module returned a tensor of shape {tuple(output.shape)} for a batch of {n}; "
                             "its first dimension must be the batch")
        rows = output.to(out_device) if out_device is not None else output
        return [row.clone() for row in rows.unbind(0)]  # a plain tensor of its own per request
    if isinstance(output, (tuple, list)):
        parts = [_split_rows(part, n, out_device) for part in output]
        return [type(output)(part[i] for part in parts) if isinstance(output, tuple) else [part[i] for part in parts]
                for i in range(n)]
    if isinstance(output, Mapping):
        parts = {key: _split_rows(value, n, out_device) for key, value in output.items()}
        return [{key: rows[i] for key, rows in parts.items()} for i in range(n)]
    raise TypeError(f"the module returned a {type(output).__name__}; expected a tensor, or a tuple, list or dict of tensors")


class TorchModule:
    """Runs a ``torch.nn.Module`` on the stage's device, batching concurrent requests.

    ``module``: ``"pkg.mod:Class"`` (or any callable returning a module), built with
    ``module_args``; ``seed`` seeds its initialisation (without touching the process's global
    random state); ``weights``: a ``state_dict`` file to load (``torch.load(weights_only=True)``);
    ``dtype``: cast the module and floating inputs (``float32``, ``bfloat16``, ...).

    Each request brings one sample (``payload`` or ``payload[input_key]``: a tensor, numpy array
    or nested list). Requests arriving together are stacked into one ``[batch, ...]`` input, at
    most ``max_batch_size`` of them, waiting at most ``max_wait_ms`` for company; samples of
    different shapes go in separate forward calls. The module must take the batch as its only
    argument and return a tensor, or a tuple/list/dict of tensors, whose first dimension is the
    batch. Each request gets its own row (moved to ``output_device`` when set). The forward runs
    under ``torch.inference_mode()`` in a worker thread, one batch at a time.
    """

    def __init__(
        self,
        module: str,
        module_args: dict[str, Any] | None = None,
        *,
        input_key: str | None = None,
        output_key: str | None = None,
        weights: str | None = None,
        seed: int | None = None,
        dtype: str | None = None,
        max_batch_size: int = 8,
        max_wait_ms: float = 2.0,
        output_device: str | None = None,
        stage_name: str = "module",
        device: str = "cpu",
    ):
        self.stage_name = stage_name
        self.input_key = input_key
        self.output_key = output_key
        self.device = torch.device(device)
        self.output_device = torch.device(output_device) if output_device else None
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"stage {stage_name!r}: unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
        self.dtype = _DTYPES.get(dtype) if dtype else None
        builder = _resolve(module, "module", stage_name)
        kwargs = dict(module_args or {})
        try:
            if seed is None:
                model = builder(**kwargs)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    model = builder(**kwargs)
        except TypeError as exc:
            raise TypeError(f"stage {stage_name!r}: cannot build {module!r} with module_args {kwargs}: {exc}") from exc
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"stage {stage_name!r}: {module!r} built a {type(model).__name__}, not a torch.nn.Module")
        if weights is not None:
            state = torch.load(weights, map_location="cpu", weights_only=True)
            model.load_state_dict(state)
        if self.dtype is not None:
            model = model.to(self.dtype)
        self.model = model.to(self.device).eval()
        self.batcher = MicroBatcher(self._forward, max_batch_size=max_batch_size, max_wait=max_wait_ms / 1000.0,
                                    name=stage_name)

    def _as_tensor(self, value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            tensor = value
        else:
            try:
                tensor = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError) as exc:
                where = f"payload[{self.input_key!r}]" if self.input_key else "the payload"
                raise TypeError(f"stage {self.stage_name!r}: {where} is not a tensor and cannot become one: {exc}") from None
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        return tensor

    def _forward(self, samples: list[torch.Tensor]) -> list[Any]:
        """The batch function: one forward per group of same-shape samples."""
        groups: dict[tuple, list[int]] = {}
        for i, sample in enumerate(samples):
            groups.setdefault((tuple(sample.shape), sample.dtype), []).append(i)
        results: list[Any] = [None] * len(samples)
        for indexes in groups.values():
            try:
                batch = torch.stack([samples[i] for i in indexes]).to(self.device)
                with torch.inference_mode():
                    output = self.model(batch)
                rows = _split_rows(output, len(indexes), self.output_device)
            except Exception as exc:  # fails this group's requests only
                rows = [exc] * len(indexes)
            for i, row in zip(indexes, rows, strict=True):
                results[i] = row
        return results

    async def __call__(self, payload: Any, ctx: Any) -> Any:
        sample = self._as_tensor(_take_input(payload, self.input_key, self.stage_name))
        output = await self.batcher.submit(sample)
        return _put_output(payload, output, self.input_key, self.output_key, self.stage_name)

    async def close(self) -> None:
        await self.batcher.close()


# -- plain functions -------------------------------------------------------------------------------


def _wants_ctx(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "ctx" in params


class _Function:
    """A plain (sync) function: the runtime runs ``__call__`` in a worker thread."""

    def __init__(self, fn: Callable, kwargs: dict[str, Any], input_key: str | None, output_key: str | None, stage_name: str):
        self.fn = fn
        self.kwargs = kwargs
        self.input_key = input_key
        self.output_key = output_key
        self.stage_name = stage_name
        self.wants_ctx = _wants_ctx(fn)

    def _args(self, payload: Any, ctx: Any) -> dict[str, Any]:
        return {**self.kwargs, "ctx": ctx} if self.wants_ctx else self.kwargs

    def __call__(self, payload: Any, ctx: Any) -> Any:
        value = _take_input(payload, self.input_key, self.stage_name)
        output = self.fn(value, **self._args(payload, ctx))
        return _put_output(payload, output, self.input_key, self.output_key, self.stage_name)


class _AsyncFunction(_Function):
    """An ``async def`` function: awaited on the stage's event loop."""

    async def __call__(self, payload: Any, ctx: Any) -> Any:
        value = _take_input(payload, self.input_key, self.stage_name)
        output = await self.fn(value, **self._args(payload, ctx))
        return _put_output(payload, output, self.input_key, self.output_key, self.stage_name)


def function_stage(
    function: str,
    kwargs: dict[str, Any] | None = None,
    *,
    input_key: str | None = None,
    output_key: str | None = None,
    stage_name: str = "function",
) -> _Function:
    """A stage that calls ``function`` (``"pkg.mod:fn"``) as ``fn(value, **kwargs)``.

    ``value`` is the payload (or ``payload[input_key]``); a function that declares a ``ctx``
    parameter also gets the :class:`omni_core.StageContext` (to ``emit`` chunks: an async
    function uses ``await ctx.emit(x)``, a plain one ``ctx.emit_threadsafe(x)``). A plain
    function runs in a worker thread, an ``async def`` one on the event loop. Generators are
    not supported: write a stage class that emits instead.
    """
    fn = _resolve(function, "function", stage_name)
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(f"stage {stage_name!r}: {function!r} is a generator; write a stage class that calls ctx.emit for each item")
    kwargs = dict(kwargs or {})
    if "ctx" in kwargs:
        raise ValueError(f"stage {stage_name!r}: 'ctx' cannot be set in kwargs; the runtime passes it")
    try:
        inspect.signature(fn).bind(None, **kwargs, **({"ctx": None} if _wants_ctx(fn) else {}))
    except TypeError as exc:
        raise TypeError(f"stage {stage_name!r}: {function!r} cannot be called with one value and kwargs {sorted(kwargs)}: {exc}") from None
    except ValueError:
        pass  # no signature (a builtin): find out at the first call
    is_async = inspect.iscoroutinefunction(fn) or (not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__))
    cls = _AsyncFunction if is_async else _Function
    return cls(fn, kwargs, input_key, output_key, stage_name)


# -- streams -----------------------------------------------------------------------------------------


class Tee:
    """Passes its payload on unchanged: a fan-out point (list the targets in ``next``).

    With ``stream_from: <stage>`` it also re-emits every chunk that stage streams to it, to its
    own ``stream_to`` stages (and to the caller when it is terminal), so one stream can feed
    several stages. With ``can_accept_stream_before_payload: true`` it starts re-emitting at the
    first chunk, before its payload arrives.
    """

    def __init__(self, stream_from: str | None = None):
        self.stream_from = stream_from

    async def __call__(self, payload: Any, ctx: Any) -> Any:
        if self.stream_from is not None:
            async for chunk in ctx.stream_from(self.stream_from):
                await ctx.emit(chunk)
        return await ctx.payload()


class Collect:
    """Gathers the chunks ``stream_from`` streams to it into a list, until that stream ends, and
    passes on ``{**payload, output_key: chunks}`` (a dict payload; null counts as ``{}``), or the
    list itself when ``output_key`` is null. Turns a stream back into one payload for stages that
    need everything at once."""

    def __init__(self, stream_from: str, output_key: str | None = "chunks", stage_name: str = "collect"):
        self.stream_from = stream_from
        self.output_key = output_key
        self.stage_name = stage_name

    async def __call__(self, payload: Any, ctx: Any) -> Any:
        chunks = [chunk async for chunk in ctx.stream_from(self.stream_from)]
        if self.output_key is None:
            return chunks
        payload = await ctx.payload()
        return _put_output(payload if payload is not None else {}, chunks, None, self.output_key, self.stage_name)

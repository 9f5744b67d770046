"""Stages the pipeline tests wire together (imported by dotted path in the stage processes)."""

from __future__ import annotations

import asyncio
import time


class Scale:
    """Multiplies the payload's tensor ``x`` by ``factor``, after ``sleep`` seconds if asked."""

    def __init__(self, factor: float = 2.0):
        self.factor = factor

    async def __call__(self, payload, ctx):
        if payload.get("sleep"):
            await asyncio.sleep(payload["sleep"])
        return {**payload, "x": payload["x"] * self.factor}


class Total:
    def __call__(self, payload, ctx):
        return {"n": payload["n"], "sum": float(payload["x"].double().sum()), "x": payload["x"]}


class Hold:
    """Like Scale, but first blocks its process's event loop for ``hold`` seconds when asked (the
    process then reads its next messages late, in whatever order they queued)."""

    def __init__(self, factor: float = 3.0):
        self.factor = factor

    async def __call__(self, payload, ctx):
        if payload.get("hold"):
            time.sleep(payload["hold"])
        return {**payload, "x": payload["x"] * self.factor}


class ToGpu:
    """Moves ``x`` to this process's GPU (times ``factor``)."""

    def __init__(self, factor: float = 2.0):
        self.factor = factor

    def __call__(self, payload, ctx):
        import torch

        return {**payload, "x": payload["x"].to(torch.device("cuda", torch.cuda.current_device())) * self.factor}


class Echo:
    """Returns what it received, as it is, plus a slice of it."""

    def __call__(self, payload, ctx):
        return {**payload, "head": payload["x"][:3]}


class ToHost:
    def __call__(self, payload, ctx):
        return {k: (v.cpu() if hasattr(v, "cpu") else v) for k, v in payload.items()}


class TpEcho:
    """A tensor-parallel stage that all-reduces a copy of ``x`` and returns ``x`` itself too."""

    def __init__(self, tp_rank: int = 0, tp_size: int = 1):
        self.rank, self.size = tp_rank, tp_size

    def __call__(self, payload, ctx):
        import torch.distributed as dist

        total = payload["x"].clone()
        dist.all_reduce(total)
        return {**payload, "total": total}

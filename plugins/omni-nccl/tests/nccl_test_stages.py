"""Stages the pipeline tests wire together (imported by dotted path in the stage processes)."""

from __future__ import annotations

import asyncio
import os
import time


class Scale:
    """Multiplies the payload's tensor ``x`` by ``factor``, after ``sleep`` seconds if asked."""

    def __init__(self, factor: float = 2.0):
        self.factor = factor

    async def __call__(self, payload, ctx):
        if payload.get("sleep"):
            await asyncio.sleep(payload["sleep"])
        if payload.get("marker"):  # tells the test this stage ran the request
            with open(f"{payload['marker']}.{ctx.request_id}", "w"):
                pass
        return {**payload, "x": payload["x"] * self.factor}


class Total:
    def __call__(self, payload, ctx):
        return {"n": payload["n"], "sum": float(payload["x"].double().sum()), "x": payload["x"]}


class Hold:
    """Like Scale, but first blocks its process's event loop when asked (the process then reads its
    next messages late, in whatever order they queued): with ``release`` (a path), from writing
    ``<release>.held`` until the test creates ``release`` (60 s at most)."""

    def __init__(self, factor: float = 3.0):
        self.factor = factor

    async def __call__(self, payload, ctx):
        if payload.get("release"):
            release = payload["release"]
            with open(f"{release}.held", "w"):
                pass
            deadline = time.monotonic() + 60
            while not os.path.exists(release) and time.monotonic() < deadline:
                time.sleep(0.01)  # blocking on purpose: the loop must not run
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


class TensorChunks:
    """Emits ``n`` chunks ``{"i": i, "t": a tensor full of i}`` (every ``plain``-th one without a
    tensor), then returns its payload."""

    async def __call__(self, payload, ctx):
        import torch

        n, plain = payload.get("n", 3), payload.get("plain", 0)
        for i in range(n):
            if plain and i % plain == plain - 1:
                await ctx.emit({"i": i})
            else:
                await ctx.emit({"i": i, "t": torch.full((16,), float(i))})
        return payload


class CollectTensors:
    """Reads the stream from ``source`` after keeping its event loop busy for ``block`` seconds
    (the chunks queue up unread meanwhile); returns the indices in arrival order and the bad ones."""

    def __init__(self, source: str, block: float = 0.0):
        self.source, self.block = source, block

    async def __call__(self, payload, ctx):
        end = time.monotonic() + self.block
        while time.monotonic() < end:
            pass
        got, bad = [], []
        async for chunk in ctx.stream_from(self.source):
            got.append(chunk["i"])
            t = chunk.get("t")
            if t is not None and not bool((t == chunk["i"]).all()):
                bad.append(chunk["i"])
        return {"got": got, "bad": bad}

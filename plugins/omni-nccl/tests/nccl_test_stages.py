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

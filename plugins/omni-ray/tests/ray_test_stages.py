"""Stages the Ray tests wire into pipelines (imported by dotted path in the actors)."""

from __future__ import annotations

import asyncio
import os

import torch


class Where:
    """Adds ``x * factor`` to the payload's tensor and records where it ran."""

    def __init__(self, factor: float = 2.0, stage_name: str = ""):
        self.factor = factor
        self.stage_name = stage_name

    async def __call__(self, payload, ctx):
        import ray

        node = ray.get_runtime_context().get_node_id()
        hops = payload.get("hops", []) + [[self.stage_name, node, os.getpid()]]
        return {"x": payload["x"] * self.factor, "hops": hops}


class Sleep:
    async def __call__(self, payload, ctx):
        await asyncio.sleep(payload.get("sleep", 30))
        return payload


class TpSum:
    """A TP stage: every rank all-reduces ``x`` over its gloo group; rank 0 answers."""

    def __init__(self, tp_rank: int = 0, tp_size: int = 1):
        self.tp_rank = tp_rank
        self.tp_size = tp_size

    def __call__(self, payload, ctx):
        import torch.distributed as dist

        x = payload["x"].clone() * (self.tp_rank + 1)
        dist.all_reduce(x)
        return {"x": x, "world": dist.get_world_size()}


def make(payload):
    return {"x": torch.arange(payload["n"], dtype=torch.float32)}

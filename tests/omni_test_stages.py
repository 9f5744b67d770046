"""Stages and functions the runtime tests wire into pipelines (imported by dotted path in the
stage processes)."""

from __future__ import annotations

import asyncio
import os
import time

import torch


class Upper:
    def __call__(self, payload, ctx):
        return {"text": payload["text"].upper()}


class AddSuffix:
    def __init__(self, suffix: str = "!", stage_name: str = ""):
        self.suffix = suffix
        self.stage_name = stage_name

    async def __call__(self, payload, ctx):
        return {**payload, "text": payload["text"] + self.suffix, "by": payload.get("by", []) + [self.stage_name]}


class Tokens:
    """Emits each character as a chunk, then returns the whole text."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay

    async def __call__(self, payload, ctx):
        for ch in payload["text"]:
            await ctx.emit({"token": ch})
            if self.delay:
                await asyncio.sleep(self.delay)
        return {"text": payload["text"]}


class Collect:
    """Reads the stream from ``source`` and returns what it got along with its payload."""

    def __init__(self, source: str):
        self.source = source

    async def __call__(self, payload, ctx):
        got = [c["token"] async for c in ctx.stream_from(self.source)]
        return {"streamed": "".join(got), "payload": payload}


class Scale:
    def __init__(self, factor: float = 2.0):
        self.factor = factor

    async def __call__(self, payload, ctx):
        return {"x": payload["x"] * self.factor}


class Sleep:
    async def __call__(self, payload, ctx):
        await asyncio.sleep(payload.get("sleep", 10))
        return payload


class Fail:
    def __call__(self, payload, ctx):
        if payload.get("fail"):
            raise RuntimeError(f"boom on {payload.get('text')}")
        return payload


class Pid:
    def __call__(self, payload, ctx):
        return {**payload, "pid": os.getpid()}


class Busy:
    def __call__(self, payload, ctx):
        end = time.monotonic() + payload.get("busy", 0.05)
        while time.monotonic() < end:
            pass
        return payload


def pick_first(request_id, payload):
    return payload.get("route", "a")


def concat(payloads):
    return {"text": "+".join(p["text"] for _, p in sorted(payloads.items()))}


def tensor_total(payload):
    return {"x": payload["x"].sum()}


def make_tensor(payload):
    return torch.tensor(payload)

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


class Mutate:
    """Appends its name to payload['seen'] in place (to show fan-out isolation)."""

    def __init__(self, stage_name: str = ""):
        self.stage_name = stage_name

    def __call__(self, payload, ctx):
        payload["seen"].append(self.stage_name)
        return payload


class Env:
    def __call__(self, payload, ctx):
        return {key: os.environ.get(key) for key in payload["keys"]}


class Unencodable:
    def __call__(self, payload, ctx):
        if payload.get("bad"):
            return {"ok": 1, "bad": object()}
        return {"ok": 1}


class Echo:
    async def __call__(self, payload, ctx):
        return payload


class StreamThenReturn:
    """Emits n chunks to its stream_to targets, then returns its payload."""

    async def __call__(self, payload, ctx):
        for i in range(payload.get("n", 3)):
            await ctx.emit({"i": i})
        return payload


class Concurrency:
    """Reports how many calls of this stage ran at once at most."""

    def __init__(self):
        self.now = 0
        self.peak = 0

    async def __call__(self, payload, ctx):
        self.now += 1
        self.peak = max(self.peak, self.now)
        await asyncio.sleep(payload.get("sleep", 0.05))
        self.now -= 1
        return {"peak": self.peak}


class AbortAware:
    """A sync stage that loops until it sees ctx.aborted, then records it in a file."""

    def __call__(self, payload, ctx):
        end = time.monotonic() + 10
        while time.monotonic() < end:
            if ctx.aborted:
                with open(payload["marker"], "w") as f:
                    f.write("aborted")
                return payload
            time.sleep(0.01)
        return payload


class BadFactory:
    def __init__(self):
        raise ValueError("cannot load the model weights")


class Crash:
    def __call__(self, payload, ctx):
        if payload.get("crash"):
            os._exit(3)
        return payload


def route_by_field(request_id, payload):
    return payload["route"]


def route_raises(request_id, payload):
    raise RuntimeError("route exploded")


def route_unknown(request_id, payload):
    return "nowhere"


def merge_raises(payloads):
    raise RuntimeError("merge exploded")


def wait_for_named(request_id, from_stage, payload):
    return payload.get("wait")


def wait_for_raises(request_id, from_stage, payload):
    raise RuntimeError("wait_for exploded")


def project_len(payload):
    return {"len": len(payload["text"])}


def project_raises(payload):
    raise RuntimeError("projection exploded")


def stream_done_none(request_id, payload):
    return payload.get("done_to")


def stream_done_raises(request_id, payload):
    raise RuntimeError("stream_done exploded")


def terminals_from_inputs(inputs):
    return inputs.get("terminals")


def terminals_raises(inputs):
    raise RuntimeError("terminal_stages exploded")


def stream_done_by_request_id(request_id, payload):
    """End the stream for 'collect' only when the request id says so."""
    return "collect" if request_id.startswith("done") else None


class AllReduce:
    """A tensor-parallel stage: every rank contributes (rank + 1) * x and all-reduces."""

    def __init__(self, tp_rank: int = 0, tp_size: int = 1, tp_init_method: str | None = None):
        import torch.distributed as dist

        assert dist.is_initialized() and dist.get_world_size() == tp_size
        assert tp_init_method and tp_init_method.startswith("file://")
        self.rank = tp_rank
        self.size = tp_size

    async def __call__(self, payload, ctx):
        import torch.distributed as dist

        part = payload["x"] * (self.rank + 1)
        if self.rank == 0 and payload.get("leader_sleep"):
            await asyncio.sleep(payload["leader_sleep"])
        dist.all_reduce(part)
        if payload.get("emit"):
            await ctx.emit({"rank_sum": float(part.sum())})
        return {"x": part, "ranks": self.size, "pid": os.getpid()}


class Cwd:
    def __call__(self, payload, ctx):
        return {"cwd": os.getcwd()}

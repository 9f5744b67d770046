"""Test stages whose requests share batched steps (tests/test_step_messages.py, bench.steps):
a decode loop whose rows each emit one chunk per step, a micro-batched stage, and a reader
that checks a stream's order. Each reports, for a ``{"report": true}`` request, what its
process's outbox sent per step (``omni_core.runtime.channel.step_sends``)."""

from __future__ import annotations

import asyncio

import torch

from omni_core.kits import DecodeLoop, MicroBatcher
from omni_core.runtime.channel import messages_sent, step_sends


def report(**extra) -> dict:
    """This process's step sends, by destination (the address's last part names the process)."""
    sends = step_sends()
    counts = {key: getattr(sends, key) for key in ("messages", "carried", "most")}
    counts["sent"] = messages_sent()
    return {"report": True, "steps_sent": sends.steps, **extra,
            **{key: {address.rsplit("/", 1)[-1]: n for address, n in per.items()} for key, per in counts.items()}}


class Gate:
    """Holds callers until ``rows`` of them arrived (so they share every step from the first);
    the last to arrive leaves after every other left (they join the loop first)."""

    def __init__(self, rows: int):
        self.rows = rows
        self.arrived = self.left = 0
        self.event: asyncio.Event | None = None
        self.others_left: asyncio.Event | None = None

    async def wait(self) -> None:
        if self.event is None:
            self.event, self.others_left = asyncio.Event(), asyncio.Event()
        assert self.others_left is not None
        self.arrived += 1
        if self.arrived >= self.rows:
            self.event.set()
            if self.rows > 1:
                await self.others_left.wait()
            return
        await self.event.wait()
        self.left += 1
        if self.left == self.rows - 1:
            self.others_left.set()


class Stepper:
    """A decode loop of up to ``rows`` rows: a request ``{"n", "r"}`` joins once ``rows``
    requests arrived (``gate``), then gets one output per step, ``0 .. n-1``, each emitted as a
    chunk ``{"i", "r"}`` (with ``"t"``: a tensor full of i when ``tensors``); a row with
    ``fail_at: k`` gets an error instead of its k-th output (its request fails). Returns
    ``{"r", "n"}``. The step runs in the loop's worker thread, as a model's does."""

    def __init__(self, rows: int = 16, tensors: bool = False, gate: bool = True):
        self.loop = DecodeLoop(self.step, max_batch_size=rows, name="stepper")
        self.gate = Gate(rows) if gate else None
        self.tensors = tensors

    def step(self, rows):
        out = []
        for row in rows:
            state = row.state
            if state["made"] == state["fail_at"]:
                out.append(RuntimeError(f"row {state['r']} failed at output {state['made']}"))
                continue
            out.append(state["made"])
            state["made"] += 1
            if state["made"] >= state["n"]:
                row.finish()
        return out

    async def __call__(self, payload, ctx):
        if payload.get("report"):
            return report(steps=self.loop.stats.steps, sizes=dict(self.loop.stats.sizes))
        if self.gate is not None:
            await self.gate.wait()
        state = {"n": payload["n"], "r": payload["r"], "made": 0, "fail_at": payload.get("fail_at", -1)}
        async with self.loop.join(state) as seq:
            async for i in seq:
                chunk = {"i": i, "r": payload["r"]}
                if self.tensors:
                    chunk["t"] = torch.full((8,), float(i))
                await ctx.emit(chunk)
        return {"r": payload["r"], "n": state["made"]}

    async def close(self):
        await self.loop.close()


class Batched:
    """A micro-batched stage: ``rows`` concurrent requests ``{"x"}`` make one batch (it waits up
    to 30 s for them); each gets ``{"y": 2 * x}`` back."""

    def __init__(self, rows: int = 16):
        self.batcher = MicroBatcher(self.forward, max_batch_size=rows, max_wait=30.0, name="batched")

    def forward(self, items):
        return [{"y": 2 * x} for x in items]

    async def __call__(self, payload, ctx):
        if payload.get("report"):
            return report(batches=self.batcher.stats.batches, sizes=dict(self.batcher.stats.sizes))
        return await self.batcher.submit(payload["x"])

    async def close(self):
        await self.batcher.close()


class Reader:
    """Reads the stream of ``source`` (its call starts on the first chunk), checking each chunk's
    tensor; raises at chunk 3 of request ``r == "reader-fails"``. Returns the indices in arrival
    order, the bad ones and the source's result."""

    def __init__(self, source: str = "stepper"):
        self.source = source

    async def __call__(self, payload, ctx):
        chunks = []  # small chunks: copied out of relay memory on arrival, safe to keep
        async for chunk in ctx.stream_from(self.source):
            if chunk["r"] == "reader-fails" and chunk["i"] == 3:
                raise RuntimeError("the reader failed at chunk 3")
            chunks.append(chunk)
        wrong = [c["i"] for c in chunks if "t" in c and not bool((c["t"] == c["i"]).all())]
        return {"got": [c["i"] for c in chunks], "bad": wrong, "source": await ctx.payload()}

"""The stages the benchmarks run in omni pipelines (imported by dotted path in stage processes)."""

from __future__ import annotations

import time
from typing import Any

import torch


class Echo:
    """Returns its payload: the cost measured is omni's alone."""

    async def __call__(self, payload, ctx):
        return payload


class Source:
    """Returns ``{"t": <uint8 tensor of payload["nbytes"] bytes>}``.

    With ``fresh: false`` (default) the tensor for each size is made once and returned again and
    again (a model writing into a reused output buffer: the relay's cost alone). With
    ``fresh: true`` every call makes a new tensor (a model returning new outputs: memory use under
    load shows whether back-pressure holds)."""

    def __init__(self, fresh: bool = False):
        self.fresh = fresh
        self.cache: dict[int, torch.Tensor] = {}

    async def __call__(self, payload, ctx):
        nbytes = int(payload["nbytes"])
        if self.fresh:
            return {"t": torch.ones(nbytes, dtype=torch.uint8)}
        t = self.cache.get(nbytes)
        if t is None:
            t = self.cache[nbytes] = torch.ones(nbytes, dtype=torch.uint8)
        return {"t": t}


class Sink:
    """Reads the last byte of the tensor it received (so the data is there) and returns a small
    result: the tensor does not travel back to the caller."""

    async def __call__(self, payload, ctx):
        t = payload["t"]
        return {"n": int(t.numel()), "last": int(t[-1]) if t.numel() else 0}


def chain(n: int, *, name: str = "bench-chain", factory: str = "bench.stages:Echo", **fields) -> dict:
    """A pipeline config of ``n`` stages in a line, each in its own process."""
    stages = []
    for i in range(n):
        stage = {"name": f"s{i}", "factory": factory}
        stage.update({"next": f"s{i + 1}"} if i < n - 1 else {"terminal": True})
        stages.append(stage)
    return {"name": name, "stages": stages, **fields}


def source_sink(*, relay: str = "auto", options: dict | None = None, fresh: bool = False,
                name: str = "bench-relay", **fields) -> dict:
    """Source → Sink in two processes, the edge moved by ``relay``."""
    return {
        "name": name,
        "stages": [
            {"name": "source", "factory": "bench.stages:Source", "args": {"fresh": fresh}, "next": "sink"},
            {"name": "sink", "factory": "bench.stages:Sink", "terminal": True},
        ],
        "relay": {"backend": relay, "options": dict(options or {})},
        **fields,
    }


class ChunkSource:
    """Streams ``payload["chunks"]`` chunks to its ``stream_to`` stage: ``{"h": <[1, 1, hidden]
    bfloat16 tensor>, "tok": i, "t": <monotonic ns when emitted>}``, one ``ctx.emit`` each (a
    thinker emitting a token and its hidden state per step). The tensors are made once (256 of
    them, ``h`` filled with ``i % 256``), so the stage's own cost is the emit alone."""

    def __init__(self, hidden: int = 2048):
        self.bank = [torch.full((1, 1, hidden), float(v), dtype=torch.bfloat16) for v in range(256)]

    async def __call__(self, payload, ctx):
        emit, bank, clock = ctx.emit, self.bank, time.monotonic_ns
        n = int(payload["chunks"])
        for tok in range(n):
            await emit({"h": bank[tok & 255], "tok": tok, "t": clock()})
        return {"n": n}


class ChunkSink:
    """Reads the stream from ``source``: counts chunks, checks their order (``tok`` 0, 1, …),
    shape, dtype and (every 16th and the last) content, and returns ``{"n", "bad", "lat_us"}``
    with each chunk's latency from emit to read, in µs (one host, one monotonic clock)."""

    def __init__(self, source: str = "src", hidden: int = 2048):
        self.source = source
        self.shape = (1, 1, hidden)

    async def __call__(self, payload, ctx):
        clock, shape = time.monotonic_ns, self.shape
        n = bad = 0
        lat = []
        chunk = None
        async for chunk in ctx.stream_from(self.source):
            lat.append((clock() - chunk["t"]) / 1e3)
            h = chunk["h"]
            wrong = chunk["tok"] != n or tuple(h.shape) != shape or h.dtype is not torch.bfloat16
            if wrong or (not n & 15 and int(h[0, 0, 0]) != n & 255):
                bad += 1
            n += 1
        if chunk is not None and int(chunk["h"][0, 0, -1]) != chunk["tok"] & 255:
            bad += 1
        return {"n": n, "bad": bad, "lat_us": lat}


def stream_pair(*, relay: str = "auto", options: dict | None = None, hidden: int = 2048,
                name: str = "bench-stream", **fields) -> dict:
    """``head`` → (``src``, ``sink``), ``src`` streaming to ``sink`` (``stream_to``) while both
    run: ``head`` hands both their payload, so the sink reads the stream as it is produced.
    ``src`` is not terminal (a terminal stage's chunks would go to the caller too): its result
    goes to ``done``, an ``Echo`` in ``src``'s process (an object hand-over, no message). The
    terminal stages are ``sink`` and ``done`` (the result is ``{"sink": …, "done": …}``). Three
    processes: ``head``, ``src`` (with ``done``), ``sink``."""
    return {
        "name": name,
        "stages": [
            {"name": "head", "factory": "bench.stages:Echo", "next": ["src", "sink"]},
            {"name": "src", "factory": "bench.stages:ChunkSource", "args": {"hidden": hidden},
             "stream_to": ["sink"], "next": "done", "process": "src"},
            {"name": "done", "factory": "bench.stages:Echo", "terminal": True, "process": "src"},
            {"name": "sink", "factory": "bench.stages:ChunkSink", "args": {"source": "src", "hidden": hidden},
             "terminal": True, "can_accept_stream_before_payload": True},
        ],
        "relay": {"backend": relay, "options": dict(options or {})},
        **fields,
    }


class StepSource:
    """A decode loop of up to ``rows`` rows (the kit's :class:`~omni_core.kits.DecodeLoop`, its
    step a trivial loop in the worker thread): a request ``{"tokens"}`` joins once ``rows``
    requests of its round arrived, then emits one chunk per step, ``{"tok": i, "h": <[1, 1,
    hidden] bfloat16>}`` (a thinker's token and hidden state). ``together: false`` turns the
    kit's one-message-per-step send off (the runtime before it), for a comparison in one run.
    ``{"report": true}`` returns the loop's steps and this process's zmq messages per
    destination (``omni_core.runtime.channel.messages_sent``)."""

    def __init__(self, rows: int = 16, hidden: int = 256, together: bool = True):
        from omni_core.kits import DecodeLoop

        self.loop = DecodeLoop(self.step, max_batch_size=rows, name="bench-steps")
        if not together:
            self.loop._handed_out = lambda: None  # type: ignore[method-assign]  # the runtime before
        self.rows = rows
        self.bank = [torch.full((1, 1, hidden), float(v), dtype=torch.bfloat16) for v in range(256)]
        self._arrived = 0
        self._round: Any = None

    def step(self, rows):
        out = []
        for row in rows:
            state = row.state
            out.append(state["made"])
            state["made"] += 1
            if state["made"] >= state["tokens"]:
                row.finish()
        return out

    async def _gate(self) -> None:
        import asyncio

        if self._round is None:
            self._round = asyncio.Event()
        gate = self._round
        self._arrived += 1
        if self._arrived >= self.rows:
            self._arrived, self._round = 0, None
            gate.set()
            await asyncio.sleep(0)  # join after the others, which the set just woke
        await gate.wait()

    async def __call__(self, payload, ctx):
        if payload.get("report"):
            from omni_core.runtime.channel import messages_sent

            return {"steps": self.loop.stats.steps, "sent": messages_sent()}
        await self._gate()
        state = {"tokens": int(payload["tokens"]), "made": 0}
        emit, bank = ctx.emit, self.bank
        async with self.loop.join(state) as seq:
            async for tok in seq:
                await emit({"tok": tok, "h": bank[tok & 255]})
        return {"n": state["made"]}

    async def close(self):
        await self.loop.close()


def token_only(chunk):
    """``project_stream`` to the caller: the token without the hidden state."""
    return {"tok": chunk["tok"]}


class StepReader:
    """Reads the stream from ``source`` (starting on its first chunk), checks the order of
    ``tok``, and returns ``{"n", "bad"}`` (the source's report, for a report)."""

    def __init__(self, source: str = "stepper"):
        self.source = source

    async def __call__(self, payload, ctx):
        n = bad = 0
        async for chunk in ctx.stream_from(self.source):
            bad += chunk["tok"] != n
            n += 1
        result = await ctx.payload()
        return result if "steps" in result else {"n": n, "bad": bad}


def steps_pipeline(rows: int, *, together: bool = True, hidden: int = 256, name: str = "bench-steps") -> dict:
    """``stepper`` (a :class:`StepSource` of ``rows`` rows) streams every token with its hidden
    state to ``reader`` (another process) and the token alone to the caller."""
    return {
        "name": name,
        "stages": [
            {"name": "stepper", "factory": "bench.stages:StepSource",
             "args": {"rows": rows, "hidden": hidden, "together": together},
             "stream_to": ["reader", "caller"], "project_stream": {"caller": "bench.stages:token_only"},
             "next": "reader", "max_concurrency": rows + 1},
            {"name": "reader", "factory": "bench.stages:StepReader", "terminal": True,
             "can_accept_stream_before_payload": True, "max_concurrency": rows + 1},
        ],
        "limits": {"max_in_flight": 2 * rows + 2},
    }

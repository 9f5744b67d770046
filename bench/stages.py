"""The stages the benchmarks run in omni pipelines (imported by dotted path in stage processes)."""

from __future__ import annotations

import time

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

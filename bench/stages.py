"""The stages the benchmarks run in omni pipelines (imported by dotted path in stage processes)."""

from __future__ import annotations

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

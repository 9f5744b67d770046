"""The continuous-batching example of docs/kits.md runs as written: concurrent requests share
steps, each gets its own tokens (as alone: per-request RNG), a long prompt is chunked."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

DOC = Path(__file__).resolve().parents[1] / "docs" / "kits.md"


def example() -> dict:
    text = DOC.read_text()
    section = text[text.index("## Continuous batching for autoregressive stages"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    return namespace


class Ctx:
    def __init__(self):
        self.chunks: list = []

    async def emit(self, chunk):
        self.chunks.append(chunk)


def test_the_documented_stage_batches_requests_and_each_gets_its_own_tokens():
    ns = example()

    async def body():
        stage = ns["Generator"](max_batch_size=8, max_prefill_tokens=16)
        reqs = [{"ids": [(n + i) % 63 + 1 for i in range(3 + 7 * n)], "max_new": 5 + n, "seed": n} for n in range(12)]
        alone = [await stage(dict(r), Ctx()) for r in reqs]
        ctxs = [Ctx() for _ in reqs]
        together = await asyncio.gather(*(stage(dict(r), c) for r, c in zip(reqs, ctxs, strict=True)))
        stats = stage.loop.stats
        assert stage.loop.live == 0 and stage.loop.memory_in_use == 0
        await stage.close()
        return alone, together, ctxs, stats

    alone, together, ctxs, stats = asyncio.run(asyncio.wait_for(body(), 30))
    assert [r["tokens"] for r in together] == [r["tokens"] for r in alone]
    for result, ctx in zip(together, ctxs, strict=True):
        assert [c["token"] for c in ctx.chunks] == result["tokens"]
        assert len(result["tokens"]) >= 1
    assert stats.largest >= 4  # requests shared steps
    assert stats.prefill_tokens == 2 * sum(3 + 7 * n for n in range(12))  # every prompt, alone and together

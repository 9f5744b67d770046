"""The thinker's counts (prompt_tokens, completion_tokens, finish_reason) reach token2wav's result:
the talker passes them on from the thinker's final chunk, with its last text (no model needed)."""

from __future__ import annotations

import asyncio

import torch

from omni_transformers.kit.streams import USAGE_KEYS
from omni_transformers.qwen2_5_omni import talker as qwen_talker

USAGE = {"prompt_tokens": 31, "completion_tokens": 2, "finish_reason": "length"}


class FakeContext:
    """The part of a StageContext ``ThinkerStream.read`` uses: one incoming stream, emit."""

    def __init__(self, chunks):
        self.chunks, self.emitted = chunks, []

    async def stream_from(self, source):
        for chunk in self.chunks:
            yield chunk

    async def emit(self, chunk):
        self.emitted.append(chunk)


def thinker_stream(final: dict) -> list[dict]:
    vec = torch.zeros(4)
    head = {"step": 0, "token_id": 7, "text": "hi", "prompt": torch.zeros(3, 4), "text_bos": vec,
            "text_eos": vec, "text_pad": vec}
    return [head, {"step": 1, "token_id": 8, "text": "!", "reply": vec}, {"final": True, **final}]


def read(final: dict) -> list[dict]:
    ctx = FakeContext(thinker_stream(final))
    asyncio.run(qwen_talker.thinker_stream(ctx, "thinker").read())
    return ctx.emitted


def test_the_talker_passes_the_thinker_counts_on_with_its_last_text():
    assert set(USAGE) == set(USAGE_KEYS)
    emitted = read({"text": " there", **USAGE})
    assert emitted == [{"text": "hi", "token_ids": [7]}, {"text": "!", "token_ids": [8]},
                       {"text": " there", "token_ids": [], **USAGE}]
    # No text held back: the counts alone.
    assert read({"text": "", **USAGE})[-1] == USAGE
    # A thinker without counts: nothing more than its text.
    assert read({"text": ""})[-1] == {"text": "!", "token_ids": [8]}

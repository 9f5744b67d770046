"""A one-stage pipeline for the realtime API's tests: it records what each request got and answers
with words and audio, as fast or as slowly as asked.

``Voice(record=DIR)`` writes one JSON file per request into ``DIR``: the inputs with every tensor
replaced by ``{"tensor": [shape], "dtype", "rms"}``. Then it streams ``words`` times a text chunk
``{"text": "w<i>"}`` and an audio chunk ``{"pcm": float32 [hop], "sample_rate": rate}``, waiting
``delay`` seconds after each, and returns ``{"text", "prompt_tokens", "completion_tokens",
"finish_reason"}``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from typing import Any

import torch


def summary(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                "rms": float(value.float().pow(2).mean().sqrt()) if value.numel() else 0.0}
    if isinstance(value, dict):
        return {k: summary(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [summary(v) for v in value]
    return value


class Voice:
    def __init__(self, record: str, words: int = 5, delay: float = 0.0, sample_rate: int = 16000, hop: int = 1600):
        self.record, self.words, self.delay, self.rate, self.hop = record, words, delay, sample_rate, hop

    async def __call__(self, inputs: dict[str, Any], ctx: Any) -> dict[str, Any]:
        os.makedirs(self.record, exist_ok=True)
        path = os.path.join(self.record, f"{ctx.request_id}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(summary(inputs), f)
        os.replace(path + ".tmp", path)
        words = int(inputs.get("max_tokens", self.words))
        t = torch.arange(self.hop, dtype=torch.float32) / self.rate
        for i in range(words):
            await ctx.emit({"text": f"w{i}"})
            await ctx.emit({"pcm": 0.5 * torch.sin(2 * math.pi * 440 * t), "sample_rate": self.rate})
            if self.delay:
                await asyncio.sleep(self.delay)
        return {"text": " ".join(f"w{i}" for i in range(words)), "prompt_tokens": 7, "completion_tokens": words,
                "finish_reason": "stop"}

"""Stages the ``omni serve`` tests wire into pipelines (imported by dotted path in the stage
processes). A stage that must wait for the test waits for a *gate*: a file the test creates,
polled with a deadline, so no test depends on timing."""

from __future__ import annotations

import asyncio
import os
import time

import torch
from omni_test_stages import write_marker


async def _wait_for(path: str, ctx, limit: float = 60.0) -> bool:
    """Until ``path`` exists (True) or the request is aborted / the limit passes (False)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if os.path.exists(path):
            return True
        if ctx.aborted:
            return False
        await asyncio.sleep(0.01)
    return False


class Words:
    """Emits every word of ``text`` as ``{"text": word}``; with ``gate``, waits for that file
    after the first word; with ``marker``, writes "aborted" there when the request is aborted.
    With ``fail_after``, raises after that many words."""

    async def __call__(self, payload, ctx):
        words = str(payload.get("text", "")).split()
        if payload.get("fail_at_once"):
            raise RuntimeError("failed before any word")
        try:
            for i, word in enumerate(words):
                await ctx.emit({"index": i, "text": word})
                if i == 0 and payload.get("gate"):
                    await _wait_for(payload["gate"], ctx)
                if payload.get("fail_after") == i + 1:
                    raise ValueError(f"failed after {i + 1} word(s)")
        except asyncio.CancelledError:
            if payload.get("marker"):
                write_marker(payload["marker"], "aborted")
            raise
        tensors = {k: payload[k] for k in ("values", "x") if k in payload}  # Shout's tensors, passed on
        return {"text": " ".join(words), "count": len(words), **tensors}


class Shout:
    """Upper-cases ``text``; ``tensor: n`` adds ``torch.arange(n)`` as float32 under ``values``."""

    def __call__(self, payload, ctx):
        out = dict(payload)
        if "text" in out:
            out["text"] = str(out["text"]).upper()
        if isinstance(payload.get("tensor"), int):
            out["values"] = torch.arange(payload["tensor"], dtype=torch.float32)
        if isinstance(payload.get("x"), torch.Tensor):
            out["x"] = payload["x"] * 2
        return out

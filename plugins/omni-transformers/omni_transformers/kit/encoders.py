"""The encoder skeleton: a family's tower (audio, vision ...), micro-batched across requests.

Concurrent requests' inputs go through the tower together (omni_core's :class:`MicroBatcher`); a
family's ``forward`` must keep each item's result independent of its neighbours in a batch.
"""

from __future__ import annotations

from typing import Any

import torch
from omni_core.kits import MicroBatcher


def tensor_input(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{what} must be a tensor, got {type(value).__name__}")
    return value


def carry_route(payload: dict, out: dict) -> dict:
    """The encoders' result carries the request's ``return_audio`` on: their route function sends
    a text-only request's embeddings to the text-only thinker."""
    if "return_audio" in payload:
        out["return_audio"] = payload["return_audio"]
    return out


class Encoder:
    """An encoder stage: a tower (``load_tower``, the family's hook) and a micro-batcher over the
    subclass's ``forward(items) -> list`` (one result per item, in order)."""

    kind = ""

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "cpu",
                 max_batch_size: int = 16, max_wait: float = 0.002, stage_name: str | None = None):
        self.device = torch.device(device)
        self.tower = self.load_tower(model, dtype=dtype, device=device)
        self.dtype = next(self.tower.parameters()).dtype
        self.batcher = MicroBatcher(self.forward, max_batch_size=max_batch_size, max_wait=max_wait,
                                    name=stage_name or f"{self.kind}_encoder")

    def load_tower(self, model: str | None, *, dtype: str, device: str):
        raise NotImplementedError

    def forward(self, items: list) -> list:
        raise NotImplementedError

    async def close(self) -> None:
        await self.batcher.close()

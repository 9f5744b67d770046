"""Stages the GPU pipeline tests wire together (imported by dotted path in the stage processes)."""

from __future__ import annotations

import torch


class ToGpu:
    """Moves the payload's tensor ``x`` to this process's GPU and scales it there."""

    def __init__(self, factor: float = 2.0):
        self.factor = factor

    def __call__(self, payload, ctx):
        return {**payload, "x": payload["x"].cuda() * self.factor, "gpu": torch.cuda.current_device()}


class Scale:
    def __init__(self, factor: float = 3.0):
        self.factor = factor

    def __call__(self, payload, ctx):
        assert payload["x"].is_cuda, "the tensor arrived on the host"
        return {**payload, "x": payload["x"] * self.factor}


class ToHost:
    def __call__(self, payload, ctx):
        return {"n": payload["n"], "x": payload["x"].cpu(), "was_cuda": payload["x"].is_cuda}


class Echo:
    """Returns what it received, as it is, plus a slice of it: tensors that view relay memory
    (the sender's CUDA allocation, or a pooled buffer) leave the stage."""

    def __call__(self, payload, ctx):
        assert payload["x"].is_cuda, "the tensor arrived on the host"
        return {**payload, "head": payload["x"][:3]}

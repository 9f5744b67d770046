"""Modules and functions the contrib tests run through the generic stages (stage processes
import this module by name)."""

from __future__ import annotations

import asyncio
import threading

import torch
from torch import nn


class Affine(nn.Module):
    """``y = x @ W + b`` on ``[batch, n]``; records the batch sizes it saw (in this process)."""

    seen: list[int] = []

    def __init__(self, n: int = 3, out: int = 2):
        super().__init__()
        self.linear = nn.Linear(n, out)

    def forward(self, x):
        Affine.seen.append(x.shape[0])
        return self.linear(x)


class Parts(nn.Module):
    """Returns a dict and a tuple, to test splitting structured outputs."""

    def forward(self, x):
        return {"double": x * 2, "pair": (x.sum(-1), x.mean(-1))}


class NoBatchDim(nn.Module):
    def forward(self, x):
        return x.sum()


class FailsOnNegative(nn.Module):
    def forward(self, x):
        if (x < 0).any():
            raise ValueError("negative input")
        return x + 1


def make_affine(n: int = 3):
    return Affine(n, 1)


def not_a_module():
    return object()


def upper(text, suffix=""):
    return text.upper() + suffix


async def async_upper(text, suffix=""):
    await asyncio.sleep(0)  # suspends once, as a coroutine doing I/O would
    return text.upper() + suffix


def thread_name(value):
    return threading.current_thread().name


def words_with_ctx(text, ctx):
    for word in text.split():
        ctx.emit_threadsafe({"word": word})
    return len(text.split())


async def async_words_with_ctx(text, ctx):
    for word in text.split():
        await ctx.emit({"word": word})
    return len(text.split())


def gen(text):
    yield text


class BatchSize(nn.Module):
    """``[batch, n]`` → ``[batch, 2]``: each row's sum, and the size of the batch it ran in."""

    def forward(self, x):
        return torch.stack([x.sum(-1), torch.full((x.shape[0],), float(x.shape[0]))], dim=-1)

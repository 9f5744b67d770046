"""A stage's concurrency limit: :class:`Slots`."""

from __future__ import annotations

import asyncio
import collections
import contextlib

__all__ = ["Slots"]


class Slots:
    """The stage's concurrency limit: a semaphore whose uncontended acquire is inline in the
    call (``free``, ``waiters``), first come first served."""

    __slots__ = ("free", "waiters")

    def __init__(self, n: int):
        self.free = n
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self) -> None:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await fut  # the slot is handed over by release()
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a slot, then cancelled: pass it on
                self.release()
            else:
                with contextlib.suppress(ValueError):
                    self.waiters.remove(fut)
            raise

    def release(self) -> None:
        waiters = self.waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1

"""The requests' deadlines (``limits.request_timeout``), watched by one timer.

Every request gets the same timeout, so deadlines come in admission (rid) order: the oldest
request in flight has the nearest one. :class:`Deadlines` keeps one timer, at the oldest
request's deadline; when it fires, every request that is due expires (the owner's ``expire``)
and the timer waits for the next oldest. A request that ends is simply forgotten: the timer,
when it fires, skips it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable


class Deadlines:
    """``timeout``: seconds a request may take (None or 0: no deadline); ``oldest_first()``: the
    rids in flight, oldest first; ``expire(rid)``: a request's deadline passed."""

    def __init__(self, timeout: float | None, oldest_first: Callable[[], Iterable[int]],
                 expire: Callable[[int], None]):
        self.timeout = timeout
        self._oldest_first = oldest_first
        self._expire = expire
        self._at: dict[int, float] = {}  # rid -> loop time its request times out
        self._timer: asyncio.TimerHandle | None = None  # at the oldest request's deadline

    def __len__(self) -> int:
        return len(self._at)

    @property
    def armed(self) -> bool:
        """Whether the timer is set."""
        return self._timer is not None

    def add(self, rid: int) -> None:
        """Request ``rid`` starts (or starts again): its deadline is ``timeout`` from now."""
        if not self.timeout:
            return
        loop = asyncio.get_running_loop()
        self._at[rid] = deadline = loop.time() + self.timeout
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._fire)

    def discard(self, rid: int) -> None:
        """Request ``rid`` ended (the timer, when it fires, waits for the next oldest)."""
        self._at.pop(rid, None)

    def stop(self) -> None:
        """No deadline is left to watch (the pipeline stopped)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = []
        for rid in self._oldest_first():
            deadline = self._at.get(rid)
            if deadline is None:
                continue
            if deadline > now:
                self._timer = loop.call_at(deadline, self._fire)
                break
            due.append(rid)
        for rid in due:
            self._expire(rid)

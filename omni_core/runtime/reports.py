"""Asking the live processes what per-request state they hold: :class:`StateReports` (the
caller's; ``Pipeline.debug_state`` reads it)."""

from __future__ import annotations

import asyncio
import secrets

from . import wire
from .endpoint import Endpoint
from .lifecycle import Lifecycle

__all__ = ["StateReports"]


class StateReports:
    """Sends ``StateQuery`` to the live processes through ``endpoint`` and gathers their
    ``StateReport`` answers."""

    def __init__(self, endpoint: Endpoint, lifecycle: Lifecycle):
        self.endpoint = endpoint
        self.lifecycle = lifecycle
        self._waiting: dict[int, tuple[asyncio.Future, dict[str, dict[str, int]], set[str]]] = {}
        endpoint.on(wire.StateReport, self._on_report)

    def _on_report(self, msg: wire.StateReport) -> None:
        entry = self._waiting.get(msg.token)
        if entry is not None:
            fut, reports, waiting = entry
            reports[msg.process] = dict(msg.state)
            waiting.discard(msg.process)
            if not waiting and not fut.done():
                fut.set_result(None)

    async def gather(self, timeout: float = 5.0) -> dict[str, dict[str, int]]:
        """Per-request state every live process holds (process → table → entries)."""
        token = secrets.randbits(31)
        names = set(self.lifecycle.live_of())
        fut = asyncio.get_running_loop().create_future()
        reports: dict[str, dict[str, int]] = {}
        self._waiting[token] = (fut, reports, set(names))
        try:
            self.lifecycle.tell(self.endpoint, wire.StateQuery(token), names)
            if names:
                await asyncio.wait_for(fut, timeout)
        finally:
            del self._waiting[token]
        return reports

"""Telling the stage processes that requests ended: :class:`Forgetting`.

When a request ends, however it ends, every process that may hold state for it is told, with
the *floor* (every request below it has ended) so that processes drop late messages and their
memory of ended requests: ``Abort`` to all on a failure (or a failed attempt that is retried),
``Forget`` on success to the processes with per-request state only (fan-in stages, stream
targets). Processes that may still remember ended requests are *behind*; once no request is in
flight they get ``Forget(0, floor)``, and their memory goes back to zero.
"""

from __future__ import annotations

from collections.abc import Iterable

from . import wire
from .endpoint import Endpoint
from .lifecycle import Lifecycle


class Forgetting:
    """Posts through ``endpoint`` to the live processes (``lifecycle``)."""

    def __init__(self, endpoint: Endpoint, lifecycle: Lifecycle):
        self.endpoint = endpoint
        self.lifecycle = lifecycle
        self.stateful: list[str] = []  # the processes with per-request state
        self.processes: list[str] = []
        self.behind: set[str] = set()  # processes that may remember ended requests

    def bind(self, stateful: list[str], processes: list[str]) -> None:
        self.stateful, self.processes = stateful, processes

    def tell(self, msg: wire.Message, names: Iterable[str] | None = None) -> None:
        """Post ``msg`` to the live processes among ``names`` (default: all)."""
        self.lifecycle.tell(self.endpoint, msg, names)

    def failed(self, rid: int, floor: int, others: bool) -> None:
        """Request ``rid`` failed (``others``: requests are still in flight)."""
        self.tell(wire.Abort(rid, floor))
        self.behind = set(self.processes) if others else set()

    def done(self, rid: int, floor: int, others: bool) -> None:
        """Request ``rid`` ended with its result."""
        if self.stateful:
            self.tell(wire.Forget(rid, floor), self.stateful)
            if others:
                self.behind.update(self.stateful)
            else:
                self.behind.difference_update(self.stateful)

    def idle(self, floor: int) -> None:
        """No request is in flight: every process that may remember ended requests forgets them."""
        if self.behind:
            self.tell(wire.Forget(0, floor), self.behind)
            self.behind = set()

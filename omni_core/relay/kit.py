"""Building blocks for relays: what the ``shm``, ``nccl`` and ``cuda_ipc`` relays share, public
for third-party relays.

- :func:`wait_for_credit`: the credit wait of a ``put`` — FIFO among waiters, a short spin of
  event-loop yields then sleeps backing off to 5 ms (no core burnt), :class:`RelayTimeout` after
  the relay's ``timeout``, and one more second only once the receiver is seen dead (time for the
  runtime to ``cleanup`` the requests the dead process held).
- :class:`Credits`: ``n`` slots toward one target, each held from ``put`` until the receiver
  writes its ticket back into a shared ledger (or the request is cleaned up).
- :class:`BufferPool`: reused flat byte buffers (new memory is slow: page faults; a warm buffer
  is not).
- :func:`relay_options`: a relay's ``relay.options`` parsed against the schema it registered.
- :func:`receiver_text`: what a :class:`RelayTimeout` says about the receiver.
- :func:`process_alive`: whether a peer process runs, robust to pid reuse.

Importing this module imports neither torch nor any relay.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import attrs

from ..options import OptionsError, Schema, parse_options
from .base import RelayTimeout
from .liveness import process_alive, process_start_time

__all__ = [
    "BufferPool",
    "Credit",
    "CreditWait",
    "Credits",
    "OptionsError",
    "RelayTimeout",
    "dead_wait_text",
    "process_alive",
    "process_start_time",
    "receiver_text",
    "relay_options",
    "wait_for_credit",
]

#: How long a waiting put spins (event-loop yields) before it sleeps.
SPIN_S = 200e-6
#: The longest sleep between two attempts of a waiting put.
MAX_SLEEP_S = 5e-3
#: How long a put still waits once its receiver is seen dead.
DEAD_GRACE_S = 1.0
#: How often a waiting put asks whether its receiver died.
LIVENESS_EVERY_S = 0.1


# -- options --------------------------------------------------------------------------------------

def relay_options(name: str, schema: Schema, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The relay's options from ``RelayContext.options`` with the defaults of ``schema`` filled
    in; keys of other relays are ignored (``omni validate`` reports unknown ones). Raises
    :class:`~omni_core.options.OptionsError` (a ValueError) naming ``relay.options.<key>``."""
    return parse_options(schema, options, "relay.options", owner=f"relay {name!r}", ignore_unknown=True)


# -- waiting for a credit -------------------------------------------------------------------------

@attrs.define
class CreditWait:
    """What a put waiting for credits needs.

    ``waiters``: the FIFO queue of one target's waiting puts (one deque per target, kept by the
    relay). ``timeout``: seconds before :class:`RelayTimeout`. ``receiver_dead()``: whether the
    receiver holding the credits died. ``why(dead)``: the timeout's message. ``closed()``: whether
    the relay was closed meanwhile; then ``closed_error()`` is raised."""

    waiters: collections.deque
    timeout: float
    receiver_dead: Callable[[], bool]
    why: Callable[[bool], str]
    closed: Callable[[], bool] = lambda: False
    closed_error: Callable[[], BaseException] = lambda: RuntimeError("relay closed while a put waited for a credit")


async def wait_for_credit(wait: CreditWait, attempt: Callable[[], Any]) -> Any:
    """``attempt()``'s first non-None result, in FIFO order among the waiters of one queue: at
    once when nobody waits and it succeeds; else spin briefly, then sleep with back-off;
    :class:`RelayTimeout` after ``wait.timeout`` (or :data:`DEAD_GRACE_S` once the receiver is
    seen dead)."""
    if not wait.waiters:
        got = attempt()
        if got is not None:
            return got
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait.timeout
    turn = loop.create_future()
    wait.waiters.append(turn)
    try:
        if wait.waiters[0] is not turn:
            try:
                await asyncio.wait_for(turn, deadline - loop.time())
            except asyncio.TimeoutError:
                raise RelayTimeout(wait.why(False)) from None
        spin_until, sleep, dead, next_check = time.perf_counter() + SPIN_S, 0.0, False, 0.0
        while True:
            if wait.closed():
                raise wait.closed_error()
            got = attempt()
            if got is not None:
                return got
            now = loop.time()
            if now >= deadline:
                raise RelayTimeout(wait.why(dead))
            if not dead and now >= next_check:
                next_check = now + LIVENESS_EVERY_S
                if wait.receiver_dead():
                    dead, deadline = True, min(deadline, now + DEAD_GRACE_S)
            if time.perf_counter() < spin_until:
                await asyncio.sleep(0)
            else:
                sleep = min(max(sleep * 2, 1e-3), MAX_SLEEP_S)
                await asyncio.sleep(min(sleep, max(deadline - now, 0.0)))
    finally:
        wait.waiters.remove(turn)
        if wait.waiters and not wait.waiters[0].done():
            wait.waiters[0].set_result(None)


def dead_wait_text(dead: bool, timeout: float) -> str:
    """How long a timed-out put waited, for its message."""
    return f"{DEAD_GRACE_S:g} s after its receiver died" if dead else f"{timeout:g} s"


def receiver_text(receivers: Iterable[tuple[int, int]], not_joined: str) -> str:
    """``receiver pid N is dead`` / ``is alive but did not release them`` for the first known
    ``(pid, start_time)``; ``not_joined`` when no receiver is known yet."""
    for pid, start in receivers:
        if pid:
            state = "is dead" if not process_alive(pid, start) else "is alive but did not release them"
            return f"receiver pid {pid} {state}"
    return not_joined


# -- credits --------------------------------------------------------------------------------------

class Ledger(Protocol):
    """The shared words a credit lives in: the sender writes ``issue``/``abandon``, the receiver
    writes the ticket back (``released``) when it is done."""

    def issue(self, slot: int, ticket: int) -> None: ...
    def released(self, slot: int) -> int: ...
    def abandon(self, slot: int, ticket: int) -> Any: ...


@attrs.define(eq=False)
class Credit:
    """One held slot: its ``ticket`` (unique per sender, so a late release never frees a reissued
    slot), the request it serves and the ledger its release will appear in."""

    slot: int
    ticket: int
    request_id: int
    ledger: Any


class Credits:
    """The sender's credits toward one target: ``n`` slots, each held from ``put`` until the
    receiver releases it in the ledger (reclaimed lazily) or the request is cleaned up.

    Subclass and override :meth:`abandoned` to undo more than the ledger word when a credit is
    given up unreleased; pass ``credit_type`` for credits that carry more (pins, counters)."""

    def __init__(self, n: int, credit_type: type[Credit] = Credit):
        self.n = n
        self.held: dict[int, Credit] = {}
        self.waiters: collections.deque = collections.deque()
        self._credit_type = credit_type

    def reclaim(self) -> None:
        for credit in [c for c in self.held.values() if c.ledger.released(c.slot) == c.ticket]:
            del self.held[credit.slot]

    def take(self, request_id: int, tickets: itertools.count, ledger: Any) -> Credit | None:
        """A free slot's credit, issued in ``ledger``; None when all ``n`` are held."""
        self.reclaim()
        if len(self.held) >= self.n:
            return None
        slot = next(s for s in range(self.n) if s not in self.held)
        credit = self.held[slot] = self._credit_type(slot, next(tickets), request_id, ledger)
        ledger.issue(slot, credit.ticket)
        return credit

    def free(self, credit: Credit) -> None:
        """Give ``credit`` up (its transfer failed, or its request was cleaned up)."""
        if self.held.get(credit.slot) is credit:
            del self.held[credit.slot]
            self.abandoned(credit)

    def abandoned(self, credit: Credit) -> None:
        """``credit`` was given up before its release: tell the receiver through the ledger."""
        credit.ledger.abandon(credit.slot, credit.ticket)

    def abandon(self, request_id: int) -> None:
        for credit in [c for c in self.held.values() if c.request_id == request_id]:
            self.free(credit)

    def abandon_below(self, floor: int) -> None:
        """Give up the credits of every request below ``floor`` (a relay's ``cleanup_below``)."""
        for credit in [c for c in self.held.values() if c.request_id < floor]:
            self.free(credit)

    def holders(self) -> list[int]:
        """The requests holding credits (for the timeout's message)."""
        self.reclaim()
        return sorted({c.request_id for c in self.held.values()})

    @staticmethod
    def snapshot(credits: Credits | None) -> dict[str, Any]:
        """What a relay's ``open_links()`` shows of a target's credits (None: none made yet):
        ``{"held": [request ids holding one], "waiting": senders waiting for one}``."""
        if credits is None:
            return {"held": [], "waiting": 0}
        return {"held": credits.holders(), "waiting": len(credits.waiters)}

    def ledgers(self) -> list[Any]:
        return list({id(c.ledger): c.ledger for c in self.held.values()}.values())


# -- buffers --------------------------------------------------------------------------------------

class BufferPool:
    """Reusable flat ``uint8`` torch buffers: sizes are rounded up to ``granule`` bytes, a
    buffer serves requests from about half its size up, and at most ``keep`` free buffers are
    kept (the smallest goes first). Thread-safe."""

    def __init__(self, keep: int, granule: int = 4096):
        self.keep = keep
        self.granule = granule
        self.free: list[Any] = []
        self.lock = threading.Lock()

    def take(self, nbytes: int, device: Any = "cpu") -> Any:
        with self.lock:
            fits = [b for b in self.free if nbytes <= b.numel() <= 2 * nbytes + self.granule]
            if fits:
                best = min(fits, key=lambda b: b.numel())
                self.free = [b for b in self.free if b is not best]  # identity: == compares values
                return best
        import torch

        return torch.empty(-(-nbytes // self.granule) * self.granule, dtype=torch.uint8, device=device)

    def give(self, buffer: Any) -> None:
        with self.lock:
            self.free.append(buffer)
            if len(self.free) > self.keep:
                smallest = min(self.free, key=lambda b: b.numel())
                self.free = [b for b in self.free if b is not smallest]

    def clear(self) -> None:
        with self.lock:
            self.free.clear()

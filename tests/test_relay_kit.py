"""omni_core.relay.kit: the credit wait, credit table and buffer pool that the shm, nccl and
cuda_ipc relays share (each relay's own tests cover them under real transfers)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import subprocess
import sys

import pytest

from omni_core.options import positive_int
from omni_core.relay.kit import (
    BufferPool,
    Credits,
    CreditWait,
    RelayTimeout,
    receiver_text,
    relay_options,
    wait_for_credit,
)
from omni_core.testing.waiting import until

pytestmark = pytest.mark.timeout(30)


class FakeLedger:
    """The ledger words of one link, in this process."""

    def __init__(self, n):
        self.issued, self.freed = [0] * n, [0] * n
        self.abandoned = []

    def issue(self, slot, ticket):
        self.issued[slot] = ticket

    def released(self, slot):
        return self.freed[slot]

    def abandon(self, slot, ticket):
        self.abandoned.append((slot, ticket))

    def release(self, slot):  # the receiver's side
        self.freed[slot] = self.issued[slot]


def test_credits_are_reclaimed_when_the_receiver_writes_the_ticket_back():
    ledger, tickets = FakeLedger(2), itertools.count(1)
    credits = Credits(2)
    a, b = credits.take(1, tickets, ledger), credits.take(2, tickets, ledger)
    assert credits.take(3, tickets, ledger) is None
    assert credits.holders() == [1, 2]
    ledger.release(a.slot)
    c = credits.take(3, tickets, ledger)
    assert c.slot == a.slot and c.ticket != a.ticket
    credits.abandon(2)
    assert ledger.abandoned == [(b.slot, b.ticket)] and credits.holders() == [3]


def test_waiters_are_served_in_fifo_order_and_time_out_with_the_relay_s_text():
    async def go():
        ledger, tickets, credits = FakeLedger(1), itertools.count(1), Credits(1)
        wait = CreditWait(credits.waiters, 5.0, lambda: False, lambda dead: f"waited (dead={dead})")
        first = await wait_for_credit(wait, lambda: credits.take(0, tickets, ledger))
        order = []

        async def put(rid):
            credit = await wait_for_credit(wait, lambda: credits.take(rid, tickets, ledger))
            order.append(rid)
            ledger.release(credit.slot)  # the receiver is quick

        tasks = [asyncio.create_task(put(rid)) for rid in (1, 2, 3)]
        await until(lambda: len(credits.waiters) == 3, "the three puts queued for the credit", poll_s=0)
        ledger.release(first.slot)
        await asyncio.gather(*tasks)
        assert order == [1, 2, 3]

        credits.take(9, tickets, ledger)  # held, never released
        short = CreditWait(collections.deque(), 0.05, lambda: False, lambda dead: f"waited (dead={dead})")
        with pytest.raises(RelayTimeout, match=r"waited \(dead=False\)"):
            await wait_for_credit(short, lambda: credits.take(10, tickets, ledger))

    asyncio.run(go())


def test_a_dead_receiver_ends_the_wait_early_and_a_closed_relay_raises_its_error():
    async def go():
        dead = CreditWait(collections.deque(), 60.0, lambda: True, lambda dead: f"dead={dead}")
        with pytest.raises(RelayTimeout, match="dead=True"):
            await wait_for_credit(dead, lambda: None)
        closed = CreditWait(collections.deque(), 60.0, lambda: False, str, lambda: True,
                            lambda: RuntimeError("acme relay: closed"))
        with pytest.raises(RuntimeError, match="acme relay: closed"):
            await wait_for_credit(closed, lambda: None)

    asyncio.run(go())


def test_receiver_text_says_whether_the_receiver_lives():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert receiver_text([(0, 0)], "nobody yet") == "nobody yet"
    assert receiver_text([(os.getpid(), 0)], "-") == f"receiver pid {os.getpid()} is alive but did not release them"
    assert receiver_text([(child.pid, 0)], "-") == f"receiver pid {child.pid} is dead"


def test_relay_options_fill_defaults_ignore_other_relays_keys_and_name_the_path():
    schema = {"credits": positive_int(4)}
    assert relay_options("acme", schema, {"slot_bytes": 1}) == {"credits": 4}
    with pytest.raises(ValueError, match=r"relay.options.credits: expected a positive integer, got 0"):
        relay_options("acme", schema, {"credits": 0})


def test_buffer_pool_reuses_the_smallest_fitting_buffer_and_keeps_a_few():
    pool = BufferPool(keep=2)
    small, large = pool.take(1000, "cpu"), pool.take(100_000, "cpu")
    assert small.numel() == 4096 and large.numel() == 102400
    pool.give(large)
    pool.give(small)
    assert pool.take(50_000, "cpu") is large, "a buffer serves sizes from half its size up"
    assert pool.take(3000, "cpu") is small
    fresh = pool.take(3000, "cpu")
    assert fresh is not small and fresh is not large
    for buffer in (small, large, fresh):
        pool.give(buffer)
    assert len(pool.free) == 2 and all(b is not small for b in pool.free), "the smallest goes first"

"""Waiting in tests without sleeping as synchronisation: poll the state one expects, with a deadline.

A sleep orders nothing on a loaded machine (a CI runner running several tox environments at once);
these helpers wait exactly as long as the state takes, and fail naming what did not happen."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def until(predicate: Callable[[], Any], what: str, deadline_s: float = 30.0, poll_s: float = 0.01) -> None:
    """Poll ``predicate`` every ``poll_s`` seconds (0: every turn of the event loop, for state that
    only the loop's own tasks change) until it holds; an AssertionError naming ``what`` past
    ``deadline_s`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"not within {deadline_s:g} s: {what}")
        await asyncio.sleep(poll_s)


async def suspended(*tasks: asyncio.Task, deadline_s: float = 30.0) -> None:
    """Until every one of ``tasks`` has started and waits on something (its coroutine is
    suspended) or has finished: what a test needs before it acts on what they wait for (grants
    the credit, hands over the payload), without counting turns of the event loop. A task that
    finished instead of waiting is the test's to notice (``assert not task.done()``)."""

    def started_and_waiting(task: asyncio.Task) -> bool:
        coro = task.get_coro()
        return inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_SUSPENDED

    def waiting() -> bool:
        return all(t.done() or started_and_waiting(t) for t in tasks)

    await until(waiting, f"{len(tasks)} task(s) started and waiting", deadline_s, poll_s=0)


def holds_within(predicate: Callable[[], Any], deadline_s: float = 30.0, poll_s: float = 0.02) -> bool:
    """Whether ``predicate`` holds within ``deadline_s`` seconds, polled every ``poll_s`` (for
    synchronous tests: ``assert holds_within(lambda: client.get("/ready").status_code == 503)``);
    it is asked once more at the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(poll_s)
    return bool(predicate())


async def events_until(conn: Any, kind: str, seen: list | None = None, timeout: float = 60.0) -> list:
    """The events of an async-iterable connection (the official SDK's realtime connection, say) up
    to and including the first of type ``kind``, appended to ``seen`` when given; an
    AssertionError listing what came if the connection closes first or ``timeout`` passes."""
    events = [] if seen is None else seen

    async def read() -> list:
        async for event in conn:
            events.append(event)
            if event.type == kind:
                return events
        raise AssertionError(f"the connection closed before {kind}: {[e.type for e in events]}")

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"no {kind} within {timeout:g} s; got {[e.type for e in events]}") from None

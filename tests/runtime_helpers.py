"""Helpers for multi-process runtime tests: run a coroutine with a deadline, and check that a
test leaves no process, runtime directory, socket file or /dev/shm segment behind."""

from __future__ import annotations

import asyncio

import pytest

from omni_core.testing.leaks import (  # noqa: F401 - re-exported for the runtime tests
    assert_nothing_left,
    descendants,
    no_leaks,
    runtime_dirs,
    shm_segments,
    stage_processes,
)
from omni_core.testing.waiting import until  # noqa: F401 - re-exported for the runtime tests

STAGES = "omni_test_stages"


def arun(coro, timeout: float = 60):
    """Run ``coro`` to completion within ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until_state(p, predicate, what: str, deadline_s: float = 30.0) -> dict:
    """Poll ``p.debug_state()`` until ``predicate(state)`` holds and return that state; fail naming
    ``what`` at the deadline. The way to wait for "the request reached stage s"
    (``state["s"]["stage.s.running"]``) instead of sleeping long enough for it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while True:
        state = await p.debug_state()
        if predicate(state):
            return state
        if loop.time() > deadline:
            pytest.fail(f"not within {deadline_s:g} s: {what} (last state {state})")
        await asyncio.sleep(0.02)


async def settle(p, deadline_s: float = 20.0, ignore: tuple[str, ...] = ()) -> dict:
    """Wait until no process holds per-request state (the end of a request reaches every process
    a moment after the caller hears of it; the tables named in ``ignore`` aside); returns what is
    left at the deadline (empty when all is freed), by process and table."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while True:
        state = await p.debug_state()
        left = {proc: {k: v for k, v in tables.items() if v and k not in ignore} for proc, tables in state.items()}
        left = {proc: tables for proc, tables in left.items() if tables}
        if not left or loop.time() > deadline:
            return left
        await asyncio.sleep(0.05)


def journal_runs(journal: str, pid: int) -> set[str]:
    """The request ids process ``pid`` started a call for, as the ``Journal`` stage wrote them
    (its processes may be writing: a line not yet whole is left out)."""
    try:
        with open(journal) as f:
            entries = [line.split() for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return set()
    return {words[1] for words in entries if len(words) == 2 and words[0] == str(pid)}


async def under_load(tasks, journal: str, pid: int, served: int = 0) -> None:
    """Until ``served`` of the request ``tasks`` were answered, then until process ``pid`` (a
    ``Journal`` stage writing to ``journal``) starts one more call: the moment a test kills it
    under load, with requests answered before, in its hands, and still to come."""
    await until(lambda: sum(t.done() for t in tasks) >= served, f"{served} requests answered", 60)
    before = len(journal_runs(journal, pid))
    await until(lambda: len(journal_runs(journal, pid)) > before, f"process {pid} starting a call", 60)


def running_in(process: str, stage_name: str | None = None):
    """An :func:`until_state` predicate: ``stage_name`` (default: the process's name) in
    ``process`` is running at least one request."""
    key = f"stage.{stage_name or process}.running"
    return lambda state: state.get(process, {}).get(key, 0) > 0


def stage(name: str, factory: str, **fields) -> dict:
    """A stage config entry whose factory lives in the test stages module."""
    return {"name": name, "factory": f"{STAGES}:{factory}", **fields}


def fn(name: str) -> str:
    return f"{STAGES}:{name}"


def pipeline(*stages: dict, **fields) -> dict:
    return {"name": fields.pop("name", "test"), "stages": list(stages), **fields}

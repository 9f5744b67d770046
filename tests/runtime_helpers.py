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

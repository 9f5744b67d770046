"""Stage calls start eagerly (up to their first suspension, inside the callback that received the
payload, without a task until they suspend): what a task gives a call still holds from its first
line — ``asyncio.current_task()``, ``asyncio.timeout()``, a context of its own, cancellation by
an abort — whether the call suspends or not."""

from __future__ import annotations

import asyncio
import contextvars

import pytest
from runtime_helpers import arun, no_leaks  # noqa: F401

from omni_core import Pipeline, RequestAborted, StageError

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]

_seen: contextvars.ContextVar[str] = contextvars.ContextVar("seen", default="")


class Checks:
    """Reports what its first step sees; ``mode`` picks what it does after."""

    async def __call__(self, payload, ctx):
        before = _seen.get()  # another call's first step must not leak into this one
        _seen.set(ctx.request_id)
        task = asyncio.current_task()
        mode = payload["mode"]
        if mode == "timeout":  # a timeout entered in the first step fires after it suspends
            async with asyncio.timeout(0.05):
                await asyncio.sleep(30)
        if mode == "sleep0":  # the behaviour under test: a call that suspends once
            await asyncio.sleep(0)
        if mode == "group":
            async with asyncio.TaskGroup() as group:
                child = group.create_task(asyncio.sleep(0, result=7))
            return {"child": child.result(), "before": before}
        if mode == "hang":
            await asyncio.sleep(30)
        async with asyncio.timeout(5):  # usable from the first line
            pass
        return {
            "task": task is not None,
            "before": before,
            "same": _seen.get() == ctx.request_id,
            "after": asyncio.current_task() is not None,
        }


def _cfg() -> dict:
    return {
        "name": "hotpath-eager",
        "stages": [
            {"name": "a", "factory": "test_stage_eager_start:Checks", "next": "b"},
            {"name": "b", "factory": "omni_test_stages:Echo", "terminal": True},
        ],
    }


def test_a_call_sees_a_task_and_its_own_context_from_its_first_line():
    async def body():
        async with Pipeline(_cfg()) as p:
            plain = await asyncio.gather(*(p.submit({"mode": "plain"}) for _ in range(8)))
            slept = await asyncio.gather(*(p.submit({"mode": "sleep0"}) for _ in range(8)))
            grouped = await p.submit({"mode": "group"})
            return plain, slept, grouped

    plain, slept, grouped = arun(body())
    for result in plain + slept:
        assert result == {"task": True, "before": "", "same": True, "after": True}
    assert grouped == {"child": 7, "before": ""}


def test_a_timeout_entered_in_the_first_step_cancels_the_call_after_it_suspends():
    async def body():
        async with Pipeline(_cfg()) as p:
            with pytest.raises(StageError) as info:
                await p.submit({"mode": "timeout"})
            ok = await p.submit({"mode": "plain"})  # the stage keeps serving
            return info.value, ok

    error, ok = arun(body())
    assert error.error_type == "TimeoutError" and error.stage == "a"
    assert ok["task"] is True


def test_an_abort_cancels_a_call_that_suspended_after_its_eager_start():
    async def body():
        async with Pipeline(_cfg()) as p:
            task = asyncio.ensure_future(p.submit({"mode": "hang"}, request_id="h"))
            deadline = asyncio.get_running_loop().time() + 30
            while (await p.debug_state()).get("a", {}).get("stage.a.running", 0) == 0:
                assert asyncio.get_running_loop().time() < deadline, "the call never started"
            assert await p.abort("h")
            with pytest.raises(RequestAborted):
                await task
            while (await p.debug_state()).get("a", {}).get("stage.a.running", 1) != 0:
                assert asyncio.get_running_loop().time() < deadline, "the aborted call kept running"
            return await p.submit({"mode": "plain"})

    assert arun(body())["task"] is True

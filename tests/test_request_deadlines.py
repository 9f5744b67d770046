"""One timer watches every request's deadline (they come in admission order): each slow request
times out, in order, however many are in flight and whatever finished around them, and a fast
one admitted between them is not touched."""

from __future__ import annotations

import asyncio

import pytest
from runtime_helpers import arun, no_leaks, pipeline, stage  # noqa: F401

from omni_core import Pipeline
from omni_core.errors import RequestTimeout

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]


def test_every_slow_request_times_out_and_the_fast_ones_between_them_finish():
    cfg = pipeline(stage("s", "Sleep", terminal=True), limits={"request_timeout": 0.5})

    async def body():
        async with Pipeline(cfg) as p:
            slow = []
            fast = []
            for i in range(3):  # admitted at different times: three different deadlines
                slow.append(asyncio.ensure_future(p.submit({"sleep": 30}, request_id=f"slow-{i}")))
                fast.append(await p.submit({"sleep": 0, "i": i}, request_id=f"fast-{i}"))
            outcomes = await asyncio.gather(*slow, return_exceptions=True)
            after = await p.submit({"sleep": 0}, request_id="after")  # the timer re-arms later
            state = await p.debug_state()
            return fast, outcomes, after, state["coordinator"]

    fast, outcomes, after, coordinator = arun(body())
    assert fast == [{"sleep": 0, "i": i} for i in range(3)]
    assert all(isinstance(o, RequestTimeout) for o in outcomes), outcomes
    assert [o.request_id for o in outcomes] == ["slow-0", "slow-1", "slow-2"]
    assert after == {"sleep": 0}
    assert coordinator == {"requests": 0, "by_id": 0, "ordered": 0}

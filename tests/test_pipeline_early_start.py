"""``can_accept_stream_before_payload: true``: the stage's call starts on its first stream chunk
when that comes before its payload, and ``await ctx.payload()`` hands the payload over later.

Every pipeline here streams more chunks than ``limits.stream_buffer`` holds before the reader's
payload can come, so a reader that waited for its payload to start would stall its producer:
only a call started on the first chunk lets these requests finish."""

from __future__ import annotations

import asyncio
import threading
import types

import pytest
import torch
from runtime_helpers import arun, fn, no_leaks, pipeline, settle, stage  # noqa: F401

from omni_core import PENDING, Pipeline, RequestAborted, StageError
from omni_core.errors import RequestTimeout
from omni_core.runtime.context import CallState, PayloadPending, StageContext
from omni_core.runtime.flow import Window
from omni_core.testing.waiting import suspended

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]

#: Credits per stream: the producers below emit more chunks than this before the payload.
LIMITS = {"stream_buffer": 2, "stream_stall_timeout": 20}
PLACEMENTS = {"across-processes": {}, "one-process": {"process": "p"}}


async def read_marker(path, want: str, deadline_s: float = 30.0) -> str:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    text = ""
    while loop.time() < deadline:
        try:
            text = path.read_text()
        except FileNotFoundError:
            text = ""
        if text == want:
            break
        await asyncio.sleep(0.01)
    return text


@pytest.mark.parametrize("ask", [True, False], ids=["payload-awaited", "payload-not-asked-for"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_the_call_starts_on_the_first_chunk_and_awaits_the_payload_later(placement, ask):
    """``tok`` streams 12 chunks to ``reader``, then returns the reader's payload (with a 1 MiB
    tensor, through shared memory across processes): the reader starts on the first chunk with
    ``PENDING`` and gets the payload from ``ctx.payload()``; a call that returns without asking
    for it has it dropped, and nothing is left either way."""
    where = PLACEMENTS[placement]
    cfg = pipeline(
        stage("tok", "StreamThenReturn", stream_to=["reader"], next="reader", **where),
        stage("reader", "EarlyReader", args={"source": "tok", "ask": ask}, terminal=True,
              can_accept_stream_before_payload=True, **where),
        limits=LIMITS,
    )
    x = torch.arange(1 << 18, dtype=torch.float32)

    async def body():
        async with Pipeline(cfg) as p:
            results = await asyncio.gather(*(p.submit({"n": 12, "x": x + r}) for r in range(3)))
            return results, await settle(p)

    results, left = arun(body(), timeout=100)
    for r, result in enumerate(results):
        assert result["early"] is True and result["got"] == list(range(12))
        if ask:
            assert result["payload"]["n"] == 12 and torch.equal(result["payload"]["x"], x + r)
        else:
            assert result["payload"] is None
    assert left == {}, f"per-request state left: {left}"


def test_a_fan_in_stage_starts_on_a_chunk_and_gets_the_merged_payload():
    cfg = pipeline(
        stage("src", "Echo", next=["tok", "side"]),
        stage("tok", "StreamThenReturn", stream_to=["reader"], next="reader"),
        stage("side", "Echo", next="reader"),
        stage("reader", "EarlyReader", args={"source": "tok"}, wait_for=["tok", "side"], merge_fn=fn("concat"),
              terminal=True, can_accept_stream_before_payload=True),
        limits=LIMITS,
    )

    async def body():
        async with Pipeline(cfg) as p:
            results = await asyncio.gather(*(p.submit({"n": 10, "text": f"t{r}"}) for r in range(3)))
            return results, await settle(p)

    results, left = arun(body(), timeout=100)
    assert results == [{"early": True, "got": list(range(10)), "payload": {"text": f"t{r}+t{r}"}} for r in range(3)]
    assert left == {}


def _waiting_cfg(where: dict, slow: str, marker, **limits) -> dict:
    """``reader`` gets ``tok``'s chunks at once; its payload comes from ``slow``."""
    return pipeline(
        stage("src", "Echo", next=["tok", "slow"]),
        stage("tok", "StreamThenReturn", stream_to=["reader"], terminal=True),
        stage("slow", slow, next="reader", **where),
        stage("reader", "EarlyReader", args={"source": "tok", "marker": str(marker)}, terminal=True,
              can_accept_stream_before_payload=True, **where),
        limits={**LIMITS, **limits},
    )


@pytest.mark.parametrize("end", ["abort", "timeout"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_call_waiting_for_a_payload_that_never_comes_ends_with_the_request(tmp_path, placement, end):
    """The reader read every chunk and waits for a payload ``slow`` holds back: aborting the
    request (or its timeout) cancels the wait, frees everything, and the stage serves on."""
    marker = tmp_path / "reader"
    cfg = _waiting_cfg(PLACEMENTS[placement], "Sleep", marker, **({"request_timeout": 3} if end == "timeout" else {}))

    async def body():
        async with Pipeline(cfg) as p:
            held = asyncio.ensure_future(p.submit({"n": 6, "sleep": 60}, request_id="held"))
            assert await read_marker(marker, "started") == "started"
            if end == "abort":
                assert await p.abort("held") is True
            with pytest.raises(RequestAborted if end == "abort" else RequestTimeout):
                await held
            cancelled = await read_marker(marker, "cancelled")
            left = await settle(p)
            after = await p.submit({"n": 3, "sleep": 0})
            return cancelled, left, after

    cancelled, left, after = arun(body(), timeout=100)
    assert cancelled == "cancelled", "the reader's wait for its payload was cancelled"
    assert left == {}
    after["reader"].pop("early")  # a payload not held back may come first: either start is right
    assert after["reader"] == {"got": [0, 1, 2], "payload": {"n": 3, "sleep": 0}}


@pytest.mark.parametrize("who", ["payload-stage", "reader"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_an_error_while_the_call_waits_for_its_payload_fails_the_request_only(tmp_path, placement, who):
    """The stage that would send the payload fails once the reader has started (or the reader
    itself fails before asking for it): the request fails naming that stage, the reader's wait
    ends, nothing is left, and the pipeline serves on."""
    marker = tmp_path / "reader"
    where = PLACEMENTS[placement]
    if who == "payload-stage":
        cfg = _waiting_cfg(where, "FailAtGate", marker)
    else:
        cfg = pipeline(
            stage("tok", "StreamThenReturn", stream_to=["reader"], next="reader", **where),
            stage("reader", "EarlyReader", args={"source": "tok", "marker": str(marker), "raise_first": True},
                  terminal=True, can_accept_stream_before_payload=True, **where),
            limits=LIMITS,
        )

    async def body():
        async with Pipeline(cfg) as p:
            with pytest.raises(StageError) as info:
                await p.submit({"n": 6, "gate": str(marker)})
            state = await read_marker(marker, "cancelled") if who == "payload-stage" else None
            left = await settle(p)
            with pytest.raises(StageError):  # it serves on (and fails the same way)
                await p.submit({"n": 2, "gate": str(marker)})
            return info.value, state, left

    error, state, left = arun(body(), timeout=100)
    if who == "payload-stage":
        assert error.stage == "slow" and "the payload's stage failed" in str(error)
        assert state == "cancelled"
    else:
        assert error.stage == "reader" and "failed before its payload came" in str(error)
    assert left == {}


def test_a_tensor_parallel_stage_starts_on_a_chunk_on_every_rank():
    """The leader hands the chunk that starts its call, then the payload, to its follower: both
    ranks start on the chunk, get the payload and all-reduce."""
    cfg = pipeline(
        stage("tok", "StreamThenReturn", stream_to=["tp"], next="tp"),
        stage("tp", "EarlyAllReduce", args={"source": "tok"}, tp_size=2, terminal=True,
              can_accept_stream_before_payload=True),
        limits=LIMITS,
    )

    async def body():
        async with Pipeline(cfg) as p:
            results = [await p.submit({"n": 8, "x": torch.full((4,), float(r))}) for r in range(3)]
            return results, await settle(p)

    results, left = arun(body(), timeout=110)
    for r, result in enumerate(results):
        assert result["early"] is True and result["got"] == list(range(8))
        assert torch.equal(result["x"], torch.full((4,), 3.0 * r))
    assert left == {}


# -- the context's side, without a pipeline ------------------------------------------------------


def test_pending_refuses_to_be_used_as_a_payload_and_says_what_to_do():
    for use in (lambda: PENDING["text"], lambda: PENDING.get("text"), lambda: list(PENDING), lambda: "a" in PENDING):
        with pytest.raises(PayloadPending, match=r"payload = await ctx\.payload\(\)"):
            use()
    assert repr(PENDING) == "omni_core.PENDING"


def test_payload_returns_at_once_when_given_and_waits_otherwise_from_a_thread_too():
    runtime = types.SimpleNamespace(name="s")

    async def body():
        given = StageContext(runtime, 1, "r1", {"a": 1})
        assert await given.payload() == {"a": 1}
        call = CallState(asyncio.get_running_loop())
        ctx = StageContext(runtime, 2, "r2", call=call)
        waiter = asyncio.ensure_future(ctx.payload())
        got: list = []
        thread = threading.Thread(target=lambda: got.append(ctx.payload_threadsafe(timeout=10)))
        thread.start()
        await suspended(waiter)
        assert not waiter.done()
        call.arrive({"b": 2})
        assert await waiter == {"b": 2}
        await asyncio.to_thread(thread.join, 10)
        assert got == [{"b": 2}]
        call.end()
        with pytest.raises(Exception, match="after its call ended"):
            await ctx.payload()
        pending_call = CallState(asyncio.get_running_loop())
        pending = StageContext(runtime, 3, "r3", call=pending_call)
        cancelled = asyncio.ensure_future(pending.payload())
        await suspended(cancelled)
        pending_call.end()  # the call ended while a helper task still waited
        with pytest.raises(asyncio.CancelledError):
            await cancelled

    arun(body())


def test_a_window_wait_cancelled_as_its_credit_comes_raises_cancelled():
    """An abort that cancels ``ctx.emit`` just as a credit comes ends the call: it never takes the
    credit and goes on emitting for an ended request (``asyncio.wait_for`` on Python 3.11 returned
    instead, and the stream's windows outlived the request)."""

    async def body():
        for turns in range(4):  # the cancel comes 0..3 loop turns after the credit
            window = Window(0)
            task = asyncio.ensure_future(window.acquire(30, lambda: "the stream"))
            await suspended(task)
            window.grant(1)
            for _ in range(turns):  # the scenario, not a synchronisation: where the cancel lands
                await asyncio.sleep(0)
            requested = task.cancel()  # False once the task has already taken its credit
            await asyncio.wait([task])
            assert task.cancelled() == requested, f"cancelled {turns} turns after the credit"
            assert window.credits == (1 if requested else 0)

    arun(body())


def test_several_tasks_waiting_on_one_window_each_get_a_credit_as_it_comes():
    """One call may emit to one reader from several tasks (the talker forwards text from a reader
    task while its loop emits codes): every waiter wakes on a grant, none waits for the stall
    timeout because another took the wake-up."""

    async def body():
        window = Window(0)
        tasks = [asyncio.ensure_future(window.acquire(30, lambda: "the stream")) for _ in range(3)]
        await suspended(*tasks)
        for _ in range(3):
            window.grant(1)
            done, _ = await asyncio.wait(tasks, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            assert done, "a granted credit woke no waiter"
            tasks = [t for t in tasks if not t.done()]
        assert not tasks and window.credits == 0 and window.waiting == 0

    arun(body())


def test_without_the_flag_a_reader_whose_payload_follows_the_stream_stalls_it():
    """The contrast: the same wiring without ``can_accept_stream_before_payload`` holds the chunks
    for a call that cannot start before the stream ends, and the producer's stall names both
    stages and the flag."""
    cfg = pipeline(
        stage("tok", "StreamThenReturn", stream_to=["reader"], next="reader"),
        stage("reader", "EarlyReader", args={"source": "tok"}, terminal=True),
        limits={"stream_buffer": 2, "stream_stall_timeout": 1},
    )

    async def body():
        async with Pipeline(cfg) as p:
            with pytest.raises(StageError) as info:
                await p.submit({"n": 12})
            return info.value, await settle(p)

    error, left = arun(body())
    assert error.stage == "tok" and error.error_type == "StreamStalled"
    assert "stage 'tok' to stage 'reader'" in str(error) and "can_accept_stream_before_payload" in str(error)
    assert left == {}

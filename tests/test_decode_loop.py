"""The continuous-batching decode loop with a fake model: join/leave, aborts, admission, FIFO
fairness, error isolation, chunked prefill interleaved with decodes, rows that wait for input."""

from __future__ import annotations

import asyncio
import functools
import threading

import pytest

from omni_core import DecodeLoop
from omni_core.kits import NO_OUTPUT, LoopClosed, SequenceTooLarge, StepError
from omni_core.testing import waiting

pytestmark = pytest.mark.timeout(30)


#: polls every millisecond: these rows step fast, a test must see the state it waits for before they move on
until = functools.partial(waiting.until, poll_s=0.001)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


class Req:
    """A fake request: a prompt of ``prompt`` tokens, then ``n`` outputs ``base, base+1, ...``."""

    def __init__(self, name, n, prompt=0, base=0, poison=False):
        self.name, self.n, self.prompt, self.base, self.poison = name, n, prompt, base, poison
        self.made = 0
        self.chunks: list[tuple[int, int]] = []


class FakeModel:
    """Records each step's rows as (name, chunk or "d"); a poisoned row makes the whole step raise."""

    def __init__(self):
        self.steps: list[list[tuple[str, object]]] = []
        self.threads: set[str] = set()
        self.gate: threading.Event | None = None

    def __call__(self, rows):
        self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            self.gate.wait(10)
        if any(r.state.poison for r in rows):
            raise RuntimeError("poisoned row")
        self.steps.append([(r.state.name, r.prefill if r.prefill is not None else "d") for r in rows])
        out = []
        for row in rows:
            st = row.state
            if row.prefill is not None:
                st.chunks.append(row.prefill)
                if not row.prefill_done:
                    out.append(NO_OUTPUT)
                    continue
            value = st.base + st.made + (row.input or 0)
            st.made += 1
            if st.made >= st.n:
                row.finish()
            out.append(value)
        return out


async def consume(loop, req, memory=0, log=None, needs_input=False, feed=None):
    outs = []
    async with loop.join(req, prompt_tokens=req.prompt, memory=memory, needs_input=needs_input) as seq:
        if log is not None:
            log.append(("in", req.name))
        if feed:
            for value in feed:
                seq.feed(value)
        async for value in seq:
            outs.append(value)
    if log is not None:
        log.append(("out", req.name))
    return outs


def test_rows_join_and_leave_between_steps_and_each_gets_its_own_outputs_in_one_step_per_iteration():
    model = FakeModel()

    async def body():
        loop = DecodeLoop(model, max_batch_size=8)
        first = asyncio.ensure_future(consume(loop, Req("a", 6, base=100)))
        await until(lambda: loop.stats.steps >= 2, "the first row stepped twice")
        rest = [asyncio.ensure_future(consume(loop, Req(n, k, base=b))) for n, k, b in (("b", 3, 200), ("c", 9, 300))]
        results = await asyncio.gather(first, *rest)
        assert loop.live == 0 and loop.memory_in_use == 0
        await loop.close()
        return results, loop.stats

    results, stats = run(body())
    assert results == [list(range(100, 106)), list(range(200, 203)), list(range(300, 309))]
    assert stats.largest >= 2  # rows that were live together shared a step
    assert stats.finished == 3 and stats.admitted == 3
    assert all(name not in ("MainThread",) for name in model.threads)  # the step ran in a worker thread
    for step in model.steps:  # never two entries for one row in a step
        names = [n for n, _ in step]
        assert len(names) == len(set(names))


def test_abort_mid_batch_leaves_the_others_correct_and_gives_memory_back():
    model = FakeModel()

    async def body():
        loop = DecodeLoop(model, max_batch_size=8, memory_budget=100, max_pending_outputs=1)
        keep = [asyncio.ensure_future(consume(loop, Req(f"k{i}", 30, base=1000 * i), memory=10)) for i in range(3)]
        doomed = [asyncio.ensure_future(consume(loop, Req(f"x{i}", 10_000), memory=20)) for i in range(2)]
        await until(lambda: loop.live == 5 and loop.memory_in_use == 70, "the five rows live, holding 70")
        for task in doomed:
            task.cancel()
        kept = await asyncio.gather(*keep)
        for task in doomed:
            with pytest.raises(asyncio.CancelledError):
                await task
        assert loop.live == 0 and loop.memory_in_use == 0
        await loop.close()
        return kept, loop.stats

    kept, stats = run(body())
    assert kept == [list(range(1000 * i, 1000 * i + 30)) for i in range(3)]
    assert stats.aborted == 2 and stats.finished == 3


def test_admission_waits_for_room_in_batch_size_and_memory_never_overcommits():
    model = FakeModel()
    peak = {"live": 0, "memory": 0}

    async def body():
        loop = DecodeLoop(model, max_batch_size=3, memory_budget=50)
        orig = model.__call__

        def watch(rows):
            peak["live"] = max(peak["live"], loop.live)
            peak["memory"] = max(peak["memory"], loop.memory_in_use)
            return orig(rows)

        loop.step = watch
        reqs = [Req(f"r{i}", 4 + i % 3, base=10 * i) for i in range(10)]
        mems = [10, 30, 20, 5, 40, 10, 10, 25, 1, 50]
        results = await asyncio.gather(*(consume(loop, r, memory=m) for r, m in zip(reqs, mems, strict=True)))
        with pytest.raises(SequenceTooLarge, match="memory_budget"):
            loop.join(Req("huge", 1), memory=51)
        await loop.close()
        return reqs, results

    reqs, results = run(body())
    assert results == [list(range(r.base, r.base + r.n)) for r in reqs]
    assert peak["live"] <= 3 and peak["memory"] <= 50


def test_admission_is_fifo_a_small_late_row_does_not_overtake():
    model = FakeModel()
    model.gate = threading.Event()  # big's steps wait here until mid and small queued
    log: list = []

    async def body():
        loop = DecodeLoop(model, max_batch_size=4, memory_budget=10)
        big = asyncio.ensure_future(consume(loop, Req("big", 5), memory=8, log=log))
        await until(lambda: loop.live == 1, "big admitted")
        waiting = asyncio.ensure_future(consume(loop, Req("mid", 3), memory=6, log=log))
        await until(lambda: loop.waiting == 1, "mid waiting for memory")
        small = asyncio.ensure_future(consume(loop, Req("small", 3), memory=1, log=log))  # would fit now
        await until(lambda: loop.waiting == 2, "small waiting behind mid")
        assert loop.live == 1
        model.gate.set()
        await asyncio.gather(big, waiting, small)
        await loop.close()

    run(body())
    entered = [name for kind, name in log if kind == "in"]
    assert entered == ["big", "mid", "small"]
    assert log.index(("out", "big")) < log.index(("in", "mid"))


def test_a_step_that_raises_is_run_row_by_row_and_only_the_culprit_fails():
    model = FakeModel()

    async def body():
        loop = DecodeLoop(model, max_batch_size=8)
        good = [asyncio.ensure_future(consume(loop, Req(f"g{i}", 8, base=10 * i))) for i in range(3)]
        bad = asyncio.ensure_future(consume(loop, Req("bad", 8, poison=True)))
        results = await asyncio.gather(*good, bad, return_exceptions=True)
        after = await consume(loop, Req("after", 2, base=7))
        await loop.close()
        return results, after, loop.stats

    results, after, stats = run(body())
    assert results[:3] == [list(range(10 * i, 10 * i + 8)) for i in range(3)]
    assert isinstance(results[3], RuntimeError) and "poisoned" in str(results[3])
    assert after == [7, 8]
    assert stats.isolations >= 1 and stats.failed == 1


def test_an_exception_result_fails_its_row_only_and_a_wrong_result_count_is_a_clear_error():
    async def body():
        def step(rows):
            return [ValueError(f"bad {r.state}") if r.state == "x" else r.state for r in rows]

        loop = DecodeLoop(step)

        async def one(state):
            async with loop.join(state) as seq:
                async for value in seq:
                    seq.finish()
                    return value

        got = await asyncio.gather(one("a"), one("x"), one("b"), return_exceptions=True)
        await loop.close()
        broken = DecodeLoop(lambda rows: [], name="broken")
        with pytest.raises(StepError, match="returned 0 results for 1 rows"):
            await _first(broken, "a")
        await broken.close()
        return got

    got = run(body())
    assert got[0] == "a" and got[2] == "b"
    assert isinstance(got[1], ValueError) and "bad x" in str(got[1])


async def _first(loop, state):
    async with loop.join(state) as seq:
        async for value in seq:
            return value


def test_a_long_prompt_is_prefilled_in_chunks_while_running_rows_decode_at_every_step():
    model = FakeModel()

    async def body():
        loop = DecodeLoop(model, max_batch_size=8, max_prefill_tokens=4)
        runners = [asyncio.ensure_future(consume(loop, Req(f"run{i}", 40, base=100 * i))) for i in range(2)]
        await until(lambda: loop.stats.steps >= 3, "the running rows stepped")
        long = Req("long", 3, prompt=22, base=7)
        got = await consume(loop, long)
        await asyncio.gather(*runners)
        await loop.close()
        return long, got

    long, got = run(body())
    assert got == [7, 8, 9]
    assert long.chunks == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 22)]
    prefill_steps = [s for s in model.steps if any(n == "long" and c != "d" for n, c in s)]
    assert len(prefill_steps) == 6
    for step in prefill_steps:  # every prompt chunk shared its step with both running decodes
        assert {("run0", "d"), ("run1", "d")} <= set(step)
        assert sum(c[1] - c[0] for n, c in step if c != "d") <= 4


def test_rows_waiting_for_input_skip_steps_without_holding_the_others():
    model = FakeModel()

    async def body():
        loop = DecodeLoop(model, max_batch_size=4)
        req = Req("fed", 3, base=0)
        free = asyncio.ensure_future(consume(loop, Req("free", 20, base=50)))
        outs = []
        async with loop.join(req, needs_input=True) as seq:
            seq.feed(1000)
            outs.append(await seq.__anext__())
            before = loop.stats.steps
            # no input: the others go on without this row
            await until(lambda: loop.stats.steps >= before + 5, "five steps without the fed row")
            assert req.made == 1
            seq.feed(2000)
            seq.close_inputs()  # then it steps on without input
            outs += [v async for v in seq]
        await free
        await loop.close()
        return outs, await free

    outs, free = run(body())
    assert outs == [1000, 2001, 2]
    assert free == list(range(50, 70))


def test_a_slow_reader_holds_only_its_own_row():
    model = FakeModel()

    async def body():
        loop = DecodeLoop(model, max_batch_size=4, max_pending_outputs=2)
        slow = Req("slow", 10)
        async with loop.join(slow) as seq:
            fast = await consume(loop, Req("fast", 12, base=500))
            held = slow.made
            rest = [v async for v in seq]
        await loop.close()
        return fast, held, rest

    fast, held, rest = run(body())
    assert fast == list(range(500, 512))
    assert held == 2  # it stepped until two outputs were unread, then waited
    assert rest == list(range(10))


def test_close_fails_live_and_waiting_rows():
    model = FakeModel()
    model.gate = threading.Event()

    async def body():
        loop = DecodeLoop(model, max_batch_size=1)
        live = asyncio.ensure_future(consume(loop, Req("live", 5)))
        await until(lambda: loop.live == 1, "the first row admitted")
        waiting = asyncio.ensure_future(consume(loop, Req("waiting", 5)))
        await until(lambda: loop.waiting == 1, "the second row waiting")
        await loop.close()
        model.gate.set()
        results = await asyncio.gather(live, waiting, return_exceptions=True)
        with pytest.raises(LoopClosed):
            await consume(loop, Req("late", 1))
        return results

    results = run(body())
    assert all(isinstance(r, LoopClosed) for r in results)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(TypeError, match="callable"):
        DecodeLoop(None)
    with pytest.raises(ValueError, match="max_batch_size"):
        DecodeLoop(lambda rows: rows, max_batch_size=0)
    with pytest.raises(ValueError, match="memory_budget"):
        DecodeLoop(lambda rows: rows, memory_budget=-1)
    loop = DecodeLoop(lambda rows: rows)
    with pytest.raises(ValueError, match="prompt_tokens"):
        loop.join("s", prompt_tokens=-1)


def test_a_loop_serves_again_from_a_new_event_loop_once_its_first_one_is_closed():
    model = FakeModel()
    loop = DecodeLoop(model, max_batch_size=4)
    assert run(consume(loop, Req("a", 3))) == [0, 1, 2]
    assert run(consume(loop, Req("b", 2, base=5))) == [5, 6]  # asyncio.run again: a new event loop
    assert loop.live == 0 and loop.memory_in_use == 0

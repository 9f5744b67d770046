"""The dynamic micro-batcher: batch formation, result mapping, errors, cancellation, threads."""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_core.kits import BatcherClosed, BatchError, MicroBatcher
from omni_core.testing import waiting

pytestmark = pytest.mark.timeout(30)


#: polls every millisecond: these rows step fast, a test must see the state it waits for before they move on
until = functools.partial(waiting.until, poll_s=0.001)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


class Recorder:
    """An async batch function that records every batch and squares the items."""

    def __init__(self):
        self.batches: list[list] = []

    async def __call__(self, items):
        self.batches.append(list(items))
        return [x * x for x in items]


def test_concurrent_submits_form_one_batch_and_each_caller_gets_its_own_result():
    fn = Recorder()

    async def body():
        batcher = MicroBatcher(fn, max_batch_size=8, max_wait=0.05)
        results = await asyncio.gather(*(batcher.submit(i) for i in range(5)))
        await batcher.close()
        return results, batcher.stats

    results, stats = run(body())
    assert results == [0, 1, 4, 9, 16]
    assert fn.batches == [[0, 1, 2, 3, 4]]
    assert (stats.batches, stats.items, stats.largest, stats.sizes) == (1, 5, 5, {5: 1})


def test_max_batch_size_splits_in_arrival_order():
    fn = Recorder()

    async def body():
        batcher = MicroBatcher(fn, max_batch_size=4, max_wait=0.05)
        results = await asyncio.gather(*(batcher.submit(i) for i in range(10)))
        await batcher.close()
        return results

    assert run(body()) == [i * i for i in range(10)]
    assert fn.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_a_full_batch_does_not_wait_for_max_wait():
    fn = Recorder()

    async def body():
        batcher = MicroBatcher(fn, max_batch_size=3, max_wait=30)
        start = time.monotonic()
        await asyncio.gather(*(batcher.submit(i) for i in range(3)))
        elapsed = time.monotonic() - start
        await batcher.close()
        return elapsed

    assert run(body()) < 5


def test_a_lone_item_waits_max_wait_for_company():
    fn = Recorder()

    async def body():
        batcher = MicroBatcher(fn, max_batch_size=8, max_wait=0.2)
        start = time.monotonic()
        first = asyncio.ensure_future(batcher.submit(1))
        await until(lambda: batcher.waiting == 1, "the first item waiting")
        second = asyncio.ensure_future(batcher.submit(2))  # joins: the window is still open
        results = await asyncio.gather(first, second)
        elapsed = time.monotonic() - start
        await batcher.close()
        return results, elapsed

    results, elapsed = run(body())
    assert results == [1, 4]
    assert fn.batches == [[1, 2]]
    assert 0.18 <= elapsed < 5


def test_max_wait_zero_takes_what_is_waiting_without_delay():
    fn = Recorder()

    async def body():
        batcher = MicroBatcher(fn, max_batch_size=8, max_wait=0)
        # gather schedules every submit before the worker runs: one batch, no waiting.
        await asyncio.gather(*(batcher.submit(i) for i in range(3)))
        await batcher.submit(7)
        await batcher.close()

    run(body())
    assert fn.batches == [[0, 1, 2], [7]]


def test_items_arriving_while_a_batch_runs_make_up_the_next_batch():
    batches = []

    async def body():
        gate = asyncio.Event()

        async def slow(items):
            batches.append(list(items))
            if len(batches) == 1:
                await gate.wait()
            return items

        batcher = MicroBatcher(slow, max_batch_size=8, max_wait=0)
        first = asyncio.ensure_future(batcher.submit("a"))
        await until(lambda: batches == [["a"]], "a's batch running")
        later = [asyncio.ensure_future(batcher.submit(x)) for x in "bcd"]
        await until(lambda: batcher.waiting == 3, "b, c and d waiting")
        assert batches == [["a"]]  # one batch at a time: b, c, d wait for a's batch
        gate.set()
        results = await asyncio.gather(first, *later)
        await batcher.close()
        return results

    assert run(body()) == ["a", "b", "c", "d"]
    assert batches == [["a"], ["b", "c", "d"]]


def test_a_plain_function_runs_in_a_worker_thread_one_batch_at_a_time():
    loop_thread = threading.get_ident()
    seen = []
    active = 0
    overlap = False
    lock = threading.Lock()

    def forward(items):
        nonlocal active, overlap
        with lock:
            active += 1
            overlap = overlap or active > 1
        seen.append(threading.get_ident())
        time.sleep(0.01)
        with lock:
            active -= 1
        return [x + 1 for x in items]

    async def body():
        batcher = MicroBatcher(forward, max_batch_size=2, max_wait=0)
        results = await asyncio.gather(*(batcher.submit(i) for i in range(7)))
        await batcher.close()
        return results

    assert run(body()) == [i + 1 for i in range(7)]
    assert seen and loop_thread not in seen
    assert not overlap


def test_an_exception_fails_that_batch_only_and_the_batcher_goes_on():
    calls = []

    async def flaky(items):
        calls.append(list(items))
        if "bad" in items:
            raise ValueError("model exploded")
        return [x.upper() for x in items]

    async def body():
        batcher = MicroBatcher(flaky, max_batch_size=2, max_wait=0.05)
        first = await asyncio.gather(batcher.submit("ok"), batcher.submit("bad"), return_exceptions=True)
        second = await batcher.submit("fine")
        await batcher.close()
        return first, second

    first, second = run(body())
    assert all(isinstance(r, ValueError) and "model exploded" in str(r) for r in first)
    assert second == "FINE"


def test_an_exception_instance_in_the_results_fails_only_that_item():
    async def per_item(items):
        return [ValueError(f"cannot take {x}") if x < 0 else x * 10 for x in items]

    async def body():
        batcher = MicroBatcher(per_item, max_batch_size=4, max_wait=0.05)
        results = await asyncio.gather(*(batcher.submit(x) for x in (1, -2, 3)), return_exceptions=True)
        await batcher.close()
        return results

    ok1, bad, ok3 = run(body())
    assert (ok1, ok3) == (10, 30)
    assert isinstance(bad, ValueError) and "cannot take -2" in str(bad)


def test_a_wrong_number_of_results_is_a_clear_error():
    async def short(items):
        return items[:1]

    async def body():
        batcher = MicroBatcher(short, max_batch_size=4, max_wait=0.05, name="enc")
        results = await asyncio.gather(*(batcher.submit(x) for x in range(3)), return_exceptions=True)
        await batcher.close()
        return results

    results = run(body())
    assert all(isinstance(r, BatchError) for r in results)
    assert "batcher 'enc' returned 1 results for 3 items" in str(results[0])


def test_a_caller_cancelled_before_its_batch_starts_is_left_out():
    batches = []

    async def body():
        gate = asyncio.Event()

        async def gated(items):
            batches.append(list(items))
            if len(batches) == 1:
                await gate.wait()
            return [x * x for x in items]

        batcher = MicroBatcher(gated, max_batch_size=8, max_wait=0)
        first = asyncio.ensure_future(batcher.submit(1))
        await until(lambda: batches == [[1]], "the first batch running")
        keep = asyncio.ensure_future(batcher.submit(2))
        drop = asyncio.ensure_future(batcher.submit(3))
        await until(lambda: batcher.waiting == 2, "both items waiting behind the first batch")
        drop.cancel()
        await until(lambda: batcher.waiting == 1, "the cancelled item no longer counted")
        gate.set()
        assert await first == 1
        assert await keep == 4
        assert drop.cancelled()
        await batcher.close()

    run(body())
    assert batches == [[1], [2]]


def test_a_caller_cancelled_while_its_batch_runs_does_not_disturb_the_others():
    async def body():
        started = asyncio.Event()
        gate = asyncio.Event()

        async def slow(items):
            started.set()
            await gate.wait()
            return [x + 100 for x in items]

        batcher = MicroBatcher(slow, max_batch_size=8, max_wait=0.01)
        a = asyncio.ensure_future(batcher.submit(1))
        b = asyncio.ensure_future(batcher.submit(2))
        await started.wait()
        a.cancel()
        gate.set()
        result = await b
        await batcher.close()
        return a.cancelled(), result

    assert run(body()) == (True, 102)


def test_close_fails_waiting_items_and_refuses_new_ones():
    async def body():
        gate = asyncio.Event()
        started = asyncio.Event()

        async def blocked(items):
            started.set()
            await gate.wait()
            return items

        batcher = MicroBatcher(blocked, max_batch_size=1, max_wait=0)
        running = asyncio.ensure_future(batcher.submit(1))
        queued = asyncio.ensure_future(batcher.submit(2))
        await started.wait()
        await until(lambda: batcher.waiting == 1, "the second item waiting")
        await batcher.close()
        await batcher.close()  # idempotent
        results = await asyncio.gather(running, queued, return_exceptions=True)
        with pytest.raises(BatcherClosed, match="is closed"):
            await batcher.submit(3)
        return results, batcher.closed

    results, closed = run(body())
    assert closed
    assert all(isinstance(r, BatcherClosed) for r in results)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be an integer of at least 1"),
        ({"max_batch_size": 2.5}, "max_batch_size must be an integer of at least 1"),
        ({"max_wait": -1}, "max_wait must be a number of seconds of at least 0"),
    ],
)
def test_invalid_settings_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MicroBatcher(Recorder(), **kwargs)


def test_a_batch_function_must_be_callable():
    with pytest.raises(TypeError, match="needs a callable batch function"):
        MicroBatcher(42)


@settings(max_examples=25, deadline=None)
@given(
    arrivals=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=30),
    max_batch_size=st.integers(min_value=1, max_value=6),
)
def test_every_item_is_answered_once_in_batches_of_at_most_max_size(arrivals, max_batch_size):
    """Items arrive in bursts (``arrivals[i]`` event-loop turns apart): each gets its own answer,
    every item is processed exactly once, and no batch exceeds the limit."""
    fn = Recorder()

    async def body():
        batcher = MicroBatcher(fn, max_batch_size=max_batch_size, max_wait=0.001)
        tasks = []
        for i, gap in enumerate(arrivals):
            for _ in range(gap):  # the drawn arrival pattern, not a synchronisation
                await asyncio.sleep(0)
            tasks.append(asyncio.ensure_future(batcher.submit(i)))
        results = await asyncio.gather(*tasks)
        await batcher.close()
        return results

    assert run(body()) == [i * i for i in range(len(arrivals))]
    assert sorted(x for batch in fn.batches for x in batch) == list(range(len(arrivals)))
    assert max(len(b) for b in fn.batches) <= max_batch_size


def test_a_batcher_serves_again_from_a_new_event_loop_once_its_first_one_is_closed():
    fn = Recorder()
    batcher = MicroBatcher(fn, max_batch_size=4, max_wait=0)
    assert run(batcher.submit(3)) == 9
    assert run(batcher.submit(4)) == 16  # asyncio.run again: a new event loop
    run(batcher.close())
    assert fn.batches == [[3], [4]]


@pytest.mark.parametrize("kit", ["batcher", "decode loop"])
def test_a_kit_bound_to_a_running_event_loop_refuses_another(kit):
    from omni_core.kits import DecodeLoop

    if kit == "batcher":
        obj = MicroBatcher(Recorder(), max_wait=0, name="enc")

        async def use():
            return await obj.submit(2)
    else:
        obj = DecodeLoop(lambda rows: [0] * len(rows), name="enc")

        async def use():
            async with obj.join("state") as seq:
                seq.finish()

    first = asyncio.new_event_loop()
    try:
        first.run_until_complete(use())  # binds to ``first``, which stays open
        with pytest.raises(RuntimeError, match=f"{kit} 'enc' is bound to another running event loop"):
            run(use())
        first.run_until_complete(obj.close())
    finally:
        first.close()


def test_the_old_module_paths_are_aliases_of_the_kits():
    import omni_core
    import omni_core.batching
    import omni_core.decode_loop
    import omni_core.kits

    assert omni_core.batching.MicroBatcher is omni_core.kits.MicroBatcher is omni_core.MicroBatcher
    assert omni_core.batching.BatcherClosed is BatcherClosed
    assert omni_core.decode_loop.DecodeLoop is omni_core.kits.DecodeLoop is omni_core.DecodeLoop
    assert omni_core.decode_loop.NO_OUTPUT is omni_core.kits.NO_OUTPUT

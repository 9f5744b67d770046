"""One message per step per destination: the outputs of a batched step (a decode loop's rows, a
micro-batch's callers) leave their process as one zmq message per destination process, and the
receivers (a stage process, the caller's coordinator) hand them out per request as if they came
alone: order, credits, aborts and failures per request, relay memory freed per request."""

from __future__ import annotations

import asyncio

import pytest
from runtime_helpers import arun, no_leaks, until_state  # noqa: F401

from omni_core import Pipeline
from omni_core.errors import RequestAborted, StageError

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_leaks")]


def config(rows: int, *, buffer: int = 256, tensors: bool = False) -> dict:
    """``stepper`` (a decode loop, ``rows`` rows per step) streams every output to ``reader``
    (another process, which starts on the first chunk and also gets the result) and to the caller."""
    return {
        "name": "steps",
        "stages": [
            {"name": "stepper", "factory": "step_stages:Stepper", "args": {"rows": rows, "tensors": tensors},
             "stream_to": ["reader", "caller"], "next": ["reader"], "max_concurrency": rows + 1},
            {"name": "reader", "factory": "step_stages:Reader", "terminal": True,
             "can_accept_stream_before_payload": True, "max_concurrency": rows + 1},
        ],
        "limits": {"stream_buffer": buffer, "max_in_flight": 4 * rows},
    }


async def read(p: Pipeline, inputs: dict, *, stop_after: int | None = None) -> tuple[list, dict | None]:
    """The caller's chunks of one request (their ``i``) and its result; with ``stop_after``, leave
    the stream after that many chunks (an abort)."""
    got, result = [], None
    async for event in p.stream(inputs):
        if event.is_result:
            result = event.data
        else:
            assert event.stage == "stepper" and event.data["r"] == inputs["r"]
            got.append(event.data["i"])
            if stop_after is not None and len(got) >= stop_after:
                break
    return got, result


def idle(state: dict) -> bool:
    return all(value == 0 for report in state.values() for value in report.values()
               if isinstance(value, (int, float)) and not isinstance(value, bool))


@pytest.mark.parametrize("rows", [16, 64])
def test_every_decode_step_sends_one_message_per_destination_carrying_every_rows_chunk(rows):
    n = 6

    async def body():
        async with Pipeline(config(rows)) as p:
            outs = await asyncio.gather(*(read(p, {"n": n, "r": r}) for r in range(rows)))
            rep = await p.submit({"report": True, "r": "report"})
            return outs, rep["source"]

    outs, rep = arun(body(), 180)
    for r, (got, result) in enumerate(outs):
        assert got == list(range(n)), f"request {r}: the caller's chunks"
        assert result["got"] == list(range(n)) and not result["bad"], f"request {r}: the reader's chunks"
        assert result["source"] == {"r": r, "n": n}
    # The steps had every row (a row that joins a turn late may make one step alone), and each
    # step's outputs left as one message per destination (the reader's process and the
    # caller's), carrying every row's chunk.
    steps = rep["steps"]
    assert rep["sizes"].get(rows, 0) >= n - 1 and sum(k * v for k, v in rep["sizes"].items()) == rows * n, rep
    assert rep["steps_sent"] == steps
    assert len(rep["most"]) == 2 and "coordinator" in rep["most"]
    assert rep["most"] == {dest: 1 for dest in rep["most"]}, "messages per step per destination"
    assert rep["messages"] == {dest: steps for dest in rep["most"]}
    for dest, carried in rep["carried"].items():
        # a chunk per row and step; the last step's message also carries the results and stream ends
        assert carried >= rows * n, (dest, carried)


def test_a_micro_batch_sends_its_callers_results_as_one_message():
    rows = 16

    async def body():
        config = {"name": "batched", "stages": [
            {"name": "batched", "factory": "step_stages:Batched", "args": {"rows": rows}, "terminal": True,
             "max_concurrency": rows + 1}]}
        async with Pipeline(config) as p:
            results = await asyncio.gather(*(p.submit({"x": x}) for x in range(rows)))
            return results, await p.submit({"report": True})

    results, rep = arun(body(), 120)
    assert results == [{"y": 2 * x} for x in range(rows)]
    assert rep["batches"] == 1 and rep["sizes"] == {rows: 1}
    assert rep["steps_sent"] == 1 and rep["most"] == {"coordinator": 1} and rep["carried"] == {"coordinator": rows}


def test_rows_sharing_messages_keep_order_credits_aborts_and_failures_per_request():
    """16 rows in every step, 2 credits per stream (producers wait on their readers), tensors in
    every chunk: a row whose step fails fails its request only; a request the caller leaves after
    3 chunks is aborted (its rows later in shared messages are dropped, their relay memory freed);
    a request whose reader fails at its 4th chunk fails there; every other request gets every
    chunk in order at the caller and at the reader. Afterwards nothing is held anywhere."""
    rows, n = 16, 12

    async def one(p: Pipeline, r: int):
        inputs = {"n": n, "r": r}
        if r == 3:
            inputs["fail_at"] = 5
        if r == 5:
            inputs["r"] = "reader-fails"
        try:
            return await read(p, inputs, stop_after=3 if r == 7 else None)
        except (StageError, RequestAborted) as exc:
            return exc

    async def body():
        async with Pipeline(config(rows, buffer=2, tensors=True)) as p:
            outs = await asyncio.gather(*(one(p, r) for r in range(rows)))
            again = await asyncio.gather(*(read(p, {"n": 4, "r": 100 + r}) for r in range(rows)))
            rep = await p.submit({"report": True, "r": "report"})
            state = await until_state(p, idle, "nothing held after the requests")
            return outs, again, rep["source"], state

    outs, again, rep, state = arun(body(), 200)
    failed_step, failed_reader = outs[3], outs[5]
    assert isinstance(failed_step, StageError) and failed_step.stage == "stepper"
    assert "row 3 failed at output 5" in str(failed_step)
    assert isinstance(failed_reader, StageError) and failed_reader.stage == "reader"
    assert "failed at chunk 3" in str(failed_reader)
    aborted_chunks, aborted_result = outs[7]
    assert aborted_chunks == [0, 1, 2] and aborted_result is None
    for r, out in enumerate(outs):
        if r in (3, 5, 7):
            continue
        got, result = out
        assert got == list(range(n)), f"request {r}: the caller's chunks"
        assert result["got"] == list(range(n)) and not result["bad"], f"request {r}: the reader's chunks"
    for r, (got, result) in enumerate(again):
        assert got == [0, 1, 2, 3] and result["got"] == [0, 1, 2, 3] and result["source"]["r"] == 100 + r
    # the rows did share messages: the steps' messages carried more than one output each
    assert all(rep["carried"][dest] > rep["messages"][dest] for dest in rep["messages"])
    assert idle(state)

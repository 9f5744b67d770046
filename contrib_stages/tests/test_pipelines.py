"""The contrib stages and functions through real stage processes: routing by a payload field,
projections, the torch-module stage batching requests from several callers, a function stage
streaming across processes, tee and collect."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import arun

from omni_core import Pipeline, StageError

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]

H = "contrib_test_helpers"


def test_route_by_field_projections_and_a_batched_module_across_processes():
    cfg = {
        "name": "routing",
        "stages": [
            {"name": "entry", "factory": "contrib.tee", "next": ["affine", "shout"], "route_fn": "contrib.route.to",
             "project_payload": {"affine": "contrib.drop_private", "shout": "contrib.drop_private"}},
            {"name": "affine", "factory": "contrib.torch_module", "terminal": True,
             "args": {"module": f"{H}:BatchSize", "input_key": "x", "output_key": "y",
                      "max_batch_size": 8, "max_wait_ms": 200}},
            {"name": "shout", "factory": "contrib.function", "terminal": True,
             "args": {"function": f"{H}:upper", "kwargs": {"suffix": "!"}, "input_key": "text", "output_key": "shout"}},
        ],
    }

    async def body():
        async with Pipeline(cfg) as p:
            only_affine = await p.submit({"x": [1.0, 2.0], "text": "hi", "_to": "affine"})
            only_shout = await p.submit({"x": [1.0, 2.0], "text": "hi", "_to": ["shout"]})
            both = await p.submit({"x": [1.0, 2.0], "text": "hi"})
            many = await asyncio.gather(*(p.submit({"x": [float(i), 0.0], "text": str(i), "_to": "affine"}) for i in range(8)))
            return only_affine, only_shout, both, many

    only_affine, only_shout, both, many = arun(body(), 100)
    assert set(only_affine) == {"affine"}
    assert set(only_affine["affine"]) == {"text", "y"}  # "_to" was projected away, "x" consumed
    assert only_affine["affine"]["y"][0].item() == 3.0  # [x0 + x1, batch size]
    assert only_shout == {"shout": {"x": [1.0, 2.0], "shout": "HI!"}}
    assert set(both) == {"affine", "shout"}
    # eight callers at once: the module saw them in batches, and each got its own row back
    assert [r["affine"]["y"][0].item() for r in many] == [float(i) for i in range(8)]
    assert max(r["affine"]["y"][1].item() for r in many) > 1


def test_a_function_streams_across_processes_through_a_tee_into_collect():
    cfg = {
        "name": "streams",
        "stages": [
            {"name": "words", "factory": "contrib.function", "next": "relay", "stream_to": ["relay"],
             "args": {"function": f"{H}:async_words_with_ctx", "input_key": "text", "output_key": "count"}},
            {"name": "relay", "factory": "contrib.tee", "args": {"stream_from": "words"}, "process": "p2",
             "can_accept_stream_before_payload": True, "stream_to": ["gather"], "next": "gather"},
            {"name": "gather", "factory": "contrib.collect", "args": {"stream_from": "relay"}, "process": "p2",
             "can_accept_stream_before_payload": True, "terminal": True},
        ],
    }

    async def body():
        async with Pipeline(cfg) as p:
            assert len(p.pids()) == 2
            return await p.submit({"text": "one two three four"})

    result = arun(body(), 100)
    assert result == {"count": 4, "chunks": [{"word": w} for w in ("one", "two", "three", "four")]}


def test_a_failing_module_call_fails_that_request_with_the_stage_name():
    cfg = {
        "name": "fails",
        "stages": [
            {"name": "enc", "factory": "contrib.torch_module", "terminal": True,
             "args": {"module": f"{H}:FailsOnNegative"}},
        ],
    }

    async def body():
        async with Pipeline(cfg) as p:
            with pytest.raises(StageError) as info:
                await p.submit([-1.0])
            ok = await p.submit([1.0, 2.0])  # the stage goes on serving
            return info.value, ok

    error, ok = arun(body(), 100)
    assert error.stage == "enc" and "negative input" in str(error)
    assert torch.equal(ok, torch.tensor([2.0, 3.0]))

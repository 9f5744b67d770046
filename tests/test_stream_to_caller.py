"""``stream_to: [caller]``: a non-terminal stage streams its chunks straight to the request's
caller, with the ordering and credits of any stream, beside its streams to other stages; the
request completes only once that stream ended (every chunk before the result)."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch
from runtime_helpers import arun, fn, no_leaks, pipeline, stage  # noqa: F401

from omni_core import Pipeline, load_config
from omni_core.config.validate import validate_config
from omni_core.errors import ConfigError
from omni_core.plan import build_plan
from omni_core.plan.render import plan_dict, render_text
from omni_core.plugins import get_registry

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_leaks")]


def both(buffer: int = 4) -> dict:
    """``tok`` streams to the caller and to ``collect`` (which starts on its first chunk, its
    payload being ``tok``'s result): few credits, so both streams wait on their readers."""
    return pipeline(
        stage("tok", "TensorChunks", stream_to=["collect", "caller"], next=["collect"]),
        stage("collect", "CollectTensors", args={"source": "tok"}, terminal=True,
              can_accept_stream_before_payload=True),
        limits={"stream_buffer": buffer},
    )


async def read(p: Pipeline, inputs: dict) -> tuple[list, dict]:
    events, result = [], None
    async for event in p.stream(inputs):
        assert result is None, "an event after the result"
        if event.is_result:
            result = event.data
        else:
            events.append(event)
    return events, result


def check_chunks(events: list, n: int, stage_name: str = "tok") -> None:
    assert [e.stage for e in events] == [stage_name] * n
    assert [e.data["i"] for e in events] == list(range(n))
    for e in events:
        t = e.data.get("t")
        assert t is None or torch.equal(t, torch.full_like(t, float(e.data["i"])))


def test_a_stage_streams_to_the_caller_and_to_a_next_stage_in_order_with_every_chunk_before_the_result():
    async def body():
        async with Pipeline(both()) as p:
            alone = await read(p, {"n": 60, "plain": 7})
            together = await asyncio.gather(*(read(p, {"n": 40 + r, "r": r}) for r in range(12)))
            submitted = await p.submit({"n": 30})  # nobody reads the caller's stream: credits come back
            return alone, together, submitted

    alone, together, submitted = arun(body(), timeout=200)
    events, result = alone
    check_chunks(events, 60)
    assert result == {"got": list(range(60)), "bad": []}
    for r, (events, result) in enumerate(together):
        check_chunks(events, 40 + r)
        assert result == {"got": list(range(40 + r)), "bad": []}
    assert submitted == {"got": list(range(30)), "bad": []}


def test_a_stage_streaming_only_to_the_caller_beside_a_terminal_stage():
    cfg = pipeline(
        stage("tok", "TensorChunks", stream_to=["caller"], next=["sink"]),
        stage("sink", "Echo", terminal=True),
        limits={"stream_buffer": 2},
    )

    async def body():
        async with Pipeline(cfg) as p:
            return await asyncio.gather(*(read(p, {"n": 25, "r": r}) for r in range(8)))

    for r, (events, result) in enumerate(arun(body(), timeout=200)):
        check_chunks(events, 25)
        assert result == {"n": 25, "r": r}


def test_a_caller_streaming_stage_routed_away_does_not_hold_the_request():
    cfg = pipeline(
        stage("src", "Echo", next=["tok", "sink"], route_fn=fn("route_by_field")),
        stage("tok", "TensorChunks", stream_to=["caller"], next=["sink"]),
        stage("sink", "Echo", terminal=True),
    )

    async def body():
        async with Pipeline(cfg) as p:
            skipped = await read(p, {"n": 5, "route": ["sink"]})
            through = await read(p, {"n": 5, "route": ["tok"]})
            return skipped, through

    (skipped_events, skipped), (events, result) = arun(body(), timeout=100)
    assert skipped_events == [] and skipped == {"n": 5, "route": ["sink"]}
    check_chunks(events, 5)
    assert result == {"n": 5, "route": ["tok"]}


def test_a_caller_leaving_mid_stream_and_a_stage_failing_mid_stream_end_their_request_alone():
    async def body():
        async with Pipeline(both(buffer=2)) as p:
            stream = p.stream({"n": 200})
            first = await anext(stream)
            await stream.aclose()  # the caller leaves after one chunk: the request is aborted
            with pytest.raises(Exception, match="failed after its first chunk"):
                await read(p, {"n": 10, "fail": True})
            after = await read(p, {"n": 20})
            return first, after

    first, (events, result) = arun(body(), timeout=200)
    assert first.stage == "tok" and first.data["i"] == 0
    check_chunks(events, 20)
    assert result == {"got": list(range(20)), "bad": []}


def test_caller_is_a_reserved_stage_name_and_a_terminal_stage_needs_no_caller_stream():
    cfg = pipeline(stage("caller", "Echo", terminal=True))
    with pytest.raises(ConfigError, match="the stage name 'caller' is reserved"):
        load_config(cfg)
    cfg = pipeline(stage("tok", "TensorChunks", stream_to=["caller"], terminal=True))
    with pytest.raises(ConfigError, match="is terminal: its chunks already go to the caller"):
        load_config(cfg)
    ok = load_config(both())
    assert ok.stage("tok").stream_to == ("collect", "caller")
    plan = build_plan(ok, get_registry(), gpus=0)
    assert plan_dict(plan)["caller_streams"] == ["tok"]
    assert [(e.src, e.dst, e.kind) for e in plan.edges] == [("tok", "collect", "next"), ("tok", "collect", "stream")]
    assert re.search(r"tok +\(caller\) +stream +to the caller", render_text(plan))


def test_project_stream_gives_the_caller_its_own_view_of_each_chunk_and_the_next_stage_the_whole_chunk():
    cfg = both(buffer=3)
    cfg["stages"][0]["project_stream"] = {"caller": fn("chunk_index")}

    async def body():
        async with Pipeline(cfg) as p:
            runs = await asyncio.gather(*(read(p, {"n": 12, "r": r}) for r in range(6)))
            with pytest.raises(Exception, match="projection exploded at chunk 13"):
                await read(p, {"n": 20})
            after = await read(p, {"n": 8})
            return runs, after

    runs, after = arun(body(), timeout=200)
    for events, result in [*runs, after]:
        n = len(events)
        assert [e.data for e in events] == [{"i": i} for i in range(n)]  # no tensor reaches the caller
        assert result == {"got": list(range(n)), "bad": []}  # collect got every tensor, right
    assert [len(events) for events, _ in runs] == [12] * 6 and len(after[0]) == 8


def test_project_stream_names_a_target_the_stage_streams_to():
    cfg = both()
    cfg["stages"][0]["project_stream"] = {"sink": fn("chunk_index")}
    with pytest.raises(ConfigError, match=r"project_stream\.sink.*stream projection for 'sink', which this stage "
                                          r"does not stream to"):
        load_config(cfg)
    cfg["stages"][0]["project_stream"] = {"caller": "nobody.registered_this"}
    with pytest.raises(ConfigError, match=r"project_stream\.caller.*nobody\.registered_this"):
        validate_config(load_config(cfg, validate=False), registry=get_registry())
    cfg["stages"][0]["project_stream"] = {"caller": 3}
    with pytest.raises(ConfigError, match="project_stream"):
        load_config(cfg)
    cfg["stages"][0]["project_stream"] = {"collect": fn("chunk_index"), "caller": fn("chunk_index")}
    assert load_config(cfg).stage("tok").project_stream == {"collect": fn("chunk_index"),
                                                            "caller": fn("chunk_index")}

"""A stage process's host and its router, in-process: a real :class:`Host` (its stages built by
their factories, as in a stage process) against a fake endpoint; the test plays the coordinator
and the other stage processes. Where results go, fan-in, failures that stay with their request,
aborts, floors, streams and their credits, state reports. No process, no socket; nothing waits
on a sleep: the tests poll what was sent or the host's state with a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
import torch
from fake_endpoint import FakeEndpoint, aio, until

from omni_core import load_config
from omni_core.config import to_dict
from omni_core.config.load import structure
from omni_core.plan.topology import build_plan, endpoints
from omni_core.plugins import get_registry
from omni_core.relay.payload import unpack
from omni_core.runtime import wire
from omni_core.runtime.host import Host
from omni_core.runtime.types import Bootstrap, caller_edges

pytestmark = pytest.mark.timeout(30)

STAGES = "omni_test_stages"


def stage(name: str, factory: str = "Echo", **fields) -> dict:
    return {"name": name, "factory": f"{STAGES}:{factory}", **fields}


def fn(name: str) -> str:
    return f"{STAGES}:{name}"


class Rig:
    """One process of a pipeline's plan, hosted here: ``host``, ``ep`` (its fake endpoint)."""

    def __init__(self, host: Host, ep: FakeEndpoint):
        self.host = host
        self.ep = ep

    def obj(self, name: str):
        return self.host.stages[name].obj

    def work(self, rid: int, stage: str, payload, *, src: str = "", origin: str = "") -> None:
        self.ep.receive_data("work", rid, stage, payload, src=src, origin=origin)

    def chunk(self, rid: int, stage: str, payload, *, src: str, origin: str) -> None:
        self.ep.receive_data("chunk", rid, stage, payload, src=src, origin=origin)

    def data(self, to: str | None = None, kind: str | None = None) -> list[wire.Data]:
        return [m for m in self.ep.of_type(wire.Data, to=to) if kind is None or m.kind == kind]

    def payload(self, msg: wire.Data):
        """The payload a sent data message carries (its tensors inline)."""
        frames = next(f for _, m, f in self.ep.sent if m is msg)
        tensors = []
        if msg.nframes:
            assert msg.relay == "inline"
            tensors = _inline_get(self.ep.edges.relay("inline"), msg.handle, frames)
        return unpack(msg.skeleton, tensors)

    async def sent(self, kind: type, n: int = 1, to: str | None = None, what: str = "") -> list:
        """Wait until ``n`` messages of type ``kind`` (to ``to``) were sent; return them."""
        await until(lambda: len(self.ep.of_type(kind, to=to)) >= n, what or f"{n} {kind.__name__} sent to {to!r}")
        return self.ep.of_type(kind, to=to)

    def state(self) -> dict[str, int]:
        return {k: v for k, v in self.host.state().items() if v}


def _inline_get(relay, handle: bytes, frames: list) -> list:
    coro = relay.get(handle, [memoryview(f) if not isinstance(f, memoryview) else f for f in frames])
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("the inline relay's get suspended")


@contextlib.asynccontextmanager
async def hosted(tmp_path, *stages: dict, process: str, limits: dict | None = None, **fields):
    """Host ``process`` of the pipeline of ``stages`` the way a stage process's ``main`` does
    (the Bootstrap made as the runner makes it); closed on the way out."""
    data = {"name": "host", "stages": list(stages), **fields}
    if limits:
        data["limits"] = limits
    cfg = load_config(data)
    registry = get_registry()
    plan = build_plan(cfg, registry, devices=())
    runtime_dir = str(tmp_path)
    spec = plan.process(process)
    boot = Bootstrap(
        run_id="test-run", runtime_dir=runtime_dir, config=to_dict(cfg), process=spec,
        addresses=dict(endpoints(plan, runtime_dir)),
        routes={s.name: plan.processes_of(s.name) for s in cfg.stages},
        edge_relays={(e.src, e.dst, e.kind): e.relay for e in plan.edges} | caller_edges(cfg),
        env={}, parent_pid=os.getpid(), followers=tuple(plan.followers(spec.name)),
    )
    config = structure(boot.config)
    ep = FakeEndpoint(config, registry, process=spec.name, origin=spec.name)
    ep.open(run_id=boot.run_id, runtime_dir=boot.runtime_dir, addresses=boot.addresses, stages=spec.stages)
    host = Host(boot, config, registry, ep)
    host.stopping = asyncio.Event()  # serve() is not called
    try:
        host.build_stages()
        yield Rig(host, ep)
    finally:
        await host.close()
        assert ep.closed


LINE = (stage("a", "Upper", next="b"), stage("b", "AddSuffix", terminal=True))


# -- where results go ------------------------------------------------------------------------------


@aio
async def test_a_payload_runs_its_stage_and_the_result_goes_to_the_next_stages_process(tmp_path):
    async with hosted(tmp_path, *LINE, process="a") as rig:
        rig.work(1, "a", {"text": "hi"})  # Upper is sync: it runs in a worker thread
        (msg,) = await rig.sent(wire.Data, to="b")
        assert (msg.kind, msg.rid, msg.request_id, msg.stage, msg.src, msg.origin) == ("work", 1, "req-1", "b", "a", "a")
        assert rig.payload(msg) == {"text": "HI"}
        assert [to for to, _, _ in rig.ep.sent] == ["b"]
        await until(lambda: not rig.state(), "the call's state is gone")


@aio
async def test_a_terminal_stages_result_goes_to_the_caller(tmp_path):
    async with hosted(tmp_path, *LINE, process="b") as rig:
        rig.work(3, "b", {"text": "HI"}, src="a", origin="a")
        (msg,) = await rig.sent(wire.Data, to="")
        assert (msg.kind, msg.rid, msg.stage, msg.src, msg.origin) == ("result", 3, "b", "b", "b")
        assert rig.payload(msg) == {"text": "HI!", "by": ["b"]}
        assert rig.state() == {}


@aio
async def test_tensors_in_and_out_of_a_stage(tmp_path):
    async with hosted(tmp_path, stage("s", "Scale", args={"factor": 3.0}, terminal=True), process="s") as rig:
        rig.work(1, "s", {"x": torch.ones(4)})
        (msg,) = await rig.sent(wire.Data, to="")
        assert msg.relay == "inline" and msg.nframes == 1
        assert torch.equal(rig.payload(msg)["x"], torch.full((4,), 3.0))
        assert rig.state() == {}


@aio
async def test_a_stage_in_the_same_process_gets_the_result_without_a_message(tmp_path):
    stages = (stage("a", "Upper", next="b", process="p"), stage("b", "AddSuffix", terminal=True, process="p"))
    async with hosted(tmp_path, *stages, process="p") as rig:
        rig.work(1, "a", {"text": "hi"})
        (msg,) = await rig.sent(wire.Data, to="")
        assert (msg.kind, msg.stage) == ("result", "b")
        assert rig.payload(msg) == {"text": "HI!", "by": ["b"]}
        assert len(rig.ep.sent) == 1  # nothing between a and b went through the endpoint
        await until(lambda: not rig.state(), "the calls' state is gone")


FAN_IN = (
    stage("src", next=["x", "y"]), stage("x", next="join"), stage("y", next="join"),
    stage("join", wait_for=["x", "y"], merge_fn=fn("concat"), terminal=True),
)


@aio
async def test_a_fan_in_stage_runs_once_every_source_arrived_on_the_merged_payload(tmp_path):
    async with hosted(tmp_path, *FAN_IN, process="join") as rig:
        rig.work(1, "join", {"text": "Y"}, src="y", origin="y")
        rig.work(2, "join", {"text": "y2"}, src="y", origin="y")
        await until(lambda: rig.state() == {"stage.join.fan_in": 2}, "both parts held for the fan-in")
        assert rig.ep.sent == [] and rig.state() == {"stage.join.fan_in": 2}
        rig.work(1, "join", {"text": "X"}, src="x", origin="x")
        (msg,) = await rig.sent(wire.Data, to="")
        assert (msg.rid, msg.kind) == (1, "result") and rig.payload(msg) == {"text": "X+Y"}
        # A started fan-in is remembered until its request's Forget (a source outside a
        # wait_for_fn subset may still come): the coordinator tells fan-in processes.
        assert rig.state() == {"stage.join.fan_in": 2}
        rig.work(1, "join", {"text": "X again"}, src="x", origin="x")  # after the start: dropped
        rig.ep.receive(wire.Forget(1, 0))
        assert rig.state() == {"ended": 1, "stage.join.fan_in": 1}
        rig.work(2, "join", {"text": "x2"}, src="x", origin="x")
        msgs = await rig.sent(wire.Data, 2, to="")
        assert len(msgs) == 2 and rig.payload(msgs[1]) == {"text": "x2+y2"}
        rig.ep.receive(wire.Forget(2, 3))
        assert rig.state() == {}


@aio
async def test_a_wait_for_fn_chooses_the_sources_a_fan_in_waits_for(tmp_path):
    stages = FAN_IN[:3] + (stage("join", wait_for=["x", "y"], wait_for_fn=fn("wait_for_named"),
                                 merge_fn=fn("concat"), terminal=True),)
    async with hosted(tmp_path, *stages, process="join") as rig:
        rig.work(1, "join", {"text": "X", "wait": ["x"]}, src="x", origin="x")  # x alone will do
        (msg,) = await rig.sent(wire.Data, to="")
        assert rig.payload(msg) == {"text": "X"}
        rig.work(1, "join", {"text": "Y"}, src="y", origin="y")  # not waited for: dropped
        rig.work(2, "join", {"text": "Y"}, src="y", origin="y")  # None: every source
        await until(lambda: rig.state() == {"stage.join.fan_in": 2}, "request 2's part from y held")
        assert len(rig.data()) == 1
        rig.work(2, "join", {"text": "X"}, src="x", origin="x")
        msgs = await rig.sent(wire.Data, 2, to="")
        assert rig.payload(msgs[1]) == {"text": "X+Y"}
        rig.work(3, "join", {"text": "X", "wait": "nobody"}, src="x", origin="x")
        (failed,) = await rig.sent(wire.Failed, to="")
        assert (failed.rid, failed.error_type) == (3, "WiringError") and "wait_for_fn" in failed.message
        rig.ep.receive(wire.Forget(0, 4))
        await until(lambda: rig.state() == {}, "every request is forgotten")


@aio
async def test_a_fan_in_whose_merge_raises_fails_its_request(tmp_path):
    stages = FAN_IN[:3] + (stage("join", wait_for=["x", "y"], merge_fn=fn("merge_raises"), terminal=True),)
    async with hosted(tmp_path, *stages, process="join") as rig:
        rig.work(1, "join", {"text": "X"}, src="x", origin="x")
        rig.work(1, "join", {"text": "Y"}, src="y", origin="y")
        (failed,) = await rig.sent(wire.Failed, to="")
        assert (failed.rid, failed.stage, failed.error_type, failed.message) == (1, "join", "RuntimeError", "merge exploded")
        assert rig.state() == {"ended": 1}


@aio
async def test_a_route_fn_that_drops_a_target_tells_the_caller(tmp_path):
    stages = (stage("src", next=["a", "b"], route_fn=fn("route_by_field")), stage("a", terminal=True),
              stage("b", terminal=True))
    async with hosted(tmp_path, *stages, process="src") as rig:
        rig.work(1, "src", {"route": "a"})
        (dropped,) = await rig.sent(wire.Dropped, to="")
        assert dropped == wire.Dropped(1, "src", ["b"])
        assert [m.stage for m in rig.data()] == ["a"] and rig.data("a")[0].kind == "work"
        rig.work(2, "src", {"route": ["a", "b"]})  # both: nothing dropped
        await until(lambda: len(rig.data()) == 3, "request 2 goes to a and b")
        assert len(rig.ep.of_type(wire.Dropped)) == 1
        assert rig.state() == {}


# -- failures stay with their request ----------------------------------------------------------------


@aio
async def test_unusable_data_messages_fail_their_request_only(tmp_path):
    async with hosted(tmp_path, *LINE, process="a") as rig:
        ep = rig.ep
        ep.receive_data("work", 1, "b", {"text": "not here"})  # a stage this process does not host
        ep.receive_data("result", 2, "a", {"text": "x"})  # a kind a stage process does not take
        ep.receive(wire.Data("work", 3, "req-3", "a", "", b"\x80", "inline", b"", 2), [b"x"])  # frames
        ep.receive(wire.Data("work", 4, "req-4", "a", "", b"\xc1"))  # does not decode
        rig.work(5, "a", {"text": "fine"})
        failed = await rig.sent(wire.Failed, 4, to="")
        assert [(f.rid, f.stage, f.error_type) for f in failed] == [
            (1, "b", "WiringError"), (2, "a", "ValueError"), (3, "a", "ValueError"), (4, "a", "DecodeError")]
        assert "does not host" in failed[0].message and "unknown kind 'result'" in failed[1].message
        assert "announced 2 frames and carried 1" in failed[2].message
        (msg,) = await rig.sent(wire.Data, to="b")
        assert msg.rid == 5 and rig.payload(msg) == {"text": "FINE"}
        rig.work(1, "a", {"text": "late"})  # its request failed here: dropped
        await until(lambda: rig.state() == {"ended": 4}, "only the failed requests are remembered")
        assert len(rig.data()) == 1


@aio
async def test_a_stage_that_raises_fails_its_request_with_its_traceback_and_the_host_serves_on(tmp_path):
    async with hosted(tmp_path, stage("f", "Fail", terminal=True), process="f") as rig:
        rig.work(1, "f", {"fail": True, "text": "one"})
        (failed,) = await rig.sent(wire.Failed, to="")
        assert (failed.rid, failed.stage, failed.error_type, failed.message) == (1, "f", "RuntimeError", "boom on one")
        assert "omni_test_stages.py" in failed.traceback and "boom on one" in failed.traceback
        rig.work(2, "f", {"text": "two"})
        (msg,) = await rig.sent(wire.Data, to="")
        assert msg.rid == 2 and rig.payload(msg) == {"text": "two"}
        assert len(rig.ep.of_type(wire.Failed)) == 1
        await until(lambda: rig.state() == {"ended": 1}, "request 2's call is done")


@aio
async def test_a_chunk_from_a_stage_that_does_not_stream_here_fails_its_request(tmp_path):
    async with hosted(tmp_path, *LINE, process="b") as rig:
        rig.chunk(1, "b", {"i": 0}, src="a", origin="a")
        (failed,) = await rig.sent(wire.Failed, to="")
        assert (failed.rid, failed.stage, failed.error_type) == (1, "b", "WiringError")
        assert "not in its stream_to" in failed.message
        assert rig.state() == {"ended": 1}


# -- ends: Abort, Forget, floors ----------------------------------------------------------------------


@aio
async def test_an_abort_cancels_the_running_call_and_frees_its_state(tmp_path):
    async with hosted(tmp_path, stage("w", "Waiter", terminal=True), process="w") as rig:
        waiter = rig.obj("w")
        rig.work(1, "w", {"n": 1})
        rig.work(2, "w", {"n": 2})
        await until(lambda: len(waiter.started) == 2, "both calls started")
        assert rig.state() == {"stage.w.running": 2}
        rig.ep.receive(wire.Abort(1, 0))
        await until(lambda: waiter.cancelled == ["req-1"], "request 1's call is cancelled")
        await until(lambda: rig.state() == {"ended": 1, "stage.w.running": 1}, "request 1's call is gone")
        rig.work(1, "w", {"n": 1})  # late: its request ended
        await until(lambda: rig.state() == {"ended": 1, "stage.w.running": 1}, "the late payload dropped")
        assert waiter.started == ["req-1", "req-2"]
        waiter.gate.set()
        (msg,) = await rig.sent(wire.Data, to="")
        assert msg.rid == 2 and rig.payload(msg) == {"n": 2}
        assert rig.ep.of_type(wire.Failed) == []  # an abort is no failure
        await until(lambda: rig.state() == {"ended": 1}, "request 2's call is done")
        rig.ep.receive(wire.Forget(0, 3))  # every request below 3 ended: nothing to remember
        assert rig.state() == {} and rig.host.floor == 3


@aio
async def test_forget_with_a_floor_drops_late_messages_and_state_below_it(tmp_path):
    async with hosted(tmp_path, *FAN_IN, process="join") as rig:
        rig.work(2, "join", {"text": "X"}, src="x", origin="x")  # half of a fan-in
        rig.work(4, "join", {"text": "X"}, src="x", origin="x")
        assert rig.state() == {"stage.join.fan_in": 2}
        rig.ep.receive(wire.Forget(6, 3))  # 6 ended (at or above the floor: remembered); all below 3
        assert rig.state() == {"ended": 1, "stage.join.fan_in": 1} and rig.host.floor == 3
        for rid in (1, 2, 6):  # below the floor, or ended: ignored
            rig.work(rid, "join", {"text": "Y"}, src="y", origin="y")
            rig.ep.receive(wire.StreamEnd(rid, "join", "y"))
        rig.ep.receive(wire.Forget(0, 2))  # a floor below the current one moves nothing
        assert rig.host.floor == 3
        await until(lambda: rig.state() == {"ended": 1, "stage.join.fan_in": 1}, "the late messages dropped")
        assert rig.ep.sent == []
        rig.work(4, "join", {"text": "Y"}, src="y", origin="y")
        (msg,) = await rig.sent(wire.Data, to="")
        assert msg.rid == 4 and rig.payload(msg) == {"text": "X+Y"}
        rig.ep.receive(wire.Forget(4, 7))
        assert rig.state() == {} and rig.host.ended == set()


@aio
async def test_a_floor_frees_buffered_chunks_and_calls_of_requests_below_it(tmp_path):
    stages = (stage("src", "StreamThenReturn", stream_to=["sink"], next="sink"),
              stage("sink", "Collect", args={"source": "src"}, terminal=True))
    async with hosted(tmp_path, *stages, process="sink") as rig:
        rig.chunk(1, "sink", {"token": "a"}, src="src", origin="src")  # waits for its payload
        rig.chunk(2, "sink", {"token": "b"}, src="src", origin="src")
        rig.work(2, "sink", {"n": 2}, src="src", origin="src")  # its call reads, then waits
        await until(lambda: rig.state().get("stage.sink.running") == 1, "request 2's call runs")
        assert rig.state() == {"stage.sink.running": 1, "stage.sink.streams": 2}
        rig.ep.receive(wire.Abort(0, 3))
        await until(lambda: rig.state() == {}, "everything below the floor is freed")
        assert rig.ep.of_type(wire.Data) == [] and rig.ep.of_type(wire.Failed) == []


# -- streams and credits -------------------------------------------------------------------------------


STREAM = (stage("src", "StreamThenReturn", stream_to=["sink"], next="sink"),
          stage("sink", "Collect", args={"source": "src"}, terminal=True))


@aio
async def test_a_stream_reader_gets_its_chunks_in_order_and_gives_credits_back(tmp_path):
    async with hosted(tmp_path, *STREAM, process="sink", limits={"stream_buffer": 8}) as rig:
        for ch in "abcd":  # before the payload: they wait for it
            rig.chunk(1, "sink", {"token": ch}, src="src", origin="src")
        assert rig.state() == {"stage.sink.streams": 1}
        rig.work(1, "sink", {"n": 5}, src="src", origin="src")
        credits = await rig.sent(wire.Credit, 2, to="src", what="the four chunks read: two batches of credits")
        assert credits == [wire.Credit(1, "sink", "src", 2, False)] * 2
        rig.chunk(1, "sink", {"token": "e"}, src="src", origin="src")
        rig.ep.receive(wire.StreamEnd(1, "sink", "src"))
        (msg,) = await rig.sent(wire.Data, to="")
        assert rig.payload(msg) == {"streamed": "abcde", "payload": {"n": 5}}
        assert len(rig.ep.of_type(wire.Credit)) == 2  # the fifth is owed: the stream ended
        await until(lambda: rig.state() == {"stage.sink.finished": 1}, "the call is done; the request "
                    "is remembered as finished until its Forget")
        rig.chunk(1, "sink", {"token": "f"}, src="src", origin="src")  # too late: the stream is closed
        assert rig.ep.of_type(wire.Credit)[-1] == wire.Credit(1, "sink", "src", 1, True)
        rig.ep.receive(wire.Forget(1, 2))
        assert rig.state() == {}


@aio
async def test_a_producer_waits_for_credits_and_ends_its_stream(tmp_path):
    async with hosted(tmp_path, *STREAM, process="src", limits={"stream_buffer": 4}) as rig:
        rig.work(1, "src", {"n": 6})
        chunks = await rig.sent(wire.Data, 4, to="sink", what="a window's worth of chunks")
        await until(lambda: rig.obj("src").emits == 5, "the fifth chunk waits for a credit")
        assert len(rig.data("sink")) == 4 and rig.state() == {"stage.src.running": 1, "windows": 1}
        assert [(m.kind, m.stage, m.src, m.origin) for m in chunks] == [("chunk", "sink", "src", "src")] * 4
        rig.ep.receive(wire.Credit(1, "sink", "src", 1))
        await until(lambda: len(rig.data("sink")) == 5, "one chunk more per credit")
        await until(lambda: rig.obj("src").emits == 6, "the sixth chunk waits for a credit")
        assert len(rig.data("sink")) == 5
        rig.ep.receive(wire.Credit(1, "sink", "src", 3))
        await until(lambda: len(rig.data("sink", "work")) == 1, "the call returns")
        sent = [m for _, m, _ in rig.ep.sent]
        assert [rig.payload(m)["i"] for m in rig.data("sink", "chunk")] == list(range(6))
        assert type(sent[-1]) is wire.StreamEnd and sent[-1] == wire.StreamEnd(1, "sink", "src")
        assert sent[-2].kind == "work" and rig.payload(sent[-2]) == {"n": 6}
        await until(lambda: rig.state() == {}, "the call and its window are gone")


@aio
async def test_a_stream_reader_that_closes_its_stream_stops_the_producer_sending(tmp_path):
    async with hosted(tmp_path, *STREAM, process="src", limits={"stream_buffer": 2}) as rig:
        rig.work(1, "src", {"n": 5})
        await rig.sent(wire.Data, 2, to="sink")
        rig.ep.receive(wire.Credit(1, "sink", "src", 0, True))  # the reader's call returned
        await until(lambda: rig.data("sink", "work"), "the call returns")
        assert len(rig.data("sink", "chunk")) == 2
        await until(lambda: rig.state() == {}, "the call and its window are gone")


@aio
async def test_a_terminal_stage_streams_to_the_caller_within_its_credits(tmp_path):
    async with hosted(tmp_path, stage("tok", "Tokens", terminal=True), process="tok",
                      limits={"stream_buffer": 4}) as rig:
        rig.work(1, "tok", {"text": "abcdef"})
        events = await rig.sent(wire.Data, 4, to="", what="four events")
        await until(lambda: rig.obj("tok").emits == 5, "the fifth event waits for a credit")
        assert len(rig.data("")) == 4
        assert [(m.kind, m.stage, m.src, m.origin) for m in events] == [("event", "tok", "tok", "tok")] * 4
        rig.ep.receive(wire.Credit(1, "", "tok", 4))  # the caller read them
        await until(lambda: rig.data("", "result"), "the result")
        assert [rig.payload(m)["token"] for m in rig.data("", "event")] == list("abcdef")
        assert rig.payload(rig.data("", "result")[0]) == {"text": "abcdef"}
        await until(lambda: rig.state() == {}, "the call and its window are gone")


@aio
async def test_an_abort_while_waiting_for_credit_ends_the_call(tmp_path):
    async with hosted(tmp_path, stage("tok", "Tokens", terminal=True), process="tok",
                      limits={"stream_buffer": 2}) as rig:
        rig.work(1, "tok", {"text": "abcdef"})
        await rig.sent(wire.Data, 2, to="")
        assert rig.state() == {"stage.tok.running": 1, "windows": 1}
        rig.ep.receive(wire.Abort(1, 2))
        await until(lambda: rig.state() == {}, "the call and its window are gone")
        rig.ep.receive(wire.Credit(1, "", "tok", 2))  # late: harmless
        await until(lambda: rig.state() == {}, "the late credit left nothing behind")
        assert len(rig.data()) == 2 and rig.ep.of_type(wire.Failed) == []


@aio
async def test_a_reader_that_stops_early_closes_its_stream(tmp_path):
    stages = (STREAM[0], stage("sink", "CollectTensors", args={"source": "src", "take": 2}, terminal=True))
    async with hosted(tmp_path, *stages, process="sink", limits={"stream_buffer": 8}) as rig:
        for i in range(4):
            rig.chunk(1, "sink", {"i": i}, src="src", origin="src")
        rig.work(1, "sink", {}, src="src", origin="src")
        (msg,) = await rig.sent(wire.Data, to="")
        assert rig.payload(msg) == {"got": [0, 1], "bad": []}
        assert rig.ep.of_type(wire.Credit, to="src")[-1] == wire.Credit(1, "sink", "src", 0, True)
        rig.ep.receive(wire.Forget(1, 2))
        await until(lambda: rig.state() == {}, "the call is done")


EARLY = (stage("src", "StreamThenReturn", stream_to=["sink"], next="sink"),
         stage("sink", "EarlyReader", args={"source": "src"}, can_accept_stream_before_payload=True, terminal=True))


@aio
async def test_a_reader_that_accepts_its_stream_first_starts_on_the_first_chunk(tmp_path):
    async with hosted(tmp_path, *EARLY, process="sink") as rig:
        rig.chunk(1, "sink", {"i": 0}, src="src", origin="src")
        await until(lambda: rig.state().get("stage.sink.awaiting") == 1, "the call starts without its payload")
        rig.chunk(1, "sink", {"i": 1}, src="src", origin="src")
        rig.ep.receive(wire.StreamEnd(1, "sink", "src"))
        await until(lambda: rig.obj("sink").asked == 1, "the call read its stream and waits for its payload")
        assert rig.ep.of_type(wire.Data) == []
        rig.work(1, "sink", {"n": 2}, src="src", origin="src")
        (msg,) = await rig.sent(wire.Data, to="")
        assert rig.payload(msg) == {"early": True, "got": [0, 1], "payload": {"n": 2}}
        rig.chunk(2, "sink", {"i": 0}, src="src", origin="src")  # another call, aborted before its payload
        await until(lambda: rig.state().get("stage.sink.awaiting") == 1, "request 2's call waits")
        rig.ep.receive(wire.Abort(2, 1))
        rig.work(2, "sink", {"n": 2}, src="src", origin="src")  # late
        rig.ep.receive(wire.Forget(1, 3))
        await until(lambda: rig.state() == {}, "both requests are forgotten")
        assert len(rig.ep.of_type(wire.Data)) == 1 and rig.ep.of_type(wire.Failed) == []


@aio
async def test_a_stream_between_stages_of_one_process_flows_without_messages(tmp_path):
    stages = tuple({**s, "process": "p"} for s in EARLY)
    async with hosted(tmp_path, *stages, process="p", limits={"stream_buffer": 2}) as rig:
        rig.work(1, "src", {"n": 7})  # more chunks than credits: the reader's reads give them back
        (msg,) = await rig.sent(wire.Data, to="")
        assert rig.payload(msg) == {"early": True, "got": list(range(7)), "payload": {"n": 7}}
        assert len(rig.ep.sent) == 1
        await until(lambda: rig.state() == {"stage.sink.finished": 1}, "the calls are done")
        rig.ep.receive(wire.Forget(1, 2))
        assert rig.state() == {}


# -- control messages ---------------------------------------------------------------------------------


@aio
async def test_a_state_query_is_answered_with_a_state_report(tmp_path):
    async with hosted(tmp_path, *FAN_IN, process="join") as rig:
        rig.work(1, "join", {"text": "X"}, src="x", origin="x")
        rig.ep.receive(wire.StateQuery(7))
        (report,) = rig.ep.of_type(wire.StateReport, to="")
        assert (report.token, report.process) == (7, "join")
        assert report.state == rig.host.state() and report.state["stage.join.fan_in"] == 1


@aio
async def test_shutdown_sets_the_stopping_event_and_close_ends_the_calls(tmp_path):
    async with hosted(tmp_path, stage("w", "Waiter", terminal=True), process="w") as rig:
        rig.work(1, "w", {})
        await until(lambda: rig.obj("w").started == ["req-1"], "the call started")
        assert not rig.host.stopping.is_set()
        rig.ep.receive(wire.Shutdown())
        assert rig.host.stopping.is_set()
    assert rig.obj("w").cancelled == ["req-1"]
    assert rig.ep.closed and rig.state() == {}
    assert rig.ep.of_type(wire.Bye, to="") == [wire.Bye("w")]  # close() says goodbye
    assert rig.ep.of_type(wire.Data) == [] and rig.ep.of_type(wire.Failed) == []

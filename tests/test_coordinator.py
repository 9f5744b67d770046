"""The caller's request table, in-process: a real :class:`Coordinator` against a fake endpoint
(the test plays every stage process's messages). Admission, results, streams and their credits,
failures, per-request order, what live processes are told when a request ends (and the floors),
deadlines, and that nothing is left behind. No stage process, no socket; nothing waits on a
sleep: the tests await the requests' futures or poll state with a deadline."""

from __future__ import annotations

import asyncio
import gc
import time
from types import SimpleNamespace

import attrs
import pytest
import torch
from fake_endpoint import FakeEndpoint, aio, until

from omni_core import load_config
from omni_core.errors import Overloaded, PipelineClosed, RequestAborted, RequestTimeout, StageError
from omni_core.plan.topology import build_plan, endpoints
from omni_core.plugins import get_registry
from omni_core.registry import Registry
from omni_core.relay.inline import InlineRelay
from omni_core.relay.payload import unpack
from omni_core.runtime import wire
from omni_core.runtime.coordinator import Coordinator
from omni_core.runtime.lifecycle import Lifecycle
from omni_core.runtime.requests import Event

pytestmark = pytest.mark.timeout(30)

STAGES = "omni_test_stages"


def stage(name: str, factory: str = "Echo", **fields) -> dict:
    return {"name": name, "factory": f"{STAGES}:{factory}", **fields}


class _Lifecycle(Lifecycle):
    """A :class:`Lifecycle` that counts who waits for the pipeline to run again (a retry does)."""

    waiting = 0

    async def wait_running(self, timeout: float | None) -> None:
        self.waiting += 1
        try:
            await super().wait_running(timeout)
        finally:
            self.waiting -= 1


class Rig:
    """A coordinator bound to the plan of ``stages``, every process live, the pipeline running."""

    def __init__(self, *stages: dict, limits: dict | None = None, registry: Registry | None = None, **fields):
        data = {"name": "co", "stages": list(stages), **fields}
        if limits:
            data["limits"] = limits
        self.config = load_config(data)
        registry = registry or get_registry()
        self.plan = build_plan(self.config, registry, devices=())
        self.ep = FakeEndpoint(self.config, registry)
        self.ep.open(addresses=dict(endpoints(self.plan, "/nonexistent")))
        self.lc = _Lifecycle("co")
        self.handles = {p.name: SimpleNamespace(exitcode=None) for p in self.plan.processes}
        self.lc.handles.update(self.handles)
        self.co = Coordinator(self.config, registry, self.ep, self.lc)
        self.co.bind(self.plan)
        self.lc.set("running")

    async def submit(self, inputs=None, **kw) -> asyncio.Task:
        """Start a request and let it be admitted (its inputs sent), refused, or wait for the
        pipeline to run again."""
        sent, waiting = len(self.ep.of_type(wire.Data)), self.lc.waiting
        task = asyncio.ensure_future(self.co.submit({"text": "x"} if inputs is None else inputs, **kw))
        await until(lambda: task.done() or len(self.ep.of_type(wire.Data)) > sent or self.lc.waiting > waiting,
                    "the request's inputs sent, or the request refused or waiting")
        return task

    async def stream(self, inputs=None) -> tuple:
        """Start a streamed request, its inputs sent: its events and the wait for its first."""
        sent = len(self.ep.of_type(wire.Data))
        events = self.co.stream({"text": "x"} if inputs is None else inputs)
        first = asyncio.ensure_future(events.__anext__())
        await until(lambda: first.done() or len(self.ep.of_type(wire.Data)) > sent, "the stream's inputs sent")
        return events, first

    def pending(self, rid: int) -> bool:
        """Request ``rid`` is in flight, unanswered (every message received so far was handled)."""
        assert self.co.state()["ordered"] == 0, "a received message still waits to be handled"
        req = self.co.requests.get(rid)
        return req is not None and not req.future.done()

    def result(self, rid: int, stage: str, payload, **kw) -> None:
        self.ep.receive_data("result", rid, stage, payload, src=stage, origin=self.plan.processes_of(stage)[0], **kw)

    def sent_to(self, name: str) -> list:
        return [m for t, m, _ in self.ep.sent if t == name]

    def ends(self) -> list[tuple[str, str, int, int]]:
        """``(message type, process, rid, floor)`` of every Abort and Forget sent, in order."""
        return [(type(m).__name__, t, m.rid, m.floor) for t, m, _ in self.ep.sent if type(m) in (wire.Abort, wire.Forget)]

    def assert_empty(self) -> None:
        assert self.co.state() == {"requests": 0, "by_id": 0, "ordered": 0}
        assert self.co.pending_deadlines == 0

    def close(self) -> None:
        self.ep.close()


@pytest.fixture
def rigs():
    made: list[Rig] = []

    def make(*stages, **kw) -> Rig:
        rig = Rig(*stages, **kw)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()


LINE = (stage("a", next="b"), stage("b", terminal=True))


def fan_out(**src_fields) -> tuple[dict, ...]:
    """src → b, c (both terminal)."""
    return (stage("src", next=["b", "c"], **src_fields), stage("b", terminal=True), stage("c", terminal=True))


# -- submit and results -----------------------------------------------------------------------


@aio
async def test_a_request_goes_to_the_entry_stage_and_its_result_comes_back(rigs):
    rig = rigs(*LINE)
    task = await rig.submit({"text": "hi", "t": torch.arange(3)}, request_id="mine")
    (to, msg, frames), = rig.ep.sent
    assert to == "a" and type(msg) is wire.Data
    assert (msg.kind, msg.rid, msg.request_id, msg.stage, msg.src, msg.origin) == ("work", 1, "mine", "a", "", "")
    assert msg.relay == "inline" and msg.nframes == len(frames) == 1
    assert rig.co.in_flight() == 1 and rig.co.by_id == {"mine": 1}
    rig.result(1, "b", {"text": "HI"}, request_id="mine")
    assert await task == {"text": "HI"}
    rig.assert_empty()
    assert rig.ends() == []  # no process keeps per-request state: nobody to tell


@aio
async def test_results_with_tensors_come_back_through_the_inline_relay(rigs):
    rig = rigs(*LINE)
    task = await rig.submit()
    rig.result(1, "b", {"x": torch.full((4,), 2.0), "n": 1})
    out = await task
    assert torch.equal(out["x"], torch.full((4,), 2.0)) and out["n"] == 1
    rig.assert_empty()


class _CountedInline(InlineRelay):
    """``inline``, counting the tensors each put and get moved (``moved``, class-wide)."""

    moved: list[tuple[str, int]] = []

    async def put(self, request_id, tensors, target):
        self.moved.append(("put", len(tensors)))
        return await super().put(request_id, tensors, target)

    async def get(self, handle, frames=()):
        tensors = await super().get(handle, frames)
        self.moved.append(("get", len(tensors)))
        return tensors


@aio
async def test_the_callers_edges_take_their_relay_from_the_registry(rigs):
    """The caller's edges are ordinary edges: their relay ('inline') is the registry's, in and out."""
    registry = Registry()
    for entry in get_registry().entries():
        registry.add(attrs.evolve(entry, target=_CountedInline) if (entry.kind, entry.name) == ("relay", "inline")
                     else entry)
    _CountedInline.moved.clear()
    rig = rigs(*LINE, registry=registry)
    task = await rig.submit({"x": torch.ones(3), "y": torch.zeros(2)})
    rig.result(1, "b", {"x": torch.full((4,), 2.0)})
    assert torch.equal((await task)["x"], torch.full((4,), 2.0))
    assert _CountedInline.moved == [("put", 2), ("get", 1)]


@aio
async def test_every_terminal_stage_answers_before_a_multi_terminal_result(rigs):
    rig = rigs(*fan_out())
    task = await rig.submit()
    rig.result(1, "c", {"v": "c"})
    assert rig.pending(1)
    rig.result(1, "c", {"v": "c-again"})  # a repeat replaces, and completes nothing
    assert rig.pending(1)
    rig.result(1, "b", {"v": "b"})
    assert await task == {"b": {"v": "b"}, "c": {"v": "c-again"}}
    rig.assert_empty()


@aio
async def test_terminal_stages_fn_chooses_which_terminals_answer(rigs):
    rig = rigs(*fan_out(), terminal_stages_fn=f"{STAGES}:terminals_from_inputs")
    one = await rig.submit({"terminals": "c"})
    both = await rig.submit({"terminals": None})
    rig.result(1, "b", {"v": "b"})  # not asked of request 1: ignored
    rig.result(1, "c", {"v": "c"})
    assert await one == {"v": "c"}  # one terminal: its result alone
    rig.result(2, "b", {"v": "b"})
    assert rig.pending(2)
    rig.result(2, "c", {"v": "c"})
    assert await both == {"b": {"v": "b"}, "c": {"v": "c"}}
    rig.assert_empty()


@aio
async def test_a_failing_or_wrong_terminal_stages_fn_fails_the_request_at_admission(rigs):
    rig = rigs(*fan_out(), terminal_stages_fn=f"{STAGES}:terminals_from_inputs")
    with pytest.raises(StageError) as err:
        await rig.co.submit({"terminals": ["b", "nowhere"]})
    assert err.value.stage == "terminal_stages_fn" and err.value.error_type == "WiringError"
    assert "nowhere" in str(err.value)
    with pytest.raises(StageError) as err:
        await rig.co.submit({"terminals": []})  # at least one
    assert err.value.error_type == "WiringError"
    rig.assert_empty()
    assert rig.ep.sent == []

    raising = rigs(*fan_out(), terminal_stages_fn=f"{STAGES}:terminals_raises")
    with pytest.raises(StageError) as err:
        await raising.co.submit({})
    assert err.value.stage == "terminal_stages_fn" and err.value.error_type == "RuntimeError"
    assert "terminal_stages exploded" in err.value.traceback
    raising.assert_empty()
    assert raising.ep.sent == []


@aio
async def test_inputs_that_cannot_be_sent_fail_their_request_and_leave_nothing(rigs):
    # What the loop reports of the request's own future is the next test's business.
    asyncio.get_running_loop().set_exception_handler(lambda _, ctx: None)
    rig = rigs(*LINE)
    with pytest.raises(Exception, match=r"payload\['bad'\]"):  # noqa: PT011 - the caller sees why
        await rig.co.submit({"bad": object()}, request_id="bad")
    assert rig.ep.of_type(wire.Data) == []
    assert rig.ends() == [("Abort", "a", 1, 2), ("Abort", "b", 1, 2)]
    rig.assert_empty()


def test_inputs_that_cannot_be_sent_leave_no_unretrieved_error_behind(rigs):
    reports: list[str] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reports.append(ctx["message"]))
        rig = rigs(*LINE)
        try:
            await rig.co.submit({"bad": object()})
        except Exception as exc:  # what the caller sees is the other test's business
            exc.__traceback__ = None
        gc.collect()

    asyncio.run(main())
    assert reports == []


# -- admission ----------------------------------------------------------------------------------


@aio
async def test_one_request_more_than_max_in_flight_is_overloaded(rigs):
    rig = rigs(*LINE, limits={"max_in_flight": 2})
    first, second = await rig.submit(), await rig.submit()
    with pytest.raises(Overloaded, match="max_in_flight"):
        await rig.co.submit({"text": "x"}, request_id="third")
    assert rig.co.in_flight() == 2 and len(rig.ep.sent) == 2
    rig.result(1, "b", 1)
    assert await first == 1
    third = await rig.submit()  # a place came free
    rig.result(2, "b", 2)
    rig.result(3, "b", 3)
    assert (await second, await third) == (2, 3)
    rig.assert_empty()


@aio
async def test_a_pipeline_that_is_not_running_refuses_requests_naming_its_state_and_reason(rigs):
    rig = rigs(*LINE)
    rig.lc.set("new")
    with pytest.raises(PipelineClosed, match=r"'co' is not running \(new\)$"):
        await rig.co.submit({})
    rig.lc.set("stopped")
    rig.lc.closed_reason = RuntimeError("process 'b' died")
    with pytest.raises(PipelineClosed, match=r"\(stopped\): process 'b' died"):
        await rig.co.submit({})
    assert rig.ep.sent == []
    rig.assert_empty()


@aio
async def test_while_restarting_a_request_waits_and_is_admitted_once_running(rigs):
    rig = rigs(*LINE)
    rig.lc.set("restarting")
    task = await rig.submit()
    assert rig.ep.sent == [] and rig.co.in_flight() == 0 and not task.done()
    rig.lc.set("running")
    await until(lambda: rig.ep.sent, "the inputs are sent once running")
    rig.result(1, "b", "ok")
    assert await task == "ok"
    rig.assert_empty()


@aio
async def test_while_restarting_a_request_fails_when_the_pipeline_stops_instead(rigs):
    rig = rigs(*LINE)
    rig.lc.set("restarting")
    task = await rig.submit()
    rig.lc.closed_reason = RuntimeError("restart limit reached")
    rig.lc.set("stopping")
    with pytest.raises(PipelineClosed, match=r"\(stopping\): restart limit reached"):
        await task
    assert rig.ep.sent == []
    rig.assert_empty()


@aio
async def test_a_restart_that_outlasts_request_timeout_fails_the_waiting_request(rigs):
    rig = rigs(*LINE, limits={"request_timeout": 0.05})
    rig.lc.set("restarting")
    with pytest.raises(PipelineClosed, match=r"\(restarting\)"):
        await rig.co.submit({})
    rig.assert_empty()


@aio
async def test_a_request_id_in_flight_cannot_be_used_twice_but_can_once_it_ended(rigs):
    rig = rigs(*LINE)
    task = await rig.submit(request_id="same")
    with pytest.raises(ValueError, match="'same' is already in flight"):
        await rig.co.submit({}, request_id="same")
    with pytest.raises(TypeError, match="request_id must be a string"):
        await rig.co.submit({}, request_id=7)
    assert rig.co.in_flight() == 1 and len(rig.ep.sent) == 1
    rig.result(1, "b", "one", request_id="same")
    assert await task == "one"
    again = await rig.submit(request_id="same")
    rig.result(2, "b", "two", request_id="same")
    assert await again == "two"
    rig.assert_empty()


# -- streams ---------------------------------------------------------------------------------------


@aio
async def test_a_stream_yields_chunks_in_order_and_gives_credits_back_per_batch(rigs):
    rig = rigs(*LINE, limits={"stream_buffer": 8})  # credits go back two at a time
    events, first = await rig.stream()
    for i in range(5):
        rig.ep.receive_data("event", 1, "b", {"i": i}, src="b", origin="b")
    got = [await first] + [await events.__anext__() for _ in range(4)]
    assert got == [Event("chunk", "b", {"i": i}) for i in range(5)]
    assert rig.ep.of_type(wire.Credit, to="b") == [wire.Credit(1, "", "b", 2)] * 2  # the fifth is owed
    rig.ep.receive_data("event", 1, "b", {"i": 5, "t": torch.ones(2)}, src="b", origin="b")
    chunk = await events.__anext__()
    assert chunk.data["i"] == 5 and torch.equal(chunk.data["t"], torch.ones(2))
    assert rig.ep.of_type(wire.Credit, to="b") == [wire.Credit(1, "", "b", 2)] * 3
    rig.result(1, "b", {"text": "X"})
    assert await events.__anext__() == Event("result", "b", {"text": "X"})
    with pytest.raises(StopAsyncIteration):
        await events.__anext__()
    assert len(rig.ep.of_type(wire.Credit)) == 3  # an ended request owes nothing
    rig.assert_empty()


@aio
async def test_chunks_of_a_submitted_request_give_their_credit_back_at_once(rigs):
    rig = rigs(*LINE, limits={"stream_buffer": 4})  # one at a time
    task = await rig.submit()
    for i in range(3):
        rig.ep.receive_data("event", 1, "b", {"i": i}, src="b", origin="b")
    assert rig.ep.of_type(wire.Credit) == [wire.Credit(1, "", "b", 1)] * 3
    rig.ep.receive_data("event", 1, "b", {"i": 9}, src="b", origin="nobody")  # an unknown origin: not posted
    assert len(rig.ep.of_type(wire.Credit)) == 3
    rig.result(1, "b", "done")
    assert await task == "done"
    rig.assert_empty()


@aio
async def test_a_failed_stream_ends_with_the_stage_error_after_its_chunks(rigs):
    rig = rigs(*LINE)
    events, first = await rig.stream()
    rig.ep.receive_data("event", 1, "b", {"i": 0}, src="b", origin="b")
    rig.ep.receive(wire.Failed(1, "b", "RuntimeError", "boom", "Traceback: boom"))
    assert (await first).data == {"i": 0}
    with pytest.raises(StageError, match="boom"):
        await events.__anext__()
    rig.assert_empty()


@aio
async def test_a_stream_the_caller_abandons_aborts_its_request(rigs):
    rig = rigs(*LINE)
    events, first = await rig.stream()
    rig.ep.receive_data("event", 1, "b", {"i": 0}, src="b", origin="b")
    await first
    await events.aclose()
    assert rig.ends() == [("Abort", "a", 1, 2), ("Abort", "b", 1, 2)]
    rig.assert_empty()


# -- failures -------------------------------------------------------------------------------------


@aio
async def test_a_failed_message_becomes_a_stage_error_with_the_remote_traceback(rigs):
    rig = rigs(*LINE)
    task = await rig.submit(request_id="r")
    rig.ep.receive(wire.Failed(1, "a", "ValueError", "bad input", "Traceback (most recent call last):\n  boom\n"))
    with pytest.raises(StageError) as err:
        await task
    e = err.value
    assert (e.stage, e.error_type, e.reason, e.request_id) == ("a", "ValueError", "bad input", "r")
    assert "boom" in e.traceback and "remote traceback (stage 'a')" in str(e)
    assert rig.ends() == [("Abort", "a", 1, 2), ("Abort", "b", 1, 2)]
    rig.assert_empty()


@aio
async def test_dropping_every_terminal_fails_with_no_result(rigs):
    rig = rigs(*fan_out(route_fn=f"{STAGES}:route_by_field"))
    task = await rig.submit()
    rig.ep.receive(wire.Dropped(1, "src", ["b"]))
    assert rig.pending(1)
    rig.ep.receive(wire.Dropped(1, "src", ["c"]))
    with pytest.raises(StageError) as err:
        await task
    assert err.value.error_type == "NoResult" and err.value.stage == "src"
    rig.assert_empty()


@aio
async def test_a_dropped_branch_takes_the_terminals_behind_it_out_of_the_expected_set(rigs):
    # src → b (terminal), c → d (terminal): dropping c leaves b alone to answer.
    rig = rigs(stage("src", next=["b", "c"], route_fn=f"{STAGES}:route_by_field"), stage("b", terminal=True),
               stage("c", next="d"), stage("d", terminal=True))
    task = await rig.submit()
    rig.ep.receive(wire.Dropped(1, "src", ["c"]))
    rig.result(1, "b", "from b")
    assert await task == {"b": "from b"}  # admitted as a multi-terminal request
    rig.assert_empty()


@aio
async def test_unusable_result_messages_fail_their_request_only(rigs):
    rig = rigs(*LINE)
    tasks = [await rig.submit() for _ in range(5)]
    ep = rig.ep
    ep.receive(wire.Data("result", 1, "req-1", "b", "b", b"\xc1", origin="b"))  # not msgpack
    ep.receive(wire.Data("result", 2, "req-2", "b", "b", b"\x80", "inline", b"", 2, "b"), [b"x"])  # frames
    ep.receive(wire.Data("result", 3, "req-3", "b", "b", b"\x80", "shm", b"h", 0, "b"))  # not inline
    ep.receive(wire.Data("work", 4, "req-4", "b", "b", b"\x80", origin="b"))  # not a result
    rig.result(5, "b", "fine")
    assert await tasks[4] == "fine"
    errors = []
    for task in tasks[:4]:
        with pytest.raises(StageError) as err:
            await task
        errors.append(err.value)
    assert all(e.stage == "b" for e in errors)
    assert "cannot decode the result" in errors[0].reason
    assert "announced 2 frames and carried 1" in errors[1].reason
    assert "'inline' relay, not 'shm'" in errors[2].reason
    assert errors[3].error_type == "ProtocolError" and "'work'" in errors[3].reason
    rig.assert_empty()


@aio
async def test_messages_of_ended_requests_are_ignored(rigs):
    rig = rigs(*fan_out(route_fn=f"{STAGES}:route_by_field"))
    task = await rig.submit()
    rig.result(1, "b", "b")
    rig.result(1, "c", "c")
    assert await task == {"b": "b", "c": "c"}
    sent = len(rig.ep.sent)
    rig.result(1, "b", "late")
    rig.result(1, "b", {"t": torch.ones(2)})
    rig.ep.receive_data("event", 1, "b", {"i": 0}, src="b", origin="b")
    rig.ep.receive(wire.Failed(1, "b", "RuntimeError", "late", ""))
    rig.ep.receive(wire.Dropped(1, "src", ["b", "c"]))
    rig.ep.receive(wire.Data("result", 1, "req-1", "b", "b", b"\xc1", "shm", b"", 3))  # broken too
    await until(lambda: rig.co.state()["ordered"] == 0, "every message handled")
    assert len(rig.ep.sent) == sent
    assert rig.co.abort("req-1") is False
    rig.assert_empty()


def _slow_gets(ep: FakeEndpoint) -> asyncio.Event:
    """Make the endpoint's relay gets wait until the returned event is set."""
    gate = asyncio.Event()
    real_get = ep.edges.get

    async def get(relay, handle, frames):
        await gate.wait()
        return await real_get(relay, handle, frames)

    ep.edges.get = get
    return gate


@aio
async def test_a_failure_behind_a_result_still_being_fetched_is_handled_after_it(rigs):
    rig = rigs(*LINE)
    task = await rig.submit()
    gate = _slow_gets(rig.ep)
    rig.result(1, "b", {"t": torch.ones(3)})  # its tensors are on their way in
    rig.ep.receive(wire.Failed(1, "b", "RuntimeError", "sent after the result", ""))
    assert not task.done() and rig.co.in_flight() == 1 and rig.co.state()["ordered"] == 1
    gate.set()
    out = await task
    assert torch.equal(out["t"], torch.ones(3))  # the result came first: the failure is late
    rig.assert_empty()


@aio
async def test_a_stream_chunk_still_being_fetched_is_read_before_the_failure_behind_it(rigs):
    rig = rigs(*LINE)
    events, first = await rig.stream()
    gate = _slow_gets(rig.ep)
    rig.ep.receive_data("event", 1, "b", {"t": torch.zeros(2)}, src="b", origin="b")
    rig.ep.receive_data("event", 1, "b", {"i": 1}, src="b", origin="b")  # no tensors: waits behind it
    rig.ep.receive(wire.Dropped(1, "b", []))
    rig.ep.receive(wire.Failed(1, "b", "RuntimeError", "after two chunks", ""))
    assert rig.co.in_flight() == 1 and rig.co.state()["ordered"] == 1 and not first.done()
    gate.set()
    assert torch.equal((await first).data["t"], torch.zeros(2))
    assert (await events.__anext__()).data == {"i": 1}
    with pytest.raises(StageError, match="after two chunks"):
        await events.__anext__()
    rig.assert_empty()


@aio
async def test_a_request_that_ends_while_its_result_is_fetched_drops_it(rigs):
    rig = rigs(*LINE)
    task = await rig.submit(request_id="gone")
    gate = _slow_gets(rig.ep)
    rig.result(1, "b", {"t": torch.ones(3)}, request_id="gone")
    assert rig.co.abort("gone") is True
    gate.set()
    with pytest.raises(RequestAborted, match="'gone' was aborted"):
        await task
    await until(lambda: rig.co.state()["ordered"] == 0, "the fetched result dropped")
    rig.assert_empty()


# -- what processes are told when requests end ------------------------------------------------------

FAN_IN = (
    stage("src", next=["x", "y"]), stage("x", next="join"), stage("y", next="join"),
    stage("join", wait_for=["x", "y"], merge_fn=f"{STAGES}:concat", terminal=True),
)
ALL = ["src", "x", "y", "join"]


@aio
async def test_a_success_tells_the_stateful_processes_and_a_failure_tells_all(rigs):
    rig = rigs(*FAN_IN)
    ok = await rig.submit()
    rig.result(1, "join", "ok")
    await ok
    assert rig.ends() == [("Forget", "join", 1, 2)]
    bad = await rig.submit()
    rig.ep.receive(wire.Failed(2, "x", "RuntimeError", "no", ""))
    with pytest.raises(StageError):
        await bad
    assert rig.ends()[1:] == [("Abort", p, 2, 3) for p in ALL]
    rig.assert_empty()


@aio
async def test_floors_with_overlapping_requests_and_a_forget_once_idle(rigs):
    rig = rigs(*FAN_IN)
    r1, r2, r3 = [await rig.submit() for _ in range(3)]
    # 2 fails while 1 is in flight: the floor stays at 1; every process may now remember 2.
    rig.ep.receive(wire.Failed(2, "x", "RuntimeError", "no", ""))
    with pytest.raises(StageError):
        await r2
    assert rig.ends() == [("Abort", p, 2, 1) for p in ALL]
    del rig.ep.sent[:]
    rig.result(1, "join", "one")  # the oldest ends: the floor jumps past 2 to 3
    await r1
    assert rig.ends() == [("Forget", "join", 1, 3)]
    del rig.ep.sent[:]
    rig.result(3, "join", "three")  # idle: those that heard only of 2's end learn the floor
    await r3
    assert rig.ends()[0] == ("Forget", "join", 3, 4)
    assert sorted(rig.ends()[1:]) == [("Forget", p, 0, 4) for p in sorted(["src", "x", "y"])]
    del rig.ep.sent[:]
    r4 = await rig.submit()  # nothing more to forget afterwards
    rig.result(4, "join", "four")
    await r4
    assert rig.ends() == [("Forget", "join", 4, 5)]
    rig.assert_empty()


@aio
async def test_a_later_request_ending_first_leaves_the_floor_at_the_oldest(rigs):
    rig = rigs(*FAN_IN)
    r1, r2 = await rig.submit(), await rig.submit()
    rig.result(2, "join", "two")
    await r2
    assert rig.ends() == [("Forget", "join", 2, 1)]
    rig.co.abort("req-1")
    with pytest.raises(RequestAborted):
        await r1
    assert rig.ends()[1:] == [("Abort", p, 1, 3) for p in ALL]  # to all, at the new floor: enough
    rig.assert_empty()


@aio
async def test_a_pipeline_without_per_request_state_hears_the_floor_once_idle_after_a_failure(rigs):
    rig = rigs(*LINE)
    r1, r2 = await rig.submit(), await rig.submit()
    rig.co.abort("req-2")
    with pytest.raises(RequestAborted):
        await r2
    assert rig.ends() == [("Abort", "a", 2, 1), ("Abort", "b", 2, 1)]
    rig.result(1, "b", "one")
    await r1
    assert sorted(rig.ends()[2:]) == [("Forget", "a", 0, 3), ("Forget", "b", 0, 3)]
    rig.assert_empty()


@aio
async def test_only_live_processes_are_told(rigs):
    rig = rigs(*FAN_IN)
    rig.handles["x"].exitcode = -9
    del rig.lc.handles["y"]  # not started (yet)
    r1, r2 = await rig.submit(), await rig.submit()
    rig.co.abort("req-2")
    with pytest.raises(RequestAborted):
        await r2
    assert rig.ends() == [("Abort", "src", 2, 1), ("Abort", "join", 2, 1)]
    rig.handles["join"].exitcode = 1
    rig.result(1, "join", "one")
    await r1
    assert rig.ends()[2:] == [("Forget", "src", 0, 3)]
    rig.assert_empty()


# -- deadlines -----------------------------------------------------------------------------------------


@aio
async def test_requests_time_out_in_admission_order(rigs):
    rig = rigs(*LINE, limits={"request_timeout": 0.1})
    tasks = [await rig.submit(request_id=f"r{i}") for i in range(1, 5)]
    rig.result(2, "b", "in time", request_id="r2")
    assert await tasks[1] == "in time"
    done_order = []
    for i in (0, 2, 3):
        tasks[i].add_done_callback(lambda _, name=f"r{i + 1}": done_order.append(name))
    for i in (0, 2, 3):
        with pytest.raises(RequestTimeout, match=r"took longer than limits.request_timeout \(0.1 s\)"):
            await tasks[i]
    await until(lambda: len(done_order) == 3, "the three requests' ends seen")
    assert done_order == ["r1", "r3", "r4"]
    aborted = list(dict.fromkeys(m.rid for m in rig.ep.of_type(wire.Abort)))
    assert aborted == [1, 3, 4]
    assert not rig.co.timer_armed
    rig.assert_empty()


@aio
async def test_a_request_admitted_later_gets_its_own_deadline(rigs):
    rig = rigs(*LINE, limits={"request_timeout": 0.1})
    first = await rig.submit()
    loop = asyncio.get_running_loop()
    with pytest.raises(RequestTimeout):
        await first
    first_done = loop.time()
    second = await rig.submit()
    second_admitted = loop.time()
    with pytest.raises(RequestTimeout):
        await second
    assert loop.time() - second_admitted >= 0.09 and loop.time() > first_done
    rig.assert_empty()


# -- supervision's side: fail_where, abort_all, drain ------------------------------------------------


@aio
async def test_fail_where_fails_the_requests_that_may_use_the_processes(rigs):
    rig = rigs(stage("a", next="b"), stage("b", terminal=True, replicas=2))
    assert [p.name for p in rig.plan.processes] == ["a", "b#0", "b#1"]
    tasks = [await rig.submit() for _ in range(4)]  # rids 1, 3 use b#1; 2, 4 use b#0
    hit = rig.co.fail_where({"b#1"}, lambda req: RuntimeError(f"b#1 died under {req.request_id}"))
    assert hit == 2
    for i in (0, 2):
        with pytest.raises(RuntimeError, match=f"b#1 died under req-{i + 1}"):
            await tasks[i]
    assert rig.co.fail_where({"elsewhere"}, lambda req: RuntimeError()) == 0
    assert rig.co.processes_of(2) == {"a", "b#0"}
    rig.result(2, "b", 2)
    rig.result(4, "b", 4)
    assert (await tasks[1], await tasks[3]) == (2, 4)
    rig.assert_empty()


@aio
async def test_abort_all_fails_every_request_in_flight_with_the_reason(rigs):
    rig = rigs(*LINE, limits={"request_timeout": 5})
    tasks = [await rig.submit() for _ in range(3)]
    rig.co.abort_all(RuntimeError("process 'a' died"))
    for task in tasks:
        with pytest.raises(RequestAborted, match=r"the pipeline stopped \(process 'a' died\)"):
            await task
    assert not rig.co.timer_armed
    more = await rig.submit()
    rig.co.abort_all(None)
    with pytest.raises(RequestAborted, match=r"the pipeline stopped$"):
        await more
    rig.assert_empty()


@aio
async def test_drain_waits_for_the_requests_in_flight_until_its_deadline(rigs):
    rig = rigs(*LINE)
    await rig.co.drain(time.monotonic() + 5)  # nothing in flight: at once
    t1, t2 = await rig.submit(), await rig.submit()
    drain = asyncio.ensure_future(rig.co.drain(time.monotonic() + 5))
    rig.result(1, "b", 1)
    await until(t1.done, "request 1 answered")
    assert not drain.done()
    rig.result(2, "b", 2)
    await drain
    assert (await t1, await t2) == (1, 2)
    t3 = await rig.submit()
    await rig.co.drain(time.monotonic() - 1)  # past its deadline: at once
    began = time.monotonic()
    await rig.co.drain(time.monotonic() + 0.05)
    assert time.monotonic() - began >= 0.04 and not t3.done()
    rig.co.abort_all(None)
    with pytest.raises(RequestAborted):
        await t3
    rig.assert_empty()


# -- nothing left behind ------------------------------------------------------------------------------


@aio
async def test_nothing_is_left_behind_after_many_mixed_requests(rigs):
    rig = rigs(*FAN_IN, limits={"request_timeout": 30, "max_in_flight": 64})
    outcomes: dict[str, int] = {}
    for batch in range(4):
        first = batch * 50 + 1
        sent = len(rig.ep.of_type(wire.Data))
        tasks = {rid: asyncio.ensure_future(rig.co.submit({"i": rid})) for rid in range(first, first + 50)}
        await until(lambda s=sent: len(rig.ep.of_type(wire.Data)) == s + 50, "the 50 requests' inputs sent")
        assert rig.co.in_flight() == 50
        for rid, task in tasks.items():
            kind = rid % 6
            if kind == 0:
                rig.result(rid, "join", {"rid": rid})
            elif kind == 1:
                rig.result(rid, "join", {"rid": rid, "t": torch.full((2,), float(rid))})
            elif kind == 2:
                rig.ep.receive(wire.Failed(rid, "x", "RuntimeError", "no", ""))
            elif kind == 3:
                rig.co.abort(f"req-{rid}")
            elif kind == 4:
                task.cancel()
            else:
                rig.ep.receive(wire.Dropped(rid, "join", []))  # drops nothing
                rig.ep.receive_data("event", rid, "join", {"c": 1}, src="join", origin="join")
                rig.result(rid, "join", {"rid": rid})
        for rid, task in tasks.items():
            try:
                out = await task
                assert out["rid"] == rid
                name = "ok"
            except (StageError, RequestAborted, asyncio.CancelledError) as exc:
                name = type(exc).__name__
            outcomes[name] = outcomes.get(name, 0) + 1
    assert outcomes == {"ok": 100, "StageError": 34, "RequestAborted": 33, "CancelledError": 33}
    rig.assert_empty()
    assert rig.co.behind == set()
    last = rig.ep.sent[-1][1]
    assert type(last) in (wire.Forget, wire.Abort) and last.floor == 201
    work = rig.ep.of_type(wire.Data, to="src")
    assert [m.rid for m in work] == list(range(1, 201))
    assert [unpack(m.skeleton, [])["i"] for m in work] == list(range(1, 201))


# -- where a request is, retries, what a restarted process is told ---------------------------------


@aio
async def test_a_death_spares_the_requests_the_caller_heard_from_past_the_dead_stage(rigs):
    from omni_core.errors import ProcessDied

    rig = rigs(stage("a", next="b"), stage("b", next="c"), stage("c", terminal=True))
    past = await rig.submit()
    before = await rig.submit()
    rig.ep.receive_data("event", 1, "c", {"i": 0}, src="c", origin="c")  # request 1 is streaming from c
    assert rig.co.fail_where({"b"}, lambda req: ProcessDied(process="b", pid=1, request_id=req.request_id)) == 1
    with pytest.raises(ProcessDied):
        await before
    assert rig.co.processes_of(1, rig.co.past(rig.co.requests[1])) == {"c"}
    rig.result(1, "c", "done")
    assert await past == "done"
    rig.assert_empty()


@aio
async def test_a_retryable_request_runs_again_under_a_new_rid_once_running(rigs):
    from omni_core.errors import ProcessDied

    rig = rigs(*LINE, retry={"attempts": 2}, restart="on-failure", limits={"request_timeout": 30})
    task = await rig.submit({"text": "x"}, request_id="mine")
    died = lambda req: ProcessDied(process="b", pid=1, request_id=req.request_id)  # noqa: E731
    rig.lc.set("restarting")
    assert rig.co.fail_where({"b"}, died) == 1
    assert not task.done() and rig.co.by_id == {"mine": 2} and list(rig.co.requests) == [2]
    assert ("Abort", "a", 1, 2) in rig.ends()
    assert rig.co.ended() == (2, ())
    await until(lambda: rig.lc.waiting == 1, "the retry waits for the group to be back")
    assert len([m for m in rig.sent_to("a") if type(m) is wire.Data]) == 1, "nothing is sent while the group restarts"
    rig.lc.set("running")
    await until(lambda: len([m for m in rig.sent_to("a") if type(m) is wire.Data]) == 2, "the retry sent")
    again = [m for m in rig.sent_to("a") if type(m) is wire.Data][-1]
    assert (again.rid, again.request_id) == (2, "mine")
    rig.result(1, "b", "from the failed attempt")  # dropped: that attempt ended
    rig.result(2, "b", "answer", request_id="mine")
    assert await task == "answer"
    assert rig.co.retries == {"ProcessDied": 1}
    # the last attempt fails for good
    task = await rig.submit({"text": "y"})
    rig.lc.set("restarting")
    rig.co.fail_where({"b"}, died)
    rig.lc.set("running")
    await until(lambda: rig.co.requests and next(iter(rig.co.requests)) == 4, "retried")
    rig.co.fail_where({"b"}, died)
    with pytest.raises(ProcessDied):
        await task
    rig.assert_empty()


@aio
async def test_a_retry_waiting_for_the_restart_fails_with_the_first_error_if_the_pipeline_stops(rigs):
    from omni_core.errors import ProcessDied

    rig = rigs(*LINE, retry={"attempts": 3}, restart="on-failure")
    task = await rig.submit()
    rig.lc.set("restarting")
    rig.co.fail_where({"a"}, lambda req: ProcessDied(process="a", pid=1, request_id=req.request_id))
    rig.lc.set("stopping")
    with pytest.raises(ProcessDied):
        await task
    rig.assert_empty()


@aio
async def test_a_restarted_process_is_told_the_floor_and_the_requests_ended_above_it(rigs):
    rig = rigs(*LINE)
    tasks = [await rig.submit() for _ in range(5)]
    rig.result(2, "b", 2)
    rig.result(4, "b", 4)
    rig.co.abort("req-1")
    assert rig.co.ended() == (3, (4,))
    for rid in (3, 5):
        rig.result(rid, "b", rid)
    await asyncio.gather(*tasks, return_exceptions=True)
    assert rig.co.ended() == (6, ())

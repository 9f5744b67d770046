"""Per-request isolation: every failure path fails its request only, with a clear error, and the
pipeline keeps serving; aborts, timeouts, admission, start-up failures."""

from __future__ import annotations

import asyncio
import os
import re

import pytest
import zmq
from runtime_helpers import arun, fn, no_leaks, pipeline, running_in, stage, until, until_state  # noqa: F401

from omni_core import Pipeline, StageError, StartupError
from omni_core.errors import ConfigError, Overloaded, RequestAborted, RequestTimeout

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_leaks")]


async def _fail_then_serve(cfg, bad, good):
    """Submit a failing request, then a good one: return (error, good result)."""
    async with Pipeline(cfg) as p:
        with pytest.raises(StageError) as info:
            await p.submit(bad, request_id="bad")
        return info.value, await p.submit(good, request_id="bad")


def test_exception_in_a_stage_fails_that_request_with_its_traceback_and_the_stage_keeps_serving():
    cfg = pipeline(stage("echo", "Echo", next="f"), stage("f", "Fail", terminal=True))
    error, ok = arun(_fail_then_serve(cfg, {"text": "x", "fail": True}, {"text": "y"}))
    assert error.stage == "f" and error.request_id == "bad" and error.error_type == "RuntimeError"
    assert "boom on x" in str(error)
    assert 'raise RuntimeError(f"boom on' in error.traceback
    assert ok == {"text": "y"}


CASES = {
    "route_fn": (dict(next=["a"], route_fn=fn("route_raises")), "route exploded"),
    "route_fn_unknown_target": (dict(next=["a"], route_fn=fn("route_unknown")), re.escape("not in ['a']")),
    "project_payload": (dict(next=["a"], project_payload={"a": fn("project_raises")}), "projection exploded"),
    "stream_done_to_fn": (dict(next=["a"], stream_to=["a"], stream_done_to_fn=fn("stream_done_raises")), "stream_done exploded"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_exception_in_a_source_side_function_fails_the_request_only(case):
    fields, message = CASES[case]
    cfg = pipeline(
        stage("src", "Echo", **fields),
        stage("a", "Echo", terminal=True, can_accept_stream_before_payload=True),
    )

    async def body():
        async with Pipeline(cfg) as p:
            with pytest.raises(StageError, match=message) as info:
                await p.submit({"n": 1})
            return info.value

    error = arun(body())
    assert error.stage == "src"


@pytest.mark.parametrize("case", ["merge_fn", "wait_for_fn"])
def test_exception_in_a_fan_in_function_fails_the_request_and_the_stage_keeps_serving(case):
    join = {"merge_fn": fn("merge_raises")} if case == "merge_fn" else {"merge_fn": fn("concat"), "wait_for_fn": fn("wait_for_raises")}
    cfg = pipeline(
        stage("src", "Echo", next=["a", "b"]),
        stage("a", "Echo", next="join"),
        stage("b", "Echo", next="join"),
        stage("join", "Echo", wait_for=["a", "b"], terminal=True, **join),
    )

    async def body():
        async with Pipeline(cfg) as p:
            for _ in range(2):  # twice: the first failure must not poison the stage
                with pytest.raises(StageError, match="exploded") as info:
                    await p.submit({"text": "t"})
                assert info.value.stage == "join"

    arun(body())


def test_exception_in_terminal_stages_fn_fails_at_submit():
    cfg = pipeline(stage("a", "Echo", terminal=True), terminal_stages_fn=fn("terminals_raises"))

    async def body():
        async with Pipeline(cfg) as p:
            with pytest.raises(StageError, match="terminal_stages exploded") as info:
                await p.submit({})
            assert info.value.stage == "terminal_stages_fn"
            assert p.requests == {}

    arun(body())


def test_unencodable_payload_names_its_path_and_the_stage_keeps_serving():
    cfg = pipeline(stage("u", "Unencodable", next="end"), stage("end", "Echo", terminal=True))
    error, ok = arun(_fail_then_serve(cfg, {"bad": True}, {}))
    assert error.stage == "u" and "payload['bad']" in str(error) and "allow_pickle" in str(error)
    assert ok == {"ok": 1}


def test_admission_limit_raises_overloaded_not_a_queue():
    cfg = pipeline(stage("s", "Sleep", terminal=True), limits={"max_in_flight": 2})

    async def body():
        async with Pipeline(cfg) as p:
            first = [asyncio.ensure_future(p.submit({"sleep": 30}, request_id=f"r{i}")) for i in range(2)]
            await until(lambda: len(p.requests) == 2, "the first two requests to be admitted")
            with pytest.raises(Overloaded, match="max_in_flight"):
                await p.submit({"sleep": 0})
            for i in range(2):
                await p.abort(f"r{i}")
            assert all(isinstance(r, RequestAborted) for r in await asyncio.gather(*first, return_exceptions=True))
            return await p.submit({"sleep": 0})

    assert arun(body()) == {"sleep": 0}


def test_abort_cancels_the_request_everywhere_and_the_id_can_be_reused():
    cfg = pipeline(stage("a", "Echo", next="s"), stage("s", "Sleep", terminal=True))

    async def body():
        async with Pipeline(cfg) as p:
            task = asyncio.ensure_future(p.submit({"sleep": 30}, request_id="r1"))
            await until_state(p, running_in("s"), "the request to reach stage s")
            assert await p.abort("r1") is True
            with pytest.raises(RequestAborted):
                await task
            assert await p.abort("r1") is False
            assert await p.abort("never-seen") is False
            return await p.submit({"sleep": 0}, request_id="r1")

    assert arun(body(), timeout=20) == {"sleep": 0}


def test_sync_stage_sees_ctx_aborted(tmp_path):
    marker = tmp_path / "marker"
    cfg = pipeline(stage("a", "AbortAware", terminal=True))

    async def body():
        async with Pipeline(cfg) as p:
            task = asyncio.ensure_future(p.submit({"marker": str(marker)}, request_id="r"))
            await until(marker.exists, "the stage to start the request")
            await p.abort("r")
            with pytest.raises(RequestAborted):
                await task
            await until(lambda: marker.read_text() == "aborted", "the stage to see ctx.aborted")

    arun(body(), timeout=100)
    assert marker.read_text() == "aborted"


def test_a_request_id_in_flight_cannot_be_used_twice(tmp_path):
    cfg = pipeline(stage("s", "Sleep", terminal=True))

    async def body():
        async with Pipeline(cfg) as p:
            task = asyncio.ensure_future(p.submit({"gate": str(tmp_path / "go")}, request_id="same"))
            await until(lambda: "same" in p.by_id, "the first request to be admitted")
            with pytest.raises(ValueError, match="already in flight"):
                await p.submit({"sleep": 0}, request_id="same")
            (tmp_path / "go").touch()
            await task

    arun(body())


def test_request_timeout_fails_the_request_and_frees_it():
    cfg = pipeline(stage("s", "Sleep", terminal=True), limits={"request_timeout": 0.3})

    async def body():
        async with Pipeline(cfg) as p:
            with pytest.raises(RequestTimeout, match="request_timeout"):
                await p.submit({"sleep": 30}, request_id="slow")
            return await p.submit({"sleep": 0}, request_id="slow")

    assert arun(body()) == {"sleep": 0}


def test_malformed_control_messages_are_dropped_and_the_process_keeps_serving():
    cfg = pipeline(stage("a", "Upper", terminal=True))

    async def body():
        async with Pipeline(cfg) as p:
            ctx = zmq.Context.instance()
            sock = ctx.socket(zmq.PUSH)
            sock.connect(p.addresses["a"])
            for junk in ([b"\x00garbage"], [b"\x93\x01\x02"], [b""], [b"\x91\xa1d", b"extra"]):
                sock.send_multipart(junk)
            sock.close(linger=1000)
            await until_state(p, lambda s: s["a"].get("inbox.refused", 0) + s["a"].get("inbox.malformed", 0) == 4,
                              "process a dropped the four messages")
            return await p.submit({"text": "still here"})

    assert arun(body()) == {"text": "STILL HERE"}


def test_factory_exception_is_a_startup_error_with_the_child_traceback():
    cfg = pipeline(stage("ok", "Echo", next="bad"), stage("bad", "BadFactory", terminal=True))

    async def body():
        p = Pipeline(cfg)
        with pytest.raises(StartupError) as info:
            await p.start()
        return info.value

    error = arun(body())
    assert error.process == "bad"
    assert "cannot load the model weights" in str(error)
    assert "raise ValueError" in error.traceback


def test_args_the_factory_does_not_accept_are_an_error_with_its_signature():
    # Caught by validation when the factory is already imported here, else by the stage process.
    cfg = pipeline(stage("s", "Scale", args={"factr": 2}, terminal=True))

    async def body():
        with pytest.raises((ConfigError, StartupError), match=r"factr(.|\n)*Scale\(factor: float = 2.0\)"):
            await Pipeline(cfg).start()

    arun(body())


def test_unknown_factory_is_a_config_error_before_anything_starts():
    with pytest.raises(ConfigError, match=r"stages\[0\].factory"):
        Pipeline(pipeline({"name": "a", "factory": "no_such_module_xyz:Stage", "terminal": True}))


def test_runtime_dir_is_private():
    cfg = pipeline(stage("a", "Echo", terminal=True))

    async def body():
        async with Pipeline(cfg) as p:
            return os.stat(p.runtime_dir).st_mode & 0o777

    assert arun(body()) == 0o700

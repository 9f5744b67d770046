"""Wiring through real stage processes: next, fan-out, fan-in, route_fn, wait_for_fn,
project_payload, terminal stages, shared processes, env, tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runtime_helpers import arun, fn, no_leaks, pipeline, stage  # noqa: F401

import omni_core
from omni_core import Pipeline

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_leaks")]


async def _submit_all(cfg, *inputs, **kw):
    async with Pipeline(cfg) as p:
        return [await p.submit(i, **kw) for i in inputs]


def test_chain_across_processes_returns_the_terminal_result():
    cfg = pipeline(
        stage("up", "Upper", next="bang"),
        stage("bang", "AddSuffix", args={"suffix": "!"}, terminal=True),
    )
    [result] = arun(_submit_all(cfg, {"text": "hi"}))
    assert result == {"text": "HI!", "by": ["bang"]}


def test_run_helper_is_synchronous_one_shot():
    cfg = pipeline(stage("up", "Upper", terminal=True))
    assert omni_core.run(cfg, {"text": "abc"}) == {"text": "ABC"}


def test_fan_out_then_fan_in_merges_every_branch():
    cfg = pipeline(
        stage("up", "Upper", next=["a", "b"]),
        stage("a", "AddSuffix", args={"suffix": "A"}, next="join"),
        stage("b", "AddSuffix", args={"suffix": "B"}, next="join"),
        stage("join", "Echo", wait_for=["a", "b"], merge_fn=fn("concat"), terminal=True),
    )
    assert arun(_submit_all(cfg, {"text": "x"}, {"text": "y"})) == [{"text": "XA+XB"}, {"text": "YA+YB"}]


def test_fan_in_inside_one_process_passes_objects():
    cfg = pipeline(
        stage("up", "Upper", next=["a", "b"], process="one"),
        stage("a", "AddSuffix", args={"suffix": "A"}, next="join", process="one"),
        stage("b", "AddSuffix", args={"suffix": "B"}, next="join", process="one"),
        stage("join", "Pid", wait_for=["a", "b"], merge_fn=fn("concat"), terminal=True, process="one"),
    )

    async def body():
        async with Pipeline(cfg) as p:
            assert len(p.pids()) == 1
            result = await p.submit({"text": "q"})
            assert result["pid"] == next(iter(p.pids().values()))
            return result

    assert arun(body())["text"] == "QA+QB"


def test_local_fan_out_gives_each_target_its_own_copy():
    cfg = pipeline(
        stage("src", "Echo", next=["a", "b"], process="p"),
        stage("a", "Mutate", next="join", process="p"),
        stage("b", "Mutate", next="join", process="p"),
        stage("join", "Echo", wait_for=["a", "b"], merge_fn="omni.by_source", terminal=True, process="p"),
    )
    [result] = arun(_submit_all(cfg, {"seen": []}))
    assert result == {"a": {"seen": ["a"]}, "b": {"seen": ["b"]}}


def test_route_fn_picks_a_subset_of_next():
    cfg = pipeline(
        stage("src", "Echo", next=["a", "b"], route_fn=fn("route_by_field")),
        stage("a", "AddSuffix", args={"suffix": "A"}, terminal=True),
        stage("b", "AddSuffix", args={"suffix": "B"}, terminal=True),
    )
    results = arun(_submit_all(cfg, {"text": "1", "route": "a"}, {"text": "2", "route": ["b"]}, {"text": "3", "route": "*"}))
    assert results[0] == {"a": {"text": "1A", "route": "a", "by": ["a"]}}
    assert results[1] == {"b": {"text": "2B", "route": ["b"], "by": ["b"]}}
    assert set(results[2]) == {"a", "b"}


def test_routing_away_from_every_terminal_fails_clearly():
    cfg = pipeline(
        stage("src", "Echo", next=["a"], route_fn=fn("route_by_field")),
        stage("a", "Echo", terminal=True),
    )
    with pytest.raises(omni_core.StageError, match="routing skipped every terminal stage"):
        arun(_submit_all(cfg, {"route": []}))


def test_wait_for_fn_chooses_the_sources_per_request():
    cfg = pipeline(
        stage("src", "Echo", next=["a", "b"], route_fn=fn("route_by_field")),
        stage("a", "AddSuffix", args={"suffix": "A"}, next="join"),
        stage("b", "AddSuffix", args={"suffix": "B"}, next="join"),
        stage("join", "Echo", wait_for=["a", "b"], wait_for_fn=fn("wait_for_named"), merge_fn=fn("concat"), terminal=True),
    )
    results = arun(_submit_all(
        cfg,
        {"text": "only-a", "route": "a", "wait": ["a"]},
        {"text": "both", "route": "*", "wait": None},
    ))
    assert results == [{"text": "only-aA"}, {"text": "bothA+bothB"}]


def test_project_payload_shapes_what_each_target_receives():
    cfg = pipeline(
        stage("src", "Echo", next=["full", "short"], project_payload={"short": fn("project_len")}),
        stage("full", "Echo", terminal=True),
        stage("short", "Echo", terminal=True),
    )
    [result] = arun(_submit_all(cfg, {"text": "hello"}))
    assert result == {"full": {"text": "hello"}, "short": {"len": 5}}


def test_terminal_stages_fn_selects_which_terminals_answer():
    cfg = pipeline(
        stage("src", "Echo", next=["a", "b"]),
        stage("a", "AddSuffix", args={"suffix": "A"}, terminal=True),
        stage("b", "Sleep", terminal=True),
        terminal_stages_fn=fn("terminals_from_inputs"),
    )
    [one, both] = arun(_submit_all(cfg, {"text": "t", "terminals": ["a"]}, {"text": "u", "sleep": 0, "terminals": None}))
    assert one == {"text": "tA", "terminals": ["a"], "by": ["a"]}
    assert set(both) == {"a", "b"}


def test_tensors_and_arrays_cross_processes_intact():
    cfg = pipeline(stage("a", "Echo", next="b"), stage("b", "Echo", terminal=True))
    payload = {
        "t": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        "n": np.arange(5, dtype=np.int16),
        "nested": [torch.ones(0), {"b": torch.tensor([True, False])}],
        "raw": b"\x00\x01",
    }
    [out] = arun(_submit_all(cfg, payload))
    assert torch.equal(out["t"], payload["t"])
    assert isinstance(out["n"], np.ndarray) and np.array_equal(out["n"], payload["n"])
    assert out["nested"][0].numel() == 0 and torch.equal(out["nested"][1]["b"], payload["nested"][1]["b"])
    assert out["raw"] == b"\x00\x01"


def test_env_defaults_and_stage_env_reach_the_process_and_operator_env_wins(monkeypatch):
    monkeypatch.setenv("OMNI_TEST_OPERATOR", "operator")
    cfg = pipeline(
        stage("env", "Env", terminal=True, env={"OMNI_TEST_STAGE": "stage", "OMNI_TEST_OPERATOR": "stage"}),
        env_defaults={"OMNI_TEST_DEFAULT": "default"},
    )
    [out] = arun(_submit_all(cfg, {"keys": ["OMNI_TEST_STAGE", "OMNI_TEST_DEFAULT", "OMNI_TEST_OPERATOR", "OMP_NUM_THREADS"]}))
    assert out["OMNI_TEST_STAGE"] == "stage"
    assert out["OMNI_TEST_DEFAULT"] == "default"
    assert out["OMNI_TEST_OPERATOR"] == "operator"
    assert int(out["OMP_NUM_THREADS"]) >= 1


def test_hundreds_of_requests_in_flight_all_complete():
    cfg = pipeline(
        stage("up", "Upper", next=["a", "b"]),
        stage("a", "AddSuffix", args={"suffix": "A"}, next="join", process="ab"),
        stage("b", "AddSuffix", args={"suffix": "B"}, next="join", process="ab"),
        stage("join", "Echo", wait_for=["a", "b"], merge_fn=fn("concat"), terminal=True),
    )

    async def body():
        import asyncio

        async with Pipeline(cfg) as p:
            return await asyncio.gather(*(p.submit({"text": f"r{i}"}, request_id=f"id-{i}") for i in range(400)))

    results = arun(body())
    assert results == [{"text": f"R{i}A+R{i}B"} for i in range(400)]


def test_max_concurrency_bounds_calls_of_one_stage():
    cfg = pipeline(stage("c", "Concurrency", terminal=True, max_concurrency=3))

    async def body():
        import asyncio

        async with Pipeline(cfg) as p:
            return await asyncio.gather(*(p.submit({"sleep": 0.05}) for _ in range(12)))

    assert max(r["peak"] for r in arun(body())) == 3


def test_replicas_share_the_load_and_keep_fan_in_together():
    cfg = pipeline(
        stage("src", "Echo", next=["a", "b"]),
        stage("a", "Pid", next="join", replicas=2),
        stage("b", "Echo", next="join"),
        stage("join", "Echo", wait_for=["a", "b"], merge_fn="omni.by_source", terminal=True, replicas=2),
    )

    async def body():
        import asyncio

        async with Pipeline(cfg) as p:
            assert len(p.pids()) == 6
            return await asyncio.gather(*(p.submit({"i": i}) for i in range(20)))

    results = arun(body())
    assert [r["b"]["i"] for r in results] == list(range(20))
    assert len({r["a"]["pid"] for r in results}) == 2


def test_sync_pipeline_serves_blocking_callers_from_threads():
    from concurrent.futures import ThreadPoolExecutor

    from omni_core import SyncPipeline

    cfg = pipeline(stage("up", "Upper", next="tok"), stage("tok", "Tokens", terminal=True))
    with SyncPipeline(cfg) as p:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: p.submit({"text": f"t{i}"}), range(8)))
        events = list(p.stream({"text": "ab"}))
    assert results == [{"text": f"T{i}"} for i in range(8)]
    assert [e.data for e in events] == [{"token": "A"}, {"token": "B"}, {"text": "AB"}]


def test_stage_processes_start_in_the_callers_working_directory(tmp_path, monkeypatch):
    cfg = pipeline(stage("c", "Cwd", terminal=True))
    monkeypatch.chdir(tmp_path)
    [out] = arun(_submit_all(cfg, {}))
    assert out == {"cwd": str(tmp_path)}

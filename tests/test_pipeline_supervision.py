"""Supervision: a dead stage process fails its requests at once; restart policy; children die
with their parent; stop() leaves nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from runtime_helpers import (  # noqa: F401
    arun,
    descendants,
    no_leaks,
    pipeline,
    running_in,
    runtime_dirs,
    stage,
    until,
    until_state,
)

from omni_core import Pipeline, ProcessDied
from omni_core.errors import PipelineClosed, RequestAborted
from omni_core.testing.leaks import alive
from omni_core.testing.waiting import holds_within

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]


def test_sigkill_of_a_stage_fails_requests_in_flight_within_two_seconds_and_stops_the_pipeline():
    # Tensors travel a -> s through shm: the no_leaks fixture checks no segment of the run is left.
    cfg = pipeline(stage("a", "Echo", next="s"), stage("s", "Sleep", terminal=True), relay="shm")

    async def body():
        async with Pipeline(cfg) as p:
            tasks = [asyncio.ensure_future(p.submit({"sleep": 30, "t": torch.ones(1 << 18)})) for _ in range(5)]
            await until(lambda: len(p.requests) == 5, "the five requests to be in flight")
            victim = p.pids()["s"]
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            elapsed = time.monotonic() - killed_at
            await until(lambda: not p.running, "the pipeline to stop after the death")
            with pytest.raises(PipelineClosed, match="died"):
                await p.submit({"sleep": 0})
            return results, elapsed, victim

    results, elapsed, victim = arun(body(), timeout=30)
    assert elapsed < 2.0
    for error in results:
        assert isinstance(error, ProcessDied)
        assert error.process == "s" and error.pid == victim and error.signal == "SIGKILL"
        assert "stages: s" in str(error)


def test_restart_on_failure_brings_the_process_back_a_bounded_number_of_times():
    cfg = pipeline(stage("c", "Crash", terminal=True), restart={"policy": "on-failure", "max_restarts": 1})

    async def body():
        async with Pipeline(cfg) as p:
            first_pid = p.pids()["c"]
            with pytest.raises(ProcessDied) as info:
                await p.submit({"crash": True})
            assert info.value.exitcode == 3
            await until(lambda: p.running and p.pids()["c"] != first_pid, "the restarted process", 60)
            assert await p.submit({"ok": 1}) == {"ok": 1}
            with pytest.raises(ProcessDied):
                await p.submit({"crash": True})
            await until(lambda: p.state in ("stopping", "stopped"), "the pipeline to stop: no restart left")
            with pytest.raises(PipelineClosed):
                await p.submit({"ok": 2})

    arun(body(), timeout=100)


PARENT = textwrap.dedent("""
    import asyncio, json, sys
    import torch
    sys.path.insert(0, {tests!r})
    from omni_core import Pipeline
    from runtime_helpers import pipeline, stage, until_state

    async def main():
        cfg = pipeline(stage("a", "Echo", next="s"), stage("s", "Sleep", terminal=True), name="orphans", relay="shm")
        async with Pipeline(cfg) as p:
            for _ in range(3):  # mid-transfer: tensors through shm are held by the sleeping stage
                asyncio.ensure_future(p.submit({{"sleep": 60, "t": torch.ones(1 << 18)}}))
            await until_state(p, lambda s: s["s"]["stage.s.running"] == 3, "the 3 requests to reach stage s")
            print(json.dumps({{"pids": list(p.pids().values()), "dir": p.runtime_dir, "run": p.run_id}}), flush=True)
            await asyncio.sleep(120)

    asyncio.run(main())
""")


def run_segments(run_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"omni-{run_id}")]


def test_children_exit_when_the_parent_is_sigkilled():
    tests = os.path.dirname(__file__)
    proc = subprocess.Popen([sys.executable, "-c", PARENT.format(tests=tests)], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert all(pid in descendants(proc.pid) for pid in info["pids"])
        assert holds_within(lambda: run_segments(info["run"]), 30, 0.05), "no shm in use"
        proc.kill()
        proc.wait(30)
        holds_within(lambda: not any(alive(pid) for pid in info["pids"]), 60, 0.1)
        left = [pid for pid in info["pids"] if alive(pid)]
        assert not left, f"stage processes outlived their parent: {left}"
        assert holds_within(lambda: not os.path.exists(info["dir"]), 30, 0.1), f"{info['dir']} left"
        # The children freed their relay memory on the way out: no segment of the run is left.
        assert not run_segments(info["run"])
    finally:
        proc.kill()


def test_stop_escalates_when_a_stage_ignores_shutdown():
    cfg = pipeline(stage("b", "Busy", terminal=True), limits={"stop_timeout": 0.5})

    async def body():
        p = Pipeline(cfg)
        await p.start()
        task = asyncio.ensure_future(p.submit({"busy": 30}))
        await until_state(p, running_in("b"), "the request to reach stage b")
        start = time.monotonic()
        await p.stop()
        with pytest.raises(RequestAborted):
            await task
        return time.monotonic() - start

    assert arun(body(), timeout=30) < 8


def test_runtime_dirs_of_killed_runs_are_swept_at_the_next_start(tmp_path):
    stale = tmp_path / "omni-run-999999999-abc"
    stale.mkdir()
    cfg = pipeline(stage("a", "Echo", terminal=True), endpoints={"ipc_dir": str(tmp_path)})

    async def body():
        async with Pipeline(cfg) as p:
            return await p.submit({"x": 1})

    assert arun(body()) == {"x": 1}
    assert not stale.exists()
    assert not runtime_dirs() & {str(stale)}

"""Supervision as a state machine: simultaneous deaths are all handled, a tensor-parallel group
is restarted as a whole, a stopped (SIGSTOP) process is detected by its missing heartbeats,
and no request reaches a process group that is restarting."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal

import pytest
import torch
from runtime_helpers import arun, no_leaks, pipeline, running_in, stage, until, until_state  # noqa: F401

from omni_core import Pipeline, ProcessDied
from omni_core.config import load_config
from omni_core.errors import PipelineClosed, ProcessHung
from omni_core.testing.waiting import suspended

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]

RESTART = {"policy": "on-failure", "max_restarts": 3}


def replaced(p: Pipeline, old: dict[str, int], names) -> bool:
    """Every process in ``names`` runs under a new pid and the pipeline is running again."""
    pids = p.pids()
    return p.running and all(pids.get(n) not in (None, old[n]) for n in names)


def test_two_processes_killed_at_once_are_both_restarted_and_serve():
    cfg = pipeline(stage("a", "Pid", next="b"), stage("b", "Pid", terminal=True), restart=RESTART)

    async def body():
        async with Pipeline(cfg) as p:
            await p.submit({"n": 0})
            old = p.pids()
            os.kill(old["a"], signal.SIGKILL)
            os.kill(old["b"], signal.SIGKILL)
            await until(lambda: replaced(p, old, ["a", "b"]), "both a and b restarted")
            result = await asyncio.wait_for(p.submit({"n": 1}), 30)
            assert result["n"] == 1 and result["pid"] == p.pids()["b"]

    arun(body(), timeout=100)


def test_a_killed_tensor_parallel_rank_restarts_its_whole_group_which_serves_again():
    cfg = pipeline(stage("tp", "AllReduce", tp_size=2, terminal=True), restart=RESTART)

    async def body():
        async with Pipeline(cfg) as p:
            assert torch.equal((await p.submit({"x": torch.ones(2)}))["x"], torch.full((2,), 3.0))
            old = p.pids()
            os.kill(old["tp.1"], signal.SIGKILL)
            await until(lambda: replaced(p, old, ["tp.0", "tp.1"]), "both ranks of tp restarted")
            result = await asyncio.wait_for(p.submit({"x": torch.ones(2)}), 30)
            assert torch.equal(result["x"], torch.full((2,), 3.0)) and result["pid"] == p.pids()["tp.0"]

    arun(body(), timeout=100)


def test_a_stopped_process_is_detected_by_its_missing_heartbeats():
    """SIGSTOP: the process answers nothing, but its requests fail with ``ProcessHung`` naming it
    (restart policy ``never``: the pipeline then stops), instead of hanging forever."""
    cfg = pipeline(stage("a", "Echo", next="s"), stage("s", "Sleep", terminal=True),
                   limits={"heartbeat_interval": 0.5, "heartbeat_timeout": 2})

    async def body():
        async with Pipeline(cfg) as p:
            victim = p.pids()["s"]
            task = asyncio.ensure_future(p.submit({"sleep": 60}))
            await until_state(p, running_in("s"), "the request to reach s")
            os.kill(victim, signal.SIGSTOP)
            try:
                with pytest.raises(ProcessHung) as info:
                    await asyncio.wait_for(task, 30)
                assert info.value.process == "s" and info.value.pid == victim
                assert isinstance(info.value, ProcessDied) and "'s'" in str(info.value)
                await until(lambda: not p.running, "the pipeline stopped (restart: never)")
                with pytest.raises(PipelineClosed):
                    await p.submit({"sleep": 0})
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGCONT)  # only matters when it was not detected

    arun(body(), timeout=100)


def test_default_limits_bound_every_wait():
    limits = load_config(pipeline(stage("a", "Echo", terminal=True))).limits
    for name in ("heartbeat_interval", "heartbeat_timeout", "request_timeout", "stream_stall_timeout",
                 "stop_timeout", "startup_timeout"):
        value = getattr(limits, name)
        assert value is not None and value > 0 and math.isfinite(value), name
    assert limits.heartbeat_interval < limits.heartbeat_timeout


def test_a_request_submitted_while_restarting_waits_for_the_restart_then_is_served(tmp_path):
    """The documented choice (docs/runtime.md): during a restart, new requests wait for it
    (bounded by their timeout) before admission, rather than reach a process that is not
    running. The restarted factory is held until the request was submitted, so it is submitted
    while restarting."""
    gate = tmp_path / "go"
    cfg = pipeline(stage("g", "Gate", args={"marker": str(tmp_path / "started"), "gate": str(gate)},
                         terminal=True), restart=RESTART)

    async def body():
        async with Pipeline(cfg) as p:
            await p.submit({"n": 0})
            old = p.pids()
            os.kill(old["g"], signal.SIGKILL)
            await until(lambda: not p.running, "the pipeline noticed the death")
            waiting = asyncio.ensure_future(p.submit({"n": 1}))
            await suspended(waiting)  # as far as it goes: admitted, it would wait for its result
            assert not waiting.done(), "a request submitted while restarting must wait for the restart"
            assert not p.requests, "a request was admitted while its process group was restarting"
            gate.touch()
            result = await asyncio.wait_for(waiting, 60)
            assert result == {"n": 1, "pid": p.pids()["g"]} and p.pids()["g"] != old["g"]

    arun(body(), timeout=100)

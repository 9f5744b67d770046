"""The runner's supervision state machine, in-process: a real :class:`Runner` against a fake
endpoint (the test plays every stage process's messages) and a fake launcher whose processes are
pipes (a "death" is an exit code plus a byte on the sentinel). No stage process, no socket, and
no sleep orders anything: the tests wait on the runner's state with a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from fake_endpoint import FakeEndpoint
from fake_endpoint import until as _until

import omni_core
from omni_core import load_config
from omni_core.contracts import Launcher, ProcessHandle
from omni_core.errors import PipelineClosed, ProcessDied, ProcessHung, StartupError
from omni_core.plan.topology import build_plan
from omni_core.plugins import load_plugins
from omni_core.runtime import wire
from omni_core.runtime.launch import RUNTIME_DIR_PREFIX
from omni_core.runtime.lifecycle import Lifecycle
from omni_core.runtime.readiness import START_FAILURE_GRACE
from omni_core.runtime.reports import StateReports
from omni_core.runtime.runner import Runner

pytestmark = pytest.mark.timeout(30)

RESTART = {"policy": "on-failure", "max_restarts": 3}
_pids = itertools.count(70001)


# -- the fake processes and launcher -------------------------------------------------------------


class FakeProcess(ProcessHandle):
    """One "stage process": its sentinel is a pipe's read end; it ends by writing to the pipe.

    ``on_shutdown`` is what it does when told ``Shutdown``: ``bye`` (say Bye, then exit 0),
    ``crash`` (exit 1 without a word) or ``ignore``; ``on_terminate``: ``die`` or ``ignore``
    (only a kill ends it then); ``state``: what it answers a ``StateQuery`` with (None: nothing).
    """

    def __init__(self, boot):
        self.name = boot.process.name
        self.boot = boot
        self.generation = boot.generation
        self._pid = next(_pids)
        self._read, self._write = os.pipe()
        self._exitcode: int | None = None
        self.on_shutdown = "bye"
        self.on_terminate = "die"
        self.state: dict[str, int] | None = {"requests": 0}
        self.terminated = 0
        self.killed = 0
        self.joined = 0

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def sentinel(self) -> int:
        return self._read

    @property
    def exitcode(self) -> int | None:
        return self._exitcode

    def die(self, code: int) -> None:
        if self._exitcode is None:
            self._exitcode = code
            os.write(self._write, b"x")

    def terminate(self) -> None:
        self.terminated += 1
        if self.on_terminate == "die":
            self.die(-15)

    def kill(self) -> None:
        self.killed += 1
        self.die(-9)

    def join(self, timeout: float | None = None) -> None:
        self.joined += 1

    def close_fds(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


class World:
    """Every process the fake launcher started, in order."""

    def __init__(self) -> None:
        self.started: list[FakeProcess] = []
        self.launchers: list[FakeLauncher] = []

    def of(self, name: str) -> list[FakeProcess]:
        """Every generation of process ``name``, oldest first."""
        return [p for p in self.started if p.name == name]

    def close(self) -> None:
        for proc in self.started:
            proc.close_fds()


class FakeLauncher(Launcher):
    world: World | None = None  # the current test's (set by the ``rig`` fixture)

    def __init__(self, options) -> None:
        assert FakeLauncher.world is not None
        self.world = FakeLauncher.world
        self.world.launchers.append(self)
        self.closed = 0

    def start(self, boot) -> FakeProcess:
        proc = FakeProcess(boot)
        self.world.started.append(proc)
        return proc

    def close(self) -> None:
        self.closed += 1


class FakeLauncherPlugin:
    @omni_core.hookimpl
    def omni_register_launchers(self, register):
        register("fake", FakeLauncher)


# -- the caller's side: endpoint, lifecycle, requests --------------------------------------------


class PlayedEndpoint(FakeEndpoint):
    """A FakeEndpoint whose processes answer ``Shutdown`` and ``StateQuery`` (on the next loop
    turn, as a peer would) the way their :class:`FakeProcess` says."""

    def __init__(self, config, registry, handles: dict):
        super().__init__(config, registry)
        self.handles = handles  # process name → its current handle (the runner's)
        self.recorder.on_post = self._posted

    def _posted(self, to: str, msg) -> None:
        if isinstance(msg, (wire.Shutdown, wire.StateQuery)):
            asyncio.get_running_loop().call_soon(self._answer, to, msg)

    def _answer(self, to: str, msg) -> None:
        proc = self.handles[to]
        if proc.exitcode is not None:
            return
        if isinstance(msg, wire.StateQuery):
            if proc.state is not None:
                self.receive(wire.StateReport(msg.token, to, dict(proc.state)))
        elif proc.on_shutdown == "bye":
            self.receive(wire.Bye(to))
            proc.die(0)
        elif proc.on_shutdown == "crash":
            proc.die(1)


class RecordingLifecycle(Lifecycle):
    """A Lifecycle that remembers every state it entered, and which processes were ready then
    (``ready``: asked at each change)."""

    def __init__(self, pipeline: str):
        super().__init__(pipeline)
        self.history: list[str] = []
        self.ready: Callable[[], frozenset[str]] = frozenset
        self.entered: list[tuple[str, frozenset[str]]] = []

    def set(self, state: str) -> None:
        if state != self.state:
            self.history.append(state)
            self.entered.append((state, self.ready()))
        super().set(state)

    def ready_on_entering(self, state: str) -> frozenset[str]:
        """The processes that were ready when the pipeline last entered ``state``."""
        return [ready for entered, ready in self.entered if entered == state][-1]


class FakeRequests:
    """The Requests protocol, recording its calls in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def fail_where(self, processes, error):
        self.calls.append(("fail_where", set(processes), error))
        return 0

    async def drain(self, deadline: float) -> None:
        self.calls.append(("drain", deadline))

    def abort_all(self, reason) -> None:
        self.calls.append(("abort_all", reason))

    #: what ended() answers: (floor, requests ended above it)
    ended_now: tuple = (0, ())

    asked_ended = 0

    def ended(self):
        self.asked_ended += 1
        return self.ended_now

    def in_flight(self) -> int:
        return 0

    def named(self, kind: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind]


# -- the rig --------------------------------------------------------------------------------------


async def until(predicate, what: str, deadline_s: float = 5.0) -> None:
    """:func:`fake_endpoint.until`, polling every 2 ms: the fake processes' heartbeats come from threads."""
    await _until(predicate, what, deadline_s, poll_s=0.002)


def stage(name: str, **fields) -> dict:
    return {"name": name, "factory": "omni_test_stages:Upper", **fields}


class Rig:
    """A Runner with its fake parts, and the test's hands on the processes."""

    def __init__(self, registry, world: World, ipc_dir: str, stages: list[dict], **fields):
        fields.setdefault("limits", {})
        fields["limits"] = {"stop_timeout": 1.0, **fields["limits"]}
        self.config = load_config({"name": "sup", "stages": stages, "launcher": "fake", "relay": "inline",
                                   "endpoints": {"ipc_dir": ipc_dir}, **fields}, registry=registry)
        self.world = world
        self.lifecycle = RecordingLifecycle(self.config.name)
        self.endpoint = PlayedEndpoint(self.config, registry, self.lifecycle.handles)
        self.requests = FakeRequests()
        self.runner = Runner(self.config, registry, self.endpoint, self.lifecycle, self.requests)
        self.reports = StateReports(self.endpoint, self.lifecycle)
        self.plan = build_plan(self.config, registry)
        self.names = [p.name for p in self.plan.processes]
        self.lifecycle.ready = lambda: frozenset(n for n in self.names if self.runner.readiness.is_ready(n))
        self._start: asyncio.Task | None = None

    @property
    def state(self) -> str:
        return self.lifecycle.state

    def proc(self, name: str) -> FakeProcess:
        """The current generation of process ``name``."""
        handle = self.lifecycle.handles[name]
        assert isinstance(handle, FakeProcess)
        return handle

    def launches(self, name: str) -> int:
        return len(self.world.of(name))

    async def launch(self) -> asyncio.Task:
        """Start the runner; return its start task once every process was launched."""
        self._start = asyncio.ensure_future(self.runner.start(self.plan))
        await until(lambda: len(self.lifecycle.handles) == len(self.names) or self._start.done(),
                    "every process launched")
        return self._start

    def ready(self, *names: str) -> None:
        for name in names:
            self.endpoint.receive(wire.Ready(name, self.proc(name).pid))

    async def ready_seen(self, name: str) -> None:
        """Process ``name`` says Ready, and the runner counts it ready."""
        self.ready(name)
        await until(lambda: self.runner.readiness.is_ready(name), f"{name}'s Ready handled")

    async def started(self) -> None:
        """Start with every process ready."""
        task = await self.launch()
        self.ready(*self.names)
        await asyncio.wait_for(task, 5)
        assert self.state == "running"

    async def relaunched(self, name: str, generation: int) -> FakeProcess:
        """Wait until process ``name`` runs as ``generation``; its handle."""
        await until(lambda: any(p.generation == generation for p in self.world.of(name)),
                    f"{name} relaunched as generation {generation}")
        return self.proc(name)

    async def beat(self, name: str, generation: int | None = None, every: float = 0.02) -> None:
        """Play process ``name``'s heartbeat thread (of ``generation``: default its own)."""
        while True:
            proc = self.proc(name)
            gen = proc.generation if generation is None else generation
            self.endpoint.receive(wire.Heartbeat(name, proc.pid, gen, 0.0))
            await asyncio.sleep(every)

    async def cleanup(self) -> None:
        """Whatever a test left, stop it (every process says Bye)."""
        if self._start is not None and not self._start.done():
            self._start.cancel()
            await asyncio.gather(self._start, return_exceptions=True)
        if self.state not in ("new", "stopped"):
            for proc in self.world.started:
                proc.on_shutdown = "bye"
            await asyncio.wait_for(self.runner.stop(), 10)


@pytest.fixture(scope="module")
def registry():
    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("fake-launcher", FakeLauncherPlugin())])
    assert not [i.error for i in plugins.infos if i.error]
    return plugins.registry


def _fds() -> set[int]:
    return set(map(int, os.listdir("/proc/self/fd")))


@pytest.fixture
def rig(registry, tmp_path):
    """``rig(stages, **config fields)`` makes a Rig (one per test); ``run(rig, body)`` runs it."""
    world = World()
    FakeLauncher.world = world
    made: list[Rig] = []
    before = _fds()

    def make(stages: list[dict], **fields) -> Rig:
        made.append(Rig(registry, world, str(tmp_path), stages, **fields))
        return made[-1]

    yield make
    FakeLauncher.world = None
    world.close()
    for r in made:
        if not r.endpoint.closed:
            r.endpoint.close()
    assert not [e for e in os.listdir(tmp_path) if e.startswith(RUNTIME_DIR_PREFIX)], "a runtime dir was left"
    for r in made:
        assert r.runner.launch.runtime_dir is None or not os.path.exists(r.runner.launch.runtime_dir)
    assert _fds() <= before, "file descriptors leaked"


def run(rig: Rig, body, timeout: float = 15):
    """Run ``body()`` (a coroutine function) in a fresh loop, then stop what it left; its result."""

    async def main():
        try:
            return await asyncio.wait_for(body(), timeout)
        finally:
            await rig.cleanup()

    return asyncio.run(main())


def two() -> list[dict]:
    return [stage("a", next="b"), stage("b", terminal=True)]


# -- start ----------------------------------------------------------------------------------------


def test_start_reaches_running_once_every_process_is_ready(rig):
    r = rig(two())

    async def body():
        task = await r.launch()
        assert r.state == "starting"
        assert {n: s["state"] for n, s in r.runner.process_states().items()} == {"a": "starting", "b": "starting"}
        await r.ready_seen("a")
        assert not task.done() and r.state == "starting"
        r.ready("b")
        await asyncio.wait_for(task, 5)
        assert r.state == "running"
        assert r.lifecycle.ready_on_entering("running") == {"a", "b"}, "running before every process was ready"
        assert r.runner.process_states() == {"a": {"state": "running", "restarts": 0},
                                             "b": {"state": "running", "restarts": 0}}
        assert r.endpoint.listening
        assert os.path.isdir(r.runner.launch.runtime_dir)
        assert [p.boot.generation for p in r.world.started] == [0, 0]
        await r.runner.stop()

    run(r, body)
    assert r.lifecycle.history == ["starting", "running", "stopping", "stopped"]


def test_start_failed_raises_startup_error_naming_stage_and_path_and_tears_everything_down(rig):
    r = rig(two())

    async def body():
        task = await r.launch()
        b = r.proc("b")
        r.endpoint.receive(wire.StartFailed("b", b.pid, "ValueError: bad size", "Traceback ...", stage="b",
                                            path="stages[1].args"))
        b.die(1)
        with pytest.raises(StartupError) as info:
            await asyncio.wait_for(task, 5)
        return info.value

    error = run(r, body)
    assert error.process == "b" and error.stage == "b" and error.path == "stages[1].args"
    assert "stages[1].args" in str(error) and "'b'" in str(error) and "bad size" in str(error)
    assert error.traceback == "Traceback ..."
    assert r.state == "stopped"
    assert r.lifecycle.history == ["starting", "stopped"]
    a = r.world.of("a")[0]
    assert a.terminated == 1 and a.exitcode is not None  # not ready: ended at once
    assert r.endpoint.closed and r.world.launchers[0].closed == 1
    assert not os.path.exists(r.runner.launch.runtime_dir)
    assert not r.requests.calls


def test_a_process_dying_while_starting_fails_the_start(rig):
    r = rig(two())

    async def body():
        task = await r.launch()
        r.ready("a")
        r.proc("b").die(-9)
        with pytest.raises(StartupError, match=r"process 'b' \(stages: b\) died during startup \(SIGKILL\)") as info:
            await asyncio.wait_for(task, 5)
        assert info.value.process == "b"

    run(r, body)
    assert r.state == "stopped"
    a = r.world.of("a")[0]
    assert r.endpoint.of_type(wire.Shutdown, "a"), "a ready process is asked to shut down"
    assert a.exitcode == 0 and a.terminated == 0 and a.killed == 0
    assert not os.path.exists(r.runner.launch.runtime_dir)


def test_a_process_not_ready_within_the_startup_timeout_fails_the_start_naming_it(rig):
    r = rig(two(), limits={"startup_timeout": 0.3})

    async def body():
        task = await r.launch()
        r.ready("a")
        began = time.monotonic()
        with pytest.raises(StartupError, match=r"process\(es\) b not ready within limits.startup_timeout \(0.3 s\)"):
            await asyncio.wait_for(task, 5)
        assert time.monotonic() - began < 3

    run(r, body)
    assert r.state == "stopped"
    assert r.world.of("b")[0].terminated == 1
    assert not os.path.exists(r.runner.launch.runtime_dir)


def test_several_processes_failing_together_give_one_error_listing_them(rig):
    r = rig([stage("a", next="b"), stage("b", next="c"), stage("c", terminal=True)])

    async def body():
        task = await r.launch()
        r.ready("b")
        for name, path in (("a", "stages[0].factory"), ("c", "stages[2].args")):
            r.endpoint.receive(wire.StartFailed(name, r.proc(name).pid, f"{name} is broken", "", stage=name,
                                                path=path))
            r.proc(name).die(1)
        with pytest.raises(StartupError) as info:
            await asyncio.wait_for(task, 5)
        return info.value

    error = run(r, body)
    assert [f.process for f in error.failures] == ["a", "c"]
    assert [f.path for f in error.failures] == ["stages[0].factory", "stages[2].args"]
    assert str(error).startswith("2 processes failed to start")
    assert "a is broken" in str(error) and "c is broken" in str(error)
    assert error.process == "a"
    assert r.state == "stopped"


def test_a_death_within_the_grace_after_another_start_failure_is_listed_too(rig):
    r = rig([stage("a", next="b"), stage("b", next="c"), stage("c", terminal=True)])

    async def body():
        task = await r.launch()
        r.ready("b")
        r.endpoint.receive(wire.StartFailed("a", r.proc("a").pid, "ImportError: no torch", "", stage="a",
                                            path="stages[0].factory"))
        # The scenario, not a synchronisation: c dies (the OOM killer: no report) half the grace
        # after a's report, while Readiness.wait waits START_FAILURE_GRACE for other failures.
        await asyncio.sleep(START_FAILURE_GRACE / 2)
        r.proc("c").die(-9)
        with pytest.raises(StartupError) as info:
            await asyncio.wait_for(task, 5)
        return info.value

    error = run(r, body)
    assert sorted(f.process for f in error.failures) == ["a", "c"]


# -- deaths while running --------------------------------------------------------------------------


def test_a_death_while_running_fails_its_requests_and_restarts_the_process(rig):
    r = rig(two(), restart=RESTART)

    async def body():
        await r.started()
        old = r.proc("b")
        old.die(-9)
        await until(lambda: r.launches("b") == 2, "b relaunched")
        assert r.state == "restarting"
        (call,) = r.requests.named("fail_where")
        assert call[1] == {"b"}
        error = call[2](SimpleNamespace(request_id="req-7"))
        assert type(error) is ProcessDied
        assert (error.process, error.pid, error.exitcode, error.signal) == ("b", old.pid, -9, "SIGKILL")
        assert error.request_id == "req-7" and error.stages == ("b",)
        new = r.proc("b")
        assert new.generation == 1 and new is not old
        assert r.runner.process_states() == {"a": {"state": "running", "restarts": 0},
                                             "b": {"state": "restarting", "restarts": 1}}
        r.ready("b")
        await until(lambda: r.state == "running", "running again")
        assert r.runner.restarts == 1
        assert r.runner.process_states()["b"] == {"state": "running", "restarts": 1}
        assert r.launches("a") == 1

    run(r, body)
    assert r.lifecycle.history == ["starting", "running", "restarting", "running", "stopping", "stopped"]


def test_a_crash_with_an_exit_code_gives_process_died_with_that_code_and_no_signal(rig):
    r = rig([stage("a", terminal=True)], restart=RESTART)

    async def body():
        await r.started()
        r.proc("a").die(3)
        await until(lambda: r.requests.named("fail_where"), "the requests failed")
        error = r.requests.named("fail_where")[0][2](SimpleNamespace(request_id=None))
        assert error.exitcode == 3 and error.signal is None and "exit code 3" in str(error)

    run(r, body)


def test_a_dead_tensor_parallel_follower_restarts_its_whole_group(rig):
    r = rig([stage("a", next="tp"), stage("tp", tp_size=2, terminal=True)], restart=RESTART)

    async def body():
        await r.started()
        leader, follower = r.proc("tp.0"), r.proc("tp.1")
        follower.die(-9)
        await until(lambda: r.launches("tp.0") == 2 and r.launches("tp.1") == 2, "both ranks relaunched")
        assert r.requests.named("fail_where")[0][1] == {"tp.0", "tp.1"}
        assert leader.killed == 1 and leader.exitcode == -9
        assert [r.proc(n).generation for n in ("tp.0", "tp.1")] == [1, 1]
        states = r.runner.process_states()
        assert states["tp.0"]["state"] == states["tp.1"]["state"] == "restarting"
        assert states["a"]["state"] == "running"
        await r.ready_seen("tp.1")
        assert r.state == "restarting", "the group is back only once every rank is ready"
        r.ready("tp.0")
        await until(lambda: r.state == "running", "running again")
        assert r.lifecycle.ready_on_entering("running") == set(r.names), "running before every rank was ready"
        assert r.runner.restarts == 1 and r.launches("a") == 1

    run(r, body)


def test_two_groups_restarting_at_once_are_running_only_once_both_are_back(rig):
    r = rig(two(), restart=RESTART)

    async def body():
        await r.started()
        r.proc("a").die(-9)
        r.proc("b").die(-9)
        await until(lambda: r.launches("a") == 2 and r.launches("b") == 2, "both relaunched")
        assert r.runner.restarts == 2
        await r.ready_seen("a")
        assert r.state == "restarting"
        r.ready("b")
        await until(lambda: r.state == "running", "running again")
        assert r.lifecycle.ready_on_entering("running") == {"a", "b"}, "running before both groups were back"

    run(r, body)


def test_reaching_the_restart_limit_stops_the_pipeline_after_draining(rig):
    r = rig(two(), restart={"policy": "on-failure", "max_restarts": 1})

    async def body():
        await r.started()
        r.proc("b").die(-9)
        await r.relaunched("b", 1)
        r.ready("b")
        await until(lambda: r.state == "running", "running again")
        r.proc("b").die(1)
        await until(lambda: r.state == "stopped", "the pipeline stopped")

    run(r, body)
    assert r.lifecycle.history == ["starting", "running", "restarting", "running", "stopping", "stopped"]
    assert r.launches("b") == 2 and r.runner.restarts == 1
    reason = r.lifecycle.closed_reason
    assert isinstance(reason, ProcessDied) and reason.process == "b" and reason.exitcode == 1
    kinds = [c[0] for c in r.requests.calls]
    assert kinds == ["fail_where", "fail_where", "drain", "abort_all"]
    assert r.requests.calls[-1][1] is reason
    assert r.endpoint.of_type(wire.Shutdown, "a") and not r.endpoint.of_type(wire.Shutdown, "b")
    assert not os.path.exists(r.runner.launch.runtime_dir)


def test_policy_never_stops_the_pipeline_at_the_first_death(rig):
    r = rig(two())

    async def body():
        await r.started()
        r.proc("a").die(-9)
        await until(lambda: r.state in ("stopping", "stopped"), "the pipeline stopping")
        assert r.runner.process_states()["a"]["state"] == "dead"
        await until(lambda: r.state == "stopped", "the pipeline stopped")

    run(r, body)
    assert r.lifecycle.history == ["starting", "running", "stopping", "stopped"]
    assert r.launches("a") == 1 and r.runner.restarts == 0
    assert [c[0] for c in r.requests.calls] == ["fail_where", "drain", "abort_all"]
    assert r.requests.calls[0][1] == {"a"}
    assert isinstance(r.lifecycle.closed_reason, ProcessDied)
    assert r.requests.calls[-1][1] is r.lifecycle.closed_reason


def test_max_restarts_zero_stops_at_the_first_death(rig):
    r = rig([stage("a", terminal=True)], restart={"policy": "on-failure", "max_restarts": 0})

    async def body():
        await r.started()
        r.proc("a").die(-9)
        await until(lambda: r.state == "stopped", "the pipeline stopped")

    run(r, body)
    assert r.launches("a") == 1 and "restarting" not in r.lifecycle.history
    assert isinstance(r.lifecycle.closed_reason, ProcessDied)


def test_a_relaunched_process_dying_before_ready_makes_the_restart_go_round_again(rig):
    r = rig(two(), restart=RESTART)

    async def body():
        await r.started()
        r.proc("b").die(-9)
        first = await r.relaunched("b", 1)
        first.die(1)
        second = await r.relaunched("b", 2)
        assert r.state == "restarting" and r.runner.restarts == 2
        assert len(r.requests.named("fail_where")) == 1, "no request can use a group that is restarting"
        r.ready("b")
        await until(lambda: r.state == "running", "running again")
        assert r.proc("b") is second
        assert r.runner.process_states()["b"] == {"state": "running", "restarts": 2}

    run(r, body)
    assert r.lifecycle.history == ["starting", "running", "restarting", "running", "stopping", "stopped"]


def test_a_rank_dying_after_ready_while_its_group_restarts_makes_the_restart_go_round_again(rig):
    r = rig([stage("tp", tp_size=2, terminal=True)], restart=RESTART)

    async def body():
        await r.started()
        r.proc("tp.1").die(-9)
        await r.relaunched("tp.0", 1)
        await r.relaunched("tp.1", 1)
        await r.ready_seen("tp.0")
        r.proc("tp.0").die(-9)  # ready, but its group is still restarting
        await until(lambda: len(r.requests.named("fail_where")) == 2, "the second death handled")
        r.ready("tp.1")
        await r.relaunched("tp.0", 2)
        await r.relaunched("tp.1", 2)
        assert r.world.of("tp.1")[1].killed == 1
        assert r.state == "restarting" and r.runner.restarts == 2
        r.ready("tp.0", "tp.1")
        await until(lambda: r.state == "running", "running again")

    run(r, body)


def test_a_restart_that_keeps_failing_stops_the_pipeline_at_the_limit(rig):
    r = rig([stage("a", terminal=True)], restart={"policy": "on-failure", "max_restarts": 2})

    async def body():
        await r.started()
        r.proc("a").die(-9)
        (await r.relaunched("a", 1)).die(1)
        (await r.relaunched("a", 2)).die(1)
        await until(lambda: r.state == "stopped", "the pipeline stopped")

    run(r, body)
    assert r.launches("a") == 3 and r.runner.restarts == 2
    assert isinstance(r.lifecycle.closed_reason, StartupError)
    assert [c[0] for c in r.requests.calls] == ["fail_where", "drain", "abort_all"]


# -- heartbeats -------------------------------------------------------------------------------------

HEARTBEATS = {"heartbeat_interval": 0.05, "heartbeat_timeout": 0.3}


def test_a_process_that_stops_sending_heartbeats_is_killed_and_its_requests_fail_as_hung(rig):
    r = rig(two(), limits=HEARTBEATS)

    async def body():
        await r.started()
        beating = asyncio.ensure_future(r.beat("a"))
        try:
            await until(lambda: r.proc("b").killed, "the silent process killed")
            await until(lambda: r.state == "stopped", "the pipeline stopped (restart: never)")
        finally:
            beating.cancel()

    run(r, body)
    b = r.world.of("b")[0]
    assert b.killed == 1 and r.world.of("a")[0].killed == 0
    (call,) = r.requests.named("fail_where")
    assert call[1] == {"b"}
    error = call[2](SimpleNamespace(request_id="req-1"))
    assert isinstance(error, ProcessHung) and error.process == "b" and error.pid == b.pid
    assert error.silent_for > 0.3 and "hung" in str(error)
    assert isinstance(r.lifecycle.closed_reason, ProcessHung)


def test_heartbeats_of_an_older_generation_are_ignored(rig):
    r = rig(two(), limits=HEARTBEATS, restart={"policy": "on-failure", "max_restarts": 1})

    async def body():
        await r.started()
        beats = [asyncio.ensure_future(r.beat("a"))]
        try:
            r.proc("b").die(-9)
            new = await r.relaunched("b", 1)
            r.ready("b")
            beats.append(asyncio.ensure_future(r.beat("b", generation=0)))  # the old generation's
            await until(lambda: new.killed, "b killed: its own generation sent nothing")
            await until(lambda: r.state == "stopped", "the pipeline stopped (no restart left)")
        finally:
            for task in beats:
                task.cancel()

    run(r, body)
    assert r.world.of("a")[0].killed == 0
    hung = r.requests.named("fail_where")[1][2](SimpleNamespace(request_id=None))
    assert isinstance(hung, ProcessHung) and hung.process == "b"


def test_heartbeats_of_the_current_generation_keep_a_restarted_process_alive(rig):
    r = rig([stage("a", terminal=True)], limits=HEARTBEATS, restart=RESTART)

    async def body():
        await r.started()
        r.proc("a").die(-9)
        new = await r.relaunched("a", 1)
        r.ready("a")
        beating = asyncio.ensure_future(r.beat("a"))
        try:
            await until(lambda: r.state == "running", "running again")
            # A window in which nothing may happen: twice the heartbeat timeout, beats coming.
            deadline = time.monotonic() + 0.6
            while time.monotonic() < deadline:
                await asyncio.sleep(0.02)
                assert new.killed == 0 and r.state == "running"
        finally:
            beating.cancel()

    run(r, body)


# -- stop ---------------------------------------------------------------------------------------


def test_stop_shuts_every_process_down_and_joins_the_ones_that_say_bye(rig):
    r = rig(two())

    async def body():
        await r.started()
        began = time.monotonic()
        await r.runner.stop()
        assert time.monotonic() - began < 1.0  # no escalation waited for

    run(r, body)
    assert r.state == "stopped"
    for name in ("a", "b"):
        proc = r.world.of(name)[0]
        assert len(r.endpoint.of_type(wire.Shutdown, name)) == 1
        assert proc.exitcode == 0 and proc.joined >= 1
        assert proc.terminated == 0 and proc.killed == 0
    assert [c[0] for c in r.requests.calls] == ["drain", "abort_all"]
    assert r.requests.calls[-1][1] is None and r.lifecycle.closed_reason is None
    assert r.endpoint.closed and r.world.launchers[0].closed == 1
    assert not os.path.exists(r.runner.launch.runtime_dir)


def test_stop_terminates_then_kills_processes_that_ignore_shutdown_within_the_stop_timeout(rig):
    r = rig([stage("a", next="b"), stage("b", next="c"), stage("c", terminal=True)], limits={"stop_timeout": 0.5})

    async def body():
        await r.started()
        r.proc("b").on_shutdown = "ignore"  # SIGTERM ends it
        r.proc("c").on_shutdown = "ignore"
        r.proc("c").on_terminate = "ignore"  # only SIGKILL ends it
        began = time.monotonic()
        await r.runner.stop()
        assert time.monotonic() - began < 0.5 + 1.0

    run(r, body)
    a, b, c = (r.world.of(n)[0] for n in ("a", "b", "c"))
    assert (a.exitcode, a.terminated, a.killed) == (0, 0, 0)
    assert (b.exitcode, b.terminated, b.killed) == (-15, 1, 0)
    assert (c.exitcode, c.terminated, c.killed) == (-9, 1, 1)
    assert r.state == "stopped" and not os.path.exists(r.runner.launch.runtime_dir)


def test_a_death_while_stopping_is_expected_no_request_fails_and_nothing_restarts(rig):
    r = rig(two(), restart=RESTART)

    async def body():
        await r.started()
        r.proc("b").on_shutdown = "crash"  # exits 1 instead of saying Bye
        await r.runner.stop()

    run(r, body)
    assert r.world.of("b")[0].exitcode == 1
    assert not r.requests.named("fail_where")
    assert r.launches("a") == r.launches("b") == 1 and r.runner.restarts == 0
    assert r.lifecycle.closed_reason is None
    assert r.lifecycle.history == ["starting", "running", "stopping", "stopped"]


def test_stop_does_not_wait_for_the_bye_of_a_process_that_already_exited(rig):
    r = rig([stage("a", terminal=True)], limits={"stop_timeout": 2.0})

    async def body():
        await r.started()
        r.proc("a").on_shutdown = "crash"
        began = time.monotonic()
        await r.runner.stop()
        return time.monotonic() - began

    elapsed = run(r, body)
    assert r.world.of("a")[0].exitcode == 1
    assert elapsed < 0.5, f"stop() took {elapsed:.2f} s after the only process had exited"


def test_stop_is_idempotent(rig):
    r = rig(two())

    async def body():
        await r.started()
        await asyncio.gather(r.runner.stop(), r.runner.stop())
        await r.runner.stop()

    run(r, body)
    assert r.lifecycle.history == ["starting", "running", "stopping", "stopped"]
    assert len(r.endpoint.of_type(wire.Shutdown)) == 2
    assert [c[0] for c in r.requests.calls] == ["drain", "abort_all"]
    assert r.world.launchers[0].closed == 1


def test_stop_of_a_runner_never_started_marks_it_stopped_and_it_cannot_start(rig):
    r = rig(two())

    async def body():
        await r.runner.stop()
        assert r.state == "stopped"
        with pytest.raises(PipelineClosed):
            await r.runner.start(r.plan)

    run(r, body)
    assert not r.world.started and not r.requests.calls


def test_stop_while_a_group_restarts_cancels_the_restart_and_ends_every_process(rig):
    r = rig(two(), restart=RESTART)

    async def body():
        await r.started()
        r.proc("b").die(-9)
        new = await r.relaunched("b", 1)
        await r.runner.stop()
        assert new.exitcode is not None

    run(r, body)
    assert r.lifecycle.history == ["starting", "running", "restarting", "stopping", "stopped"]
    assert r.launches("b") == 2
    assert not os.path.exists(r.runner.launch.runtime_dir)


def test_debug_state_gathers_the_state_reports_of_the_live_processes(rig):
    r = rig([stage("a", next="b"), stage("b", next="c"), stage("c", terminal=True)], restart=RESTART)

    async def body():
        await r.started()
        r.proc("a").state = {"requests": 2, "streams": 1}
        r.proc("b").state = {"requests": 0}
        r.proc("c").state = {"requests": 5}
        assert await r.reports.gather(timeout=5) == {
            "a": {"requests": 2, "streams": 1}, "b": {"requests": 0}, "c": {"requests": 5}}
        (query,) = r.endpoint.of_type(wire.StateQuery, "a")
        assert [m.token for m in r.endpoint.of_type(wire.StateQuery)] == [query.token] * 3
        # A report that answers no query (a stale token) is dropped.
        r.endpoint.receive(wire.StateReport(query.token, "a", {"requests": 9}))

    run(r, body)


def test_a_restarted_process_boots_knowing_the_floor_ended_requests_and_the_run_secret(rig):
    r = rig(two(), restart={"policy": "on-failure", "max_restarts": 1})

    async def body():
        await r.started()
        first = r.proc("b").boot
        assert (first.floor, first.ended) == (0, ()) and len(first.secret) == 32
        r.requests.ended_now = (7, (8, 10))
        r.proc("b").die(-9)
        again = (await r.relaunched("b", 1)).boot
        assert (again.floor, again.ended) == (7, (8, 10)) and again.secret == first.secret
        assert "secret=" not in repr(again) and repr(again.secret) not in repr(again)
        r.ready("b")
        await until(lambda: r.state == "running", "running again")

    run(r, body)
    assert r.requests.asked_ended == 1

"""The runner (parent process): the run's supervisor: readiness, exits, restarts, heartbeats,
stop. What a run is made of (runtime dir, launcher, placement, boot specs) is its
:class:`~.launch.Launch`'s.

Supervision is an explicit state machine::

    new → starting → running ⇄ restarting → stopping → stopped

Every process death is handled in every state: while starting it fails the start (after cleaning
up); while running or restarting it fails the requests that may use the dead process's group at
once (``ProcessDied``, or ``ProcessHung`` when it stopped answering heartbeats and was killed),
then the restart policy either restarts the whole process group (every rank of a TP stage, at a
fresh rendezvous; at most ``restart.max_restarts`` times in a run) or stops the pipeline; while
stopping or stopped it is expected. Deaths are seen within a second (the launcher's sentinel);
a process that is alive but silent (SIGSTOP, wedged) within ``limits.heartbeat_timeout``, from
heartbeats its own thread sends. ``stop()`` is bounded by ``limits.stop_timeout`` in total.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..config import PipelineConfig
from ..contracts import ProcessHandle
from ..errors import PipelineClosed, ProcessDied, ProcessHung, StartupError
from ..logs import get_logger
from ..plan.topology import Plan
from ..registry import Registry
from . import ending, wire
from .endpoint import Endpoint
from .launch import Launch
from .lifecycle import STATES, Lifecycle
from .readiness import Readiness

__all__ = ["STATES", "Requests", "Runner", "signal_name"]


def signal_name(exitcode: int | None) -> str | None:
    if exitcode is not None and exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return None


class Requests(Protocol):
    """What supervision does to the requests in flight (the coordinator's request table)."""

    def fail_where(self, processes: set[str], error: Callable[[Any], BaseException]) -> int:
        """Fail every request that may use one of ``processes`` (``error(request)`` says how);
        returns how many."""

    async def drain(self, deadline: float) -> None:
        """Wait for the requests in flight until ``deadline`` (monotonic)."""

    def abort_all(self, reason: BaseException | None) -> None:
        """The pipeline stopped (``reason``: why, when it was not asked to): fail what is left."""

    def in_flight(self) -> int:
        """How many requests are in flight."""

    def ended(self) -> tuple[int, tuple[int, ...]]:
        """``(floor, ended)``: every request below ``floor`` has ended, and so have those of
        ``ended`` (what a restarted process must know so that it runs none of them)."""


class Runner:
    """Starts, supervises and stops the processes of one plan.

    It talks to them through the caller's ``endpoint`` (it handles their readiness, heartbeats,
    goodbyes and state reports there), publishes the pipeline's and the processes' state in
    ``lifecycle``, and fails, drains or aborts ``requests`` when processes die or the pipeline
    stops."""

    #: The event loop the runner started in (set by :meth:`start`).
    _loop: asyncio.AbstractEventLoop

    def __init__(self, config: PipelineConfig, registry: Registry, endpoint: Endpoint, lifecycle: Lifecycle,
                 requests: Requests, launch: Launch | None = None):
        self.config = config
        self.endpoint = endpoint
        self.lifecycle = lifecycle
        self.requests = requests
        #: The run's set-up: its boot specs, launcher, runtime dir (made by :meth:`start`).
        self.launch = Launch(config, registry) if launch is None else launch
        self.boots = self.launch.boots
        self.log = get_logger(pipeline=config.name)
        self.restarts = 0
        self.readiness = Readiness(config.name, self.log)
        self._byes: dict[str, asyncio.Future] = {}
        self._heard: dict[str, float] = {}  # process → last heartbeat (monotonic), once ready
        self._hung: dict[str, float] = {}  # process → silence when it was killed as hung
        self._dead: set[str] = set()  # processes that died while serving, until relaunched
        self._restarting: dict[str, asyncio.Task] = {}  # group leader → its restart
        self._again: set[str] = set()  # groups to restart once more (a death during their restart)
        self._stop_task: asyncio.Task | None = None
        self._monitor: asyncio.Task | None = None
        endpoint.on(wire.Heartbeat, self._on_heartbeat)
        endpoint.on(wire.Ready, self._on_ready)
        endpoint.on(wire.StartFailed, self.readiness.on_start_failed)
        endpoint.on(wire.Bye, self._on_bye)

    # -- state ------------------------------------------------------------------------------------

    def process_states(self) -> dict[str, dict[str, Any]]:
        """Process name → its supervision state and restarts: ``state`` is ``starting``,
        ``running``, ``restarting`` (its group is being restarted), ``dead`` (it died and will
        not be restarted), ``stopping`` or ``stopped``; ``restarts`` counts its restarts."""
        restarting = {n for leader in self._restarting for n in self.group_of(leader)}
        out = {}
        for name, boot in self.boots.items():
            handle = self.lifecycle.handles.get(name)
            alive = handle is not None and handle.exitcode is None
            if name in restarting:
                state = "restarting"
            elif name in self._dead:
                state = "dead"
            elif self.lifecycle.state in ("stopping", "stopped"):
                state = "stopping" if alive else "stopped"
            elif not alive:
                state = "dead" if handle is not None else "starting"
            else:
                state = "running" if self.readiness.is_ready(name) else "starting"
            out[name] = {"state": state, "restarts": boot.generation}
        return out

    # -- start ------------------------------------------------------------------------------------

    async def start(self, plan: Plan) -> None:
        """Start every process and wait until all are ready; ``StartupError`` otherwise (after
        cleaning up everything that was started)."""
        if self.lifecycle.state != "new":
            raise PipelineClosed(f"pipeline {self.config.name!r} was already started")
        self.lifecycle.set("starting")
        self._loop = asyncio.get_running_loop()
        began = time.monotonic()
        self.log.info("pipeline starting", processes=len(plan.processes), stages=len(self.config.stages),
                      launcher=self.config.launcher.name)
        try:
            await self._start(plan)
        except BaseException as exc:
            # Fail fast: the processes that are not ready yet are serving nothing; they are ended
            # at once instead of being waited for (see _teardown).
            reason = "interrupted" if isinstance(exc, (KeyboardInterrupt, asyncio.CancelledError)) else \
                f"start failed: {getattr(exc, 'message', None) or exc}"
            self.log.info("pipeline stopping", reason=reason.splitlines()[0])
            stopping = time.monotonic()
            await self._teardown(stopping + self.config.limits.stop_timeout, failed_start=True)
            self.lifecycle.set("stopped")
            self.log.info("pipeline stopped", stop_time_s=round(time.monotonic() - stopping, 3))
            raise
        self.lifecycle.set("running")
        self.log.info("pipeline ready", processes=len(self.lifecycle.handles), start_time_s=round(time.monotonic() - began, 3))
        self._monitor = self._loop.create_task(self._watch_heartbeats())

    async def _start(self, plan: Plan) -> None:
        launch = self.launch
        addresses = launch.prepare(plan)
        self.endpoint.open(run_id=launch.run_id, runtime_dir=launch.runtime_dir or "", addresses=addresses,
                           secret=launch.secret)
        self.endpoint.listen()
        deadline = time.monotonic() + self.config.limits.startup_timeout
        for name in self.boots:
            self._launch(name)
        await self.readiness.wait(list(self.boots), deadline, self.config.limits.startup_timeout)

    def _launch(self, name: str) -> None:
        self.readiness.expect(name, self._loop)
        self._heard.pop(name, None)
        self._hung.pop(name, None)
        self._dead.discard(name)
        handle = self.launch.start(name)
        self.lifecycle.handles[name] = handle
        self._loop.add_reader(handle.sentinel, self._on_exit, name, handle)
        self.log.info("process started", process=name, pid=handle.pid, stages=list(self.boots[name].process.stages),
                      device=self.boots[name].process.device, generation=self.boots[name].generation)

    # -- messages ---------------------------------------------------------------------------------

    def _on_heartbeat(self, msg: wire.Heartbeat) -> None:
        boot = self.boots.get(msg.process)
        if boot is not None and boot.generation == msg.generation and msg.process in self._heard:
            self._heard[msg.process] = time.monotonic()

    def _on_ready(self, msg: wire.Ready) -> None:
        if self.readiness.on_ready(msg):
            self._heard[msg.process] = time.monotonic()

    def _on_bye(self, msg: wire.Bye) -> None:
        fut = self._byes.get(msg.process)
        if fut is not None and not fut.done():
            fut.set_result(None)

    # -- supervision ------------------------------------------------------------------------------

    def group_of(self, name: str) -> list[str]:
        """The processes restarted together with ``name``: its TP group (every rank of the
        replica), or the process alone."""
        assert self.launch.plan is not None  # set by start
        leader = self.boots[name].process.leader or name
        return [leader, *self.launch.plan.followers(leader)]

    def _on_exit(self, name: str, handle: ProcessHandle) -> None:
        with contextlib.suppress(Exception):
            self._loop.remove_reader(handle.sentinel)
        handle.join(0.1)
        if self.lifecycle.handles.get(name) is not handle:
            return  # a process of an earlier generation
        code = handle.exitcode
        reason = handle.describe_exit()  # e.g. Ray's cause and node
        stages = self.boots[name].process.stages
        if self.readiness.starting(name):
            how = reason or signal_name(code) or f"exit code {code}"
            self.readiness.died(name, StartupError(
                f"process {name!r} (stages: {', '.join(stages)}) died during startup ({how})", process=name), self._loop)
            return
        bye = self._byes.get(name)
        if bye is not None and not bye.done():  # gone without a Bye: nothing more to wait for
            bye.set_result(None)
        if self.lifecycle.state in ("stopping", "stopped", "new", "starting"):
            return  # expected (stopping), or handled by the start (starting)
        silent = self._hung.pop(name, None)
        self._dead.add(name)

        def error(req: Any) -> BaseException:
            rid = getattr(req, "request_id", None)
            if silent is not None:
                return ProcessHung(process=name, pid=handle.pid, silent_for=silent, request_id=rid, stages=stages)
            return ProcessDied(process=name, pid=handle.pid, exitcode=code, signal=signal_name(code), request_id=rid,
                               stages=stages, reason=reason)

        group = self.group_of(name)
        self._heard.pop(name, None)
        failed = self.requests.fail_where(set(group), error)
        self.log.error("stage process hung" if silent is not None else "stage process died", process=name,
                       pid=handle.pid, exitcode=code, signal=signal_name(code), reason=reason, failed_requests=failed)
        leader = group[0]
        if leader in self._restarting:
            self._again.add(leader)  # died while its group restarts: that restart goes round again
            return
        policy = self.config.restart
        if policy.policy == "on-failure" and self.restarts < policy.max_restarts:
            self.restarts += 1
            self.lifecycle.set("restarting")
            self._restarting[leader] = self._loop.create_task(self._restart(leader, group))
        else:
            self.lifecycle.closed_reason = error(None)
            if policy.policy == "on-failure":
                self.log.error("restart limit reached; stopping", max_restarts=policy.max_restarts)
            self._begin_stop()

    async def _restart(self, leader: str, group: list[str]) -> None:
        try:
            while True:
                self.log.warning("restarting process group", group=group, restart=self.restarts)
                try:
                    await ending.kill(h for n in group if (h := self.lifecycle.handles.get(n)) is not None)
                    floor, ended = self.requests.ended()
                    for name in group:
                        self.launch.next_generation(name, floor, ended)
                        self._launch(name)
                    await self.readiness.wait(group, time.monotonic() + self.config.limits.startup_timeout,
                                              self.config.limits.startup_timeout)
                    if leader not in self._again and all(self.lifecycle.live(n) for n in group):
                        break
                    self._again.discard(leader)
                    raise StartupError(f"a process of group {group} died while the group restarted")
                except Exception as exc:
                    if self.lifecycle.state in ("stopping", "stopped"):
                        return
                    policy = self.config.restart
                    if self.restarts >= policy.max_restarts:
                        self.log.error("restart failed", group=group, error=str(exc))
                        self.lifecycle.closed_reason = exc
                        self._begin_stop()
                        return
                    self.restarts += 1
            for name in group:
                self.log.info("process group restarted", process=name, pid=self.lifecycle.handles[name].pid)
        finally:
            self._again.discard(leader)
            self._restarting.pop(leader, None)
            if not self._restarting and self.lifecycle.state == "restarting":
                self.lifecycle.set("running")

    async def _watch_heartbeats(self) -> None:
        limits = self.config.limits
        interval, timeout = limits.heartbeat_interval, limits.heartbeat_timeout
        last = time.monotonic()
        while self.lifecycle.state in ("running", "restarting"):
            await asyncio.sleep(interval)
            now = time.monotonic()
            late, last = now - last - interval, now
            if late > interval / 2:
                continue  # this loop was busy: heartbeats may be waiting in the inbox
            for name, heard in list(self._heard.items()):
                silent = now - heard
                if silent > timeout and self.lifecycle.live(name) and name not in self._hung:
                    self._hung[name] = silent
                    self.log.error("stage process hung: killing it", process=name, silent_for=round(silent, 1))
                    with contextlib.suppress(Exception):
                        self.lifecycle.handles[name].kill()

    # -- stop -------------------------------------------------------------------------------------

    async def stop(self, timeout: float | None = None) -> None:
        """Drain requests in flight, then shut every process down and free everything, all
        within ``timeout`` (default ``limits.stop_timeout``). Idempotent."""
        if self.lifecycle.state in ("stopped", "new"):
            self.lifecycle.set("stopped")
            return
        self._begin_stop(timeout, reason="stop requested")
        if self._stop_task is not None:
            await asyncio.shield(self._stop_task)

    def _begin_stop(self, timeout: float | None = None, *, reason: str | None = None) -> None:
        """Enter ``stopping`` now (no request is admitted from here on) and stop in a task."""
        if self.lifecycle.state in ("stopping", "stopped", "new"):
            return
        self.lifecycle.set("stopping")
        if reason is None:
            reason = str(self.lifecycle.closed_reason).splitlines()[0] if self.lifecycle.closed_reason is not None else "stop requested"
        self.log.info("pipeline stopping", reason=reason, in_flight=self.requests.in_flight())
        self._stop_task = self._loop.create_task(self._stop(timeout))

    async def _stop(self, timeout: float | None) -> None:
        total = self.config.limits.stop_timeout if timeout is None else timeout
        start = time.monotonic()
        deadline = start + total
        for task in list(self._restarting.values()):
            task.cancel()
        if self._monitor is not None:
            self._monitor.cancel()
        await self.requests.drain(start + total * 0.5)
        self.requests.abort_all(self.lifecycle.closed_reason)
        await self._teardown(deadline)
        self.lifecycle.set("stopped")
        self.log.info("pipeline stopped", stop_time_s=round(time.monotonic() - start, 3))

    async def _teardown(self, deadline: float, *, failed_start: bool = False) -> None:
        """End every process within ``deadline``: ``Shutdown`` (they free what they hold and say
        ``Bye``), then join, SIGTERM, SIGKILL. After a failed start, the processes that are not
        ready yet (still importing or building their stages; the failed ones) get SIGTERM at once:
        they hold nothing a shutdown would free that the relay sweep below does not."""
        start = time.monotonic()
        span = max(0.5, deadline - start)
        alive = {n: h for n, h in self.lifecycle.handles.items() if h.exitcode is None}
        if failed_start:
            self.readiness.cancel()  # their deaths from here on are expected, not other failures
            unready = [n for n in alive if not self.readiness.is_ready(n)]
            for name in unready:
                alive.pop(name).terminate()
        if alive:
            self._byes = {n: self._loop.create_future() for n in alive}
            self.endpoint.post_all(alive, wire.Shutdown())
            await asyncio.wait(list(self._byes.values()), timeout=span * 0.5)
        await ending.stair(self.lifecycle.handles.values(), start, span)
        self.launch.close_launcher()
        self.endpoint.close(linger_ms=0)
        self.launch.close()

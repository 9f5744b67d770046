"""The runner and coordinator (parent process): :class:`Pipeline` and :func:`run`.

``Pipeline`` plans the config, creates a private 0700 runtime directory for the ipc endpoints,
binds the coordinator's inbox, starts every process through the configured launcher and waits
until all report ready (one deadline; a child's traceback comes back in ``StartupError``). Then it
serves requests and supervises: a process that dies is noticed at once through its sentinel, the
requests in flight fail with ``ProcessDied``, and the pipeline stops or restarts that process
(``restart: on-failure``). ``stop()`` drains, sends ``Shutdown``, waits for every ``Bye``, then
escalates join → terminate → kill and removes the runtime directory and every relay resource. A
failed start cleans up the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ..config import PipelineConfig, load_config, to_dict
from ..errors import (
    OmniError,
    Overloaded,
    PipelineClosed,
    ProcessDied,
    RequestAborted,
    RequestTimeout,
    StageError,
    StartupError,
)
from ..logs import get_logger
from ..plan.topology import OBJECT_RELAY, Plan, build_plan, endpoints
from ..plugins import get_registry
from ..relay.base import Relay, RelayContext
from ..relay.payload import pack, unpack
from . import wire
from .channel import Inbox, Outbox
from .host import CALLER_RELAY, Bootstrap
from .launcher import ProcessHandle
from .requests import Event, Graph, Request

RUNTIME_DIR_PREFIX = "omni-run-"


def _signal_name(exitcode: int | None) -> str | None:
    if exitcode is not None and exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return None


def sweep_stale_runtime_dirs(base: str | None = None, *, dry_run: bool = False) -> list[str]:
    """Remove runtime directories of runs whose parent process is gone (after a SIGKILL).
    ``dry_run``: only list them."""
    base = base or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(base):
            if not entry.name.startswith(RUNTIME_DIR_PREFIX) or not entry.is_dir():
                continue
            try:
                pid = int(entry.name[len(RUNTIME_DIR_PREFIX):].split("-")[0])
                os.kill(pid, 0)
            except (ValueError, PermissionError):
                continue
            except ProcessLookupError:
                if not dry_run:
                    shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


class Pipeline:
    """A running pipeline. Use ``async with Pipeline(config) as p:`` or ``start()``/``stop()``.

    ``config`` is anything :func:`omni_core.load_config` accepts. ``gpus`` simulates that many
    GPUs for placement (planning without devices)."""

    def __init__(self, config: str | os.PathLike | Mapping[str, Any] | PipelineConfig, *, gpus: int | None = None):
        self.config = load_config(config)
        self.gpus = gpus
        self.log = get_logger(pipeline=self.config.name)
        self.plan: Plan | None = None
        self.run_id = ""
        self.runtime_dir: str | None = None
        self.addresses: dict[str, str] = {}
        self.handles: dict[str, ProcessHandle] = {}
        self.boots: dict[str, Bootstrap] = {}
        self.requests: dict[int, Request] = {}
        self.by_id: dict[str, int] = {}
        self._rids = itertools.count(1)
        self._state = "new"
        self._closed_reason: BaseException | None = None
        self._ready: dict[str, asyncio.Future] = {}
        self._byes: dict[str, asyncio.Future] = {}
        self._restarts = 0
        self._stop_task: asyncio.Task | None = None
        self._zctx = None
        self.inbox: Inbox | None = None
        self.outbox: Outbox | None = None
        self.launcher = None
        self.graph = Graph(self.config)
        self._terminal_fn = None
        self._stateful: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._caller_relay_instance: Relay | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Pipeline:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    @property
    def running(self) -> bool:
        return self._state == "running"

    async def start(self) -> None:
        """Start every process and wait until all are ready; ``StartupError`` otherwise (after
        cleaning up everything that was started)."""
        if self._state != "new":
            raise PipelineClosed(f"pipeline {self.config.name!r} was already started")
        self._state = "starting"
        self._loop = asyncio.get_running_loop()
        try:
            await self._start()
        except BaseException:
            await self._teardown()
            self._state = "stopped"
            raise
        self._state = "running"

    async def _start(self) -> None:
        import zmq

        registry = get_registry()
        cfg = self.config
        self.plan = plan = build_plan(cfg, registry, gpus=self.gpus)
        if cfg.terminal_stages_fn:
            self._terminal_fn = registry.resolve("terminal_stages", cfg.terminal_stages_fn)
        base = cfg.endpoints.ipc_dir or tempfile.gettempdir()
        sweep_stale_runtime_dirs(base)
        for relay_name in {e.relay for e in plan.edges if e.relay != OBJECT_RELAY} | {CALLER_RELAY}:
            with contextlib.suppress(Exception):
                registry.resolve("relay", relay_name).sweep(None)
        self.run_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.runtime_dir = tempfile.mkdtemp(prefix=f"{RUNTIME_DIR_PREFIX}{os.getpid()}-", dir=base)
        os.chmod(self.runtime_dir, 0o700)
        launcher_cls = registry.resolve("launcher", cfg.launcher.name)
        self.launcher = launcher_cls(dict(cfg.launcher.options))
        plan, views = self._place(plan)
        self.plan = plan
        self.addresses = views[""]
        self._zctx = zmq.Context(io_threads=1)
        self.inbox = Inbox(self._zctx, self.addresses[""], self._on_message, name="coordinator")
        self.inbox.start()
        self.outbox = Outbox(self._zctx)
        stateful_stages = {s.name for s in cfg.stages if s.wait_for or any(s.name in o.stream_to for o in cfg.stages)}
        self._stateful = [p.name for p in plan.leaders() if stateful_stages & set(p.stages)]
        routes = {s.name: plan.processes_of(s.name) for s in cfg.stages}
        edge_relays = {(e.src, e.dst, e.kind): e.relay for e in plan.edges}
        config_data = to_dict(cfg)
        for spec in plan.processes:
            env = spec.environment(os.environ)
            self.boots[spec.name] = Bootstrap(
                run_id=self.run_id,
                runtime_dir=self.runtime_dir,
                config=config_data,
                process=spec,
                addresses=views[spec.name],
                routes=routes,
                edge_relays=edge_relays,
                env=env,
                parent_pid=os.getpid(),
                followers=tuple(p.name for p in plan.processes if p.leader == spec.name),
                cwd=os.getcwd(),
            )
        deadline = time.monotonic() + cfg.limits.startup_timeout
        for name in self.boots:
            self._launch(name)
        await self._wait_ready(list(self.boots), deadline)

    def _place(self, plan: Plan) -> tuple[Plan, dict[str, dict[str, str]]]:
        """The plan as launched, and the address map of the coordinator (``""``) and of each
        process. ipc for all with a launcher that runs everything on this
        machine; a launcher with ``prepare`` (one that spans machines) places the processes,
        binds tcp inboxes where a sender is on another node, and returns the plan with the edges
        that cross nodes marked (and their relays chosen for it) plus each process's view."""
        prepare = getattr(self.launcher, "prepare", None)
        if prepare is not None:
            return prepare(plan, self.run_id, self.runtime_dir, self.config.endpoints)
        addresses = dict(endpoints(plan, self.runtime_dir))
        return plan, dict.fromkeys(["", *(p.name for p in plan.processes)], addresses)

    def _launch(self, name: str) -> None:
        self._ready[name] = self._loop.create_future()
        handle = self.launcher.start(self.boots[name])
        self.handles[name] = handle
        self._loop.add_reader(handle.sentinel, self._on_exit, name, handle)

    async def _wait_ready(self, names: list[str], deadline: float) -> None:
        waiting = {self._ready[n]: n for n in names}
        pending = set(waiting)
        while pending:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                late = ", ".join(sorted(waiting[f] for f in pending))
                raise StartupError(
                    f"pipeline {self.config.name!r}: process(es) {late} not ready within "
                    f"limits.startup_timeout ({self.config.limits.startup_timeout:g} s); raise it if stage "
                    "construction (model loading) is slow"
                )
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                fut.result()  # raises StartupError for a failed process

    async def stop(self, *, timeout: float | None = None) -> None:
        """Drain requests in flight (up to ``limits.stop_timeout``), then shut every process
        down and free everything. Idempotent."""
        if self._state in ("stopped", "new"):
            self._state = "stopped"
            return
        if self._state == "stopping":
            if self._stop_task is not None:
                await asyncio.shield(self._stop_task)
            return
        self._state = "stopping"
        self._stop_task = asyncio.get_running_loop().create_task(self._stop(timeout))
        await asyncio.shield(self._stop_task)

    async def _stop(self, timeout: float | None) -> None:
        timeout = self.config.limits.stop_timeout if timeout is None else timeout
        pending = [r.future for r in self.requests.values()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        for req in list(self.requests.values()):
            self._finish(req, error=RequestAborted(f"request {req.request_id!r} aborted: the pipeline stopped", request_id=req.request_id))
        await self._teardown(timeout)
        self._state = "stopped"

    async def _teardown(self, timeout: float | None = None) -> None:
        timeout = self.config.limits.stop_timeout if timeout is None else timeout
        alive = {n: h for n, h in self.handles.items() if h.exitcode is None}
        if alive and self.outbox is not None:
            self._byes = {n: self._loop.create_future() for n in alive}
            for name in alive:
                self.outbox.post(self.addresses[name], wire.Shutdown())
            await asyncio.wait(list(self._byes.values()), timeout=max(0.5, timeout / 2))
        deadline = time.monotonic() + max(0.5, timeout / 2)
        for handle in self.handles.values():
            await self._join(handle, deadline - time.monotonic())
        for handle in self.handles.values():
            if handle.exitcode is None:
                handle.terminate()
                await self._join(handle, 2.0)
            if handle.exitcode is None:
                handle.kill()
                await self._join(handle, 2.0)
            with contextlib.suppress(Exception):
                self._loop.remove_reader(handle.sentinel)
        if self.launcher is not None:
            with contextlib.suppress(Exception):
                self.launcher.close()
        if self.inbox is not None:
            self.inbox.close()
        if self.outbox is not None:
            self.outbox.close(linger_ms=0)
        if self._zctx is not None:
            self._zctx.term()
            self._zctx = None
        self._sweep_relays()
        if self.runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def _sweep_relays(self) -> None:
        if not self.plan or not self.run_id:
            return
        registry = get_registry()
        for relay_name in {e.relay for e in self.plan.edges if e.relay != OBJECT_RELAY}:
            try:
                registry.resolve("relay", relay_name).sweep(self.run_id)
            except Exception:
                self.log.exception("relay sweep failed", relay=relay_name)

    @staticmethod
    async def _join(handle: ProcessHandle, timeout: float) -> None:
        end = time.monotonic() + max(0.0, timeout)
        while handle.exitcode is None and time.monotonic() < end:
            await asyncio.sleep(0.01)
        if handle.exitcode is not None:
            handle.join(0)

    # -- supervision -------------------------------------------------------------------------------

    def _on_exit(self, name: str, handle: ProcessHandle) -> None:
        with contextlib.suppress(Exception):
            self._loop.remove_reader(handle.sentinel)
        handle.join(0.1)
        if self.handles.get(name) is not handle:
            return
        code = handle.exitcode
        reason = handle.describe_exit() if hasattr(handle, "describe_exit") else None  # e.g. Ray's cause and node
        stages = self.boots[name].process.stages
        ready = self._ready.get(name)
        if ready is not None and not ready.done():
            how = reason or _signal_name(code) or f"exit code {code}"
            ready.set_exception(StartupError(f"process {name!r} (stages: {', '.join(stages)}) died during startup ({how})", process=name))
            return
        if self._state not in ("running",):
            return
        self.log.error("stage process died", process=name, pid=handle.pid, exitcode=code, reason=reason)
        for req in list(self.requests.values()):
            self._finish(req, error=ProcessDied(process=name, pid=handle.pid, exitcode=code, signal=_signal_name(code), request_id=req.request_id, stages=stages, reason=reason))
        policy = self.config.restart
        if policy.policy == "on-failure" and self._restarts < policy.max_restarts:
            self._restarts += 1
            self._loop.create_task(self._restart(name))
        else:
            self._closed_reason = ProcessDied(process=name, pid=handle.pid, exitcode=code, signal=_signal_name(code), stages=stages, reason=reason)
            self._loop.create_task(self.stop())

    async def _restart(self, name: str) -> None:
        self.log.warning("restarting stage process", process=name, restart=self._restarts)
        self._state = "restarting"
        try:
            self._launch(name)
            await self._wait_ready([name], time.monotonic() + self.config.limits.startup_timeout)
        except Exception as exc:
            self.log.error("restart failed", process=name, error=str(exc))
            self._closed_reason = exc
            self._state = "running"
            await self.stop()
            return
        self._state = "running"

    # -- control messages ----------------------------------------------------------------------------

    def _on_message(self, msg: wire.Message, frames: list) -> None:
        if isinstance(msg, wire.Data):
            req = self.requests.get(msg.rid)
            if req is None:
                return
            if msg.relay:
                self._loop.create_task(self._receive(req, msg, frames))
            else:
                self._on_data(req, msg, unpack(msg.skeleton, [], allow_pickle=self.config.allow_pickle))
        elif isinstance(msg, wire.Failed):
            req = self.requests.get(msg.rid)
            if req is not None:
                self._finish(req, error=StageError(msg.message, stage=msg.stage, request_id=req.request_id, error_type=msg.error_type, traceback=msg.traceback))
        elif isinstance(msg, wire.Dropped):
            req = self.requests.get(msg.rid)
            if req is not None:
                self.graph.mark_dropped(req, msg.stage, msg.targets)
                self._maybe_complete(req)
        elif isinstance(msg, wire.Ready):
            fut = self._ready.get(msg.process)
            if fut is not None and not fut.done():
                fut.set_result(msg.pid)
        elif isinstance(msg, wire.StartFailed):
            fut = self._ready.get(msg.process)
            if fut is not None and not fut.done():
                fut.set_exception(StartupError(f"process {msg.process!r} failed to start: {msg.message}", process=msg.process, traceback=msg.traceback))
        elif isinstance(msg, wire.Bye):
            fut = self._byes.get(msg.process)
            if fut is not None and not fut.done():
                fut.set_result(None)
        else:
            self.log.warning("dropped an unexpected control message", message=type(msg).__name__)

    async def _receive(self, req: Request, msg: wire.Data, frames: list) -> None:
        try:
            if msg.relay != CALLER_RELAY:
                raise ValueError(f"results must come through the {CALLER_RELAY!r} relay, not {msg.relay!r}")
            tensors = await self._caller_relay().get(msg.handle, [f.buffer for f in frames])
            payload = unpack(msg.skeleton, tensors, allow_pickle=self.config.allow_pickle)
        except Exception as exc:
            self._finish(req, error=StageError(f"cannot decode the result: {exc}", stage=msg.src, request_id=req.request_id, error_type=type(exc).__name__))
            return
        if self.requests.get(msg.rid) is req:
            self._on_data(req, msg, payload)

    def _caller_relay(self) -> Relay:
        """The relay of the caller's edges (inputs in, results and events out)."""
        if self._caller_relay_instance is None:
            cls = get_registry().resolve("relay", CALLER_RELAY)
            self._caller_relay_instance = cls(RelayContext(self.run_id, "coordinator", self.runtime_dir or "", {}))
        return self._caller_relay_instance

    def _on_data(self, req: Request, msg: wire.Data, payload: Any) -> None:
        if msg.kind == "result":
            if msg.stage in req.expected or (not req.expected and not req.results):
                req.results[msg.stage] = payload
            self._maybe_complete(req)
        elif msg.kind == "event" and req.events is not None:
            if req.events.qsize() >= self.config.limits.stream_buffer:
                self._finish(req, error=StageError(
                    f"the caller did not read the stream: more than {self.config.limits.stream_buffer} unread chunks",
                    stage=msg.stage, request_id=req.request_id, error_type="StreamOverflow"))
                return
            req.events.put_nowait(Event("chunk", msg.stage, payload))

    def _maybe_complete(self, req: Request) -> None:
        if not req.complete:
            return
        if not req.results:
            self._finish(req, error=StageError(
                "routing skipped every terminal stage, so the request produced no result",
                stage=req.last_dropper or "?", request_id=req.request_id, error_type="NoResult"))
            return
        self._finish(req, value=req.value())

    def _finish(self, req: Request, *, value: Any = None, error: BaseException | None = None) -> None:
        if self.requests.pop(req.rid, None) is None:
            return
        if self.by_id.get(req.request_id) == req.rid:
            del self.by_id[req.request_id]
        if req.timer is not None:
            req.timer.cancel()
        if error is not None:
            self._broadcast(wire.Abort(req.rid), self.handles)
            if not req.future.done():
                req.future.set_exception(error)
        else:
            if self._stateful:
                self._broadcast(wire.Forget(req.rid), self._stateful)
            if not req.future.done():
                req.future.set_result(value)
        if req.events is not None:
            req.events.put_nowait(None)

    def _broadcast(self, msg: Any, names: Any) -> None:
        if self.outbox is None:
            return
        for name in names:
            handle = self.handles.get(name)
            if handle is not None and handle.exitcode is None:
                self.outbox.post(self.addresses[name], msg)

    # -- requests ----------------------------------------------------------------------------------

    def _admit(self, inputs: Any, request_id: str | None, streaming: bool) -> Request:
        if self._state not in ("running", "restarting"):
            reason = f": {self._closed_reason}" if self._closed_reason else ""
            raise PipelineClosed(f"pipeline {self.config.name!r} is not running ({self._state}){reason}")
        if len(self.requests) >= self.config.limits.max_in_flight:
            raise Overloaded(
                f"pipeline {self.config.name!r} has {len(self.requests)} requests in flight "
                f"(limits.max_in_flight); retry later", request_id=request_id)
        rid = next(self._rids)
        request_id = request_id if request_id is not None else f"req-{rid}"
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self.by_id:
            raise ValueError(f"request id {request_id!r} is already in flight; ids can be reused once their request ended")
        expected = set(self.config.terminal_stages)
        if self._terminal_fn is not None:
            expected = self._terminals_for(inputs, request_id)
        req = Request(rid, request_id, self._loop.create_future(), expected, multi=len(expected) > 1,
                      events=asyncio.Queue() if streaming else None)
        self.requests[rid] = req
        self.by_id[request_id] = rid
        timeout = self.config.limits.request_timeout
        if timeout:
            req.timer = self._loop.call_later(timeout, self._on_timeout, req)
        return req

    def _terminals_for(self, inputs: Any, request_id: str) -> set[str]:
        fn_name = self.config.terminal_stages_fn
        terminals = self.config.terminal_stages
        try:
            answer = self._terminal_fn(inputs)
        except Exception as exc:
            import traceback

            raise StageError(str(exc), stage="terminal_stages_fn", request_id=request_id, error_type=type(exc).__name__,
                             traceback="".join(traceback.format_exception(exc))) from None
        if answer is None:
            return set(terminals)
        names = [answer] if isinstance(answer, str) else list(answer)
        bad = [n for n in names if n not in terminals]
        if bad or not names:
            raise StageError(f"terminal_stages_fn {fn_name!r} returned {answer!r}; expected a non-empty subset of {terminals}",
                             stage="terminal_stages_fn", request_id=request_id, error_type="WiringError")
        return set(names)

    def _on_timeout(self, req: Request) -> None:
        self._finish(req, error=RequestTimeout(
            f"request {req.request_id!r} took longer than limits.request_timeout ({self.config.limits.request_timeout:g} s)",
            request_id=req.request_id))

    async def _send_inputs(self, req: Request, inputs: Any) -> None:
        entry = self.config.entry
        procs = self.plan.processes_of(entry)
        address = self.addresses[procs[req.rid % len(procs)]]
        skeleton, tensors = pack(inputs, allow_pickle=self.config.allow_pickle)
        if tensors:
            transfer = await self._caller_relay().put(req.rid, tensors, procs[0])
            msg = wire.Data("work", req.rid, req.request_id, entry, "", skeleton, CALLER_RELAY, transfer.handle, len(transfer.frames))
            await self.outbox.send(address, msg, transfer.frames)
        else:
            await self.outbox.send(address, wire.Data("work", req.rid, req.request_id, entry, "", skeleton))

    async def submit(self, inputs: Any, *, request_id: str | None = None) -> Any:
        """Run one request and return its result (a dict of stage → result when several
        terminal stages answer). Raises ``StageError``, ``ProcessDied``, ``Overloaded``,
        ``RequestAborted``, ``RequestTimeout``."""
        req = self._admit(inputs, request_id, streaming=False)
        try:
            await self._send_inputs(req, inputs)
            return await req.future
        except asyncio.CancelledError:
            self._finish(req, error=RequestAborted(f"request {req.request_id!r} was cancelled by the caller", request_id=req.request_id))
            raise
        except OmniError:
            raise
        except Exception as exc:
            self._finish(req, error=exc)
            raise

    async def stream(self, inputs: Any, *, request_id: str | None = None) -> AsyncIterator[Event]:
        """Run one request and yield ``Event``s: the chunks terminal stages emit as they come,
        then the result (``event.is_result``). Leaving the loop early aborts the request."""
        req = self._admit(inputs, request_id, streaming=True)
        try:
            await self._send_inputs(req, inputs)
            while True:
                item = await req.events.get()
                if item is None:
                    break
                yield item
            yield Event("result", None if req.multi else next(iter(req.expected), None), await req.future)
        finally:
            if req.rid in self.requests:
                self._finish(req, error=RequestAborted(f"request {req.request_id!r} was abandoned by the caller", request_id=req.request_id))
            if req.future.done() and not req.future.cancelled():
                req.future.exception()  # retrieved: no "never retrieved" warning

    async def abort(self, request_id: str) -> bool:
        """Abort a request in flight: every stage holding it is cancelled and its relay resources
        are freed. Returns False if no such request is in flight."""
        rid = self.by_id.get(request_id)
        req = self.requests.get(rid) if rid is not None else None
        if req is None:
            return False
        self._finish(req, error=RequestAborted(f"request {request_id!r} was aborted", request_id=request_id))
        return True

    def pids(self) -> dict[str, int | None]:
        """Process name → pid of every stage process."""
        return {name: h.pid for name, h in self.handles.items()}


def run(config: str | os.PathLike | Mapping[str, Any] | PipelineConfig, inputs: Any, *, request_id: str | None = None) -> Any:
    """Start the pipeline, run one request, stop it, and return the result (synchronous)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("omni_core.run() cannot be called from a running event loop; use 'async with Pipeline(config) as p: await p.submit(inputs)'")

    async def once() -> Any:
        async with Pipeline(config) as pipeline:
            return await pipeline.submit(inputs, request_id=request_id)

    return asyncio.run(once())

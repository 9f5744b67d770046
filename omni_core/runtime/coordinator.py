"""The coordinator (parent process): admission, the request table, results, streams, aborts.

Requests enter through :meth:`Coordinator.submit` or :meth:`Coordinator.stream`. Admission is
bounded (``limits.max_in_flight``: one more fails at once with ``Overloaded``); while the runner
restarts a process group, new requests wait for it (bounded by ``limits.request_timeout``) and
fail with ``PipelineClosed`` if the pipeline stops instead. Results and the chunks terminal
stages emit for the caller are handled in the order they were sent, per request; a streaming
caller gives each chunk's credit back as it reads it, so a terminal stage never runs more than
``limits.stream_buffer`` chunks ahead of its reader. When a request ends, however it ends, every
process that may hold state for it is told (``Forget`` on success to the processes with
per-request state, ``Abort`` to all on failure), with the *floor*: every request below it has
ended, so processes drop late messages and their memory of ended requests.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from typing import Any

from .. import tracing
from ..config.schema import CALLER_STAGE, RETRYABLE_ERRORS, PipelineConfig, RetryConfig
from ..errors import (
    InvalidInput,
    OmniError,
    Overloaded,
    PipelineClosed,
    RequestAborted,
    RequestTimeout,
    StageError,
)
from ..logs import get_logger
from ..plan.topology import Plan, replica_index
from ..registry import Registry
from ..relay.payload import pack
from . import wire
from .endpoint import Endpoint
from .lifecycle import Lifecycle
from .requests import Event, Graph, Request
from .types import CALLER_RELAY, Inbound, WiringError, chosen_names


class Coordinator:
    """Requests in flight of one running pipeline. It sends and receives through the caller's
    ``endpoint`` (it is the endpoint's :class:`~.endpoint.DataReceiver`) and reads from
    ``lifecycle`` whether the pipeline runs and which processes are live."""

    def __init__(self, config: PipelineConfig, registry: Registry, endpoint: Endpoint, lifecycle: Lifecycle):
        self.config = config
        self.registry = registry
        self.endpoint = endpoint
        self.lifecycle = lifecycle
        self.log = get_logger(pipeline=config.name)
        self.requests: dict[int, Request] = {}  # in rid order: the first is the oldest in flight
        self.by_id: dict[str, int] = {}
        self.graph = Graph(config)
        self._next_rid = 1
        self._terminal_fn: Callable[[Any], Any] | None = None
        self._stateful: list[str] = []
        self._processes: list[str] = []
        self._entry = config.entry
        self._terminals = tuple(config.terminal_stages)
        #: non-terminal stages with ``caller`` in their stream_to: a request waits for their stream's end
        self._caller_streams = frozenset(s.name for s in config.stages
                                         if not s.terminal and CALLER_STAGE in s.stream_to)
        self._uses: dict[str, list[list[str]]] = {}
        self._batch = max(1, config.limits.stream_buffer // 4)
        self._behind: set[str] = set()  # processes that may remember ended requests
        self._deadlines: dict[int, float] = {}  # rid -> loop time its request times out
        self._timer: asyncio.TimerHandle | None = None  # at the oldest request's deadline
        #: requests run again after a process death, by the error of the failed attempt
        self.retries: dict[str, int] = {}
        self._resends: set[asyncio.Task] = set()  # retried attempts waiting to be sent
        endpoint.on_data(self)
        endpoint.on(wire.Failed, self._on_failed)
        endpoint.on(wire.Dropped, self._on_dropped)
        endpoint.on(wire.StreamEnd, self._on_stream_end)

    def bind(self, plan: Plan) -> None:
        """Learn the plan: which processes keep per-request state, and which ones a request may
        use (requests are spread over replicas by rid, the same way every process routes)."""
        cfg = self.config
        if cfg.terminal_stages_fn:
            self._terminal_fn = self.registry.resolve("terminal_stages", cfg.terminal_stages_fn)
        stateful_stages = {s.name for s in cfg.stages if s.wait_for or any(s.name in o.stream_to for o in cfg.stages)}
        self._stateful = [p.name for p in plan.leaders() if stateful_stages & set(p.stages)]
        self._processes = [p.name for p in plan.processes]
        for stage in cfg.stages:
            self._uses[stage.name] = [[leader, *plan.followers(leader)] for leader in plan.processes_of(stage.name)]

    def processes_of(self, rid: int, past: set[str] | frozenset[str] = frozenset()) -> set[str]:
        """Every process request ``rid`` may use (still, when the stages ``past`` are done with it)."""
        out: set[str] = set()
        for stage, replicas in self._uses.items():
            if stage not in past:
                out.update(replicas[replica_index(rid, len(replicas))])
        return out

    # -- admission -------------------------------------------------------------------------------

    async def _admit(self, inputs: Any, request_id: str | None, streaming: bool,
                     retry: RetryConfig | Mapping[str, Any] | int | None = None, from_network: bool = False) -> Request:
        policy = self.config.retry if retry is None else retry_config(retry, self.config.retry)
        lifecycle = self.lifecycle
        if lifecycle.state == "restarting":
            await lifecycle.wait_running(self.config.limits.request_timeout)
        if lifecycle.state != "running":
            reason = f": {lifecycle.closed_reason}" if lifecycle.closed_reason else ""
            raise PipelineClosed(f"pipeline {self.config.name!r} is not running ({lifecycle.state}){reason}")
        if len(self.requests) >= self.config.limits.max_in_flight:
            raise Overloaded(
                f"pipeline {self.config.name!r} has {len(self.requests)} requests in flight "
                f"(limits.max_in_flight); retry later", request_id=request_id)
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self.by_id:
            raise ValueError(f"request id {request_id!r} is already in flight; ids can be reused once their request ended")
        expected = set(self._terminals)
        rid = self._next_rid
        if request_id is None:
            request_id = f"req-{rid}"
        if self._terminal_fn is not None:
            expected = self._terminals_for(inputs, request_id)
        self._next_rid += 1
        loop = asyncio.get_running_loop()
        req = Request(rid, request_id, loop.create_future(), expected, multi=len(expected) > 1,
                      events=asyncio.Queue() if streaming else None)
        if self._caller_streams:
            req.caller_streams, req.open_streams = self._caller_streams, set(self._caller_streams)
        if policy.attempts > 1:  # what a retry sends again
            req.attempts, req.retry_on, req.inputs = policy.attempts, policy.on, inputs
            req.from_network, req.terminals = from_network, frozenset(expected)
        self.requests[rid] = req
        self.by_id[request_id] = rid
        timeout = self.config.limits.request_timeout
        if timeout:
            self._deadlines[rid] = deadline = loop.time() + timeout
            if self._timer is None:
                self._timer = loop.call_at(deadline, self._on_deadline)
        return req

    def _terminals_for(self, inputs: Any, request_id: str) -> set[str]:
        fn_name = self.config.terminal_stages_fn
        terminals = self._terminals
        assert self._terminal_fn is not None
        try:
            answer = self._terminal_fn(inputs)
        except Exception as exc:
            raise StageError(str(exc), stage="terminal_stages_fn", request_id=request_id, error_type=type(exc).__name__,
                             traceback="".join(traceback.format_exception(exc)),
                             invalid_input=isinstance(exc, InvalidInput),
                             field=exc.field if isinstance(exc, InvalidInput) else None) from None
        try:
            return set(chosen_names(answer, terminals, f"terminal_stages_fn {fn_name!r}",
                                    none_is_all=True, empty_ok=False))
        except WiringError as exc:
            raise StageError(str(exc), stage="terminal_stages_fn", request_id=request_id,
                             error_type="WiringError") from None

    def _on_deadline(self) -> None:
        """The one timer of the requests' deadlines: they come in admission (rid) order, since
        every request gets the same ``limits.request_timeout``, so the oldest request in flight
        has the nearest one. Time out what is due, then wait for the next oldest."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = []
        for rid, req in self.requests.items():
            deadline = self._deadlines.get(rid)
            if deadline is None:
                continue
            if deadline > now:
                self._timer = loop.call_at(deadline, self._on_deadline)
                break
            due.append(req)
        for req in due:
            if req.rid in self.requests:
                self._on_timeout(req)

    def _on_timeout(self, req: Request) -> None:
        self.finish(req, error=RequestTimeout(
            f"request {req.request_id!r} took longer than limits.request_timeout ({self.config.limits.request_timeout:g} s)",
            request_id=req.request_id))

    async def _send_inputs(self, req: Request, inputs: Any, from_network: bool = False) -> None:
        entry = self._entry
        leaders = self._uses[entry][replica_index(req.rid, len(self._uses[entry]))]
        skeleton, tensors = pack(inputs, allow_pickle=self.config.allow_pickle)
        await self.endpoint.send_data(leaders[0], wire.Data("work", req.rid, req.request_id, entry, "", skeleton,
                                                            trace=tracing.traceparent(), from_network=from_network),
                                      tensors, CALLER_RELAY)

    # -- the caller's API ------------------------------------------------------------------------

    async def submit(self, inputs: Any, *, request_id: str | None = None, from_network: bool = False,
                     retry: RetryConfig | Mapping[str, Any] | int | None = None) -> Any:
        req = await self._admit(inputs, request_id, streaming=False, retry=retry, from_network=from_network)
        try:
            await self._send_inputs(req, inputs, from_network)
            return await req.future
        except asyncio.CancelledError:
            self.finish(req, error=RequestAborted(f"request {req.request_id!r} was cancelled by the caller", request_id=req.request_id))
            _retrieved(req)
            raise
        except BaseException as exc:
            if req.rid in self.requests:  # the inputs could not be sent
                self.finish(req, error=exc if isinstance(exc, OmniError) else StageError(
                    f"cannot send the inputs: {exc}", stage=self.config.entry, request_id=req.request_id,
                    error_type=type(exc).__name__))
            _retrieved(req)
            raise

    async def stream(self, inputs: Any, *, request_id: str | None = None, from_network: bool = False,
                     retry: RetryConfig | Mapping[str, Any] | int | None = None) -> AsyncGenerator[Event, None]:
        req = await self._admit(inputs, request_id, streaming=True, retry=retry, from_network=from_network)
        try:
            try:
                await self._send_inputs(req, inputs, from_network)
            except BaseException as exc:
                if req.rid in self.requests and not isinstance(exc, asyncio.CancelledError):
                    self.finish(req, error=exc if isinstance(exc, OmniError) else StageError(
                        f"cannot send the inputs: {exc}", stage=self.config.entry, request_id=req.request_id,
                        error_type=type(exc).__name__))
                raise
            events = req.events
            assert events is not None  # a streamed request
            while True:
                item = await events.get()
                if item is None:
                    break
                event, origin = item
                self._read(req, event.stage, origin)
                yield event
            yield Event("result", None if req.multi else next(iter(req.expected), None), await req.future)
        finally:
            if req.rid in self.requests:
                self.finish(req, error=RequestAborted(f"request {req.request_id!r} was abandoned by the caller", request_id=req.request_id))
            _retrieved(req)

    def abort(self, request_id: str) -> bool:
        rid = self.by_id.get(request_id)
        req = self.requests.get(rid) if rid is not None else None
        if req is None:
            return False
        self.finish(req, error=RequestAborted(f"request {request_id!r} was aborted", request_id=request_id))
        return True

    def _read(self, req: Request, stage: str, origin: str) -> None:
        """The caller consumed one chunk of ``stage``'s stream: its credit goes back (batched,
        as in :class:`~.flow.StreamBuffer`)."""
        key = (stage, origin)
        owed = req.owed.get(key, 0) + 1
        if owed >= self._batch:
            req.owed[key] = 0
            if origin in self.endpoint.addresses and req.rid in self.requests:
                self.endpoint.post(origin, wire.Credit(req.rid, "", stage, owed))
        else:
            req.owed[key] = owed

    # -- messages from stage processes -----------------------------------------------------------

    # The endpoint's DataReceiver: results and the caller's stream chunks.

    def wanted(self, rid: int) -> bool:
        return rid in self.requests

    def accept(self, msg: wire.Data) -> bool:
        if msg.rid not in self.requests:
            return False
        if msg.relay and msg.relay != CALLER_RELAY:
            self.reject(msg, ValueError(f"results must come through the {CALLER_RELAY!r} relay, not {msg.relay!r}"))
            return False
        return True

    def reject(self, msg: wire.Data, exc: BaseException) -> None:
        req = self.requests.get(msg.rid)
        if req is not None:
            self.finish(req, error=StageError(f"cannot decode the result: {exc}", stage=msg.src,
                                              request_id=req.request_id, error_type=type(exc).__name__))

    def deliver(self, msg: wire.Data, payload: Any, inbound: Inbound | None) -> None:
        req = self.requests.get(msg.rid)
        if req is None:
            return
        if msg.kind == "result":
            if msg.stage in req.expected or (not req.expected and not req.results):
                req.results[msg.stage] = payload
            self._maybe_complete(req)
        elif msg.kind == "event":
            if msg.stage not in req.heard:
                req.heard.add(msg.stage)
            if req.events is not None:
                req.events.put_nowait((Event("chunk", msg.stage, payload), msg.origin))
            else:  # nobody reads chunks of a submitted request: their credit comes back at once
                self._read(req, msg.stage, msg.origin)
        else:
            self.finish(req, error=StageError(f"unexpected message kind {msg.kind!r}", stage=msg.src, request_id=req.request_id, error_type="ProtocolError"))

    def past(self, req: Request) -> set[str]:
        """The stages known to be done with ``req``: those that sent it a result (a stage's last
        word) and those on the line to a stage the caller heard from (a chunk or a result).
        Worked out only when a process dies: receiving costs nothing for it."""
        passed = self.graph.passed
        out = set(req.results)
        for stage in (*req.heard, *req.results):
            out.update(passed.get(stage, ()))
        return out

    def _on_failed(self, msg: wire.Failed) -> None:
        if msg.rid in self.requests:
            self.endpoint.in_order(msg.rid, lambda: self._failed(msg))

    def _on_dropped(self, msg: wire.Dropped) -> None:
        if msg.rid in self.requests:
            self.endpoint.in_order(msg.rid, lambda: self._dropped(msg))

    def _on_stream_end(self, msg: wire.StreamEnd) -> None:
        """A non-terminal stage ended its stream to the caller (after its last chunk)."""
        if msg.rid in self.requests:
            self.endpoint.in_order(msg.rid, lambda: self._stream_ended(msg))

    def _stream_ended(self, msg: wire.StreamEnd) -> None:
        req = self.requests.get(msg.rid)
        if req is not None:
            req.open_streams.discard(msg.src)
            self._maybe_complete(req)

    def _failed(self, msg: wire.Failed) -> None:
        req = self.requests.get(msg.rid)
        if req is not None:
            self.finish(req, error=StageError(msg.message, stage=msg.stage, request_id=req.request_id, error_type=msg.error_type, traceback=msg.traceback,
                                              invalid_input=msg.invalid_input, field=msg.field or None))

    def _dropped(self, msg: wire.Dropped) -> None:
        req = self.requests.get(msg.rid)
        if req is not None:
            self.graph.mark_dropped(req, msg.stage, msg.targets)
            self._maybe_complete(req)

    def _maybe_complete(self, req: Request) -> None:
        if not req.complete:
            return
        if not req.results:
            self.finish(req, error=StageError(
                "routing skipped every terminal stage, so the request produced no result",
                stage=req.last_dropper or "?", request_id=req.request_id, error_type="NoResult"))
            return
        self.finish(req, value=req.value())

    # -- ending ------------------------------------------------------------------------------------

    @property
    def floor(self) -> int:
        """Every request below it has ended."""
        return next(iter(self.requests), self._next_rid)

    def finish(self, req: Request, *, value: Any = None, error: BaseException | None = None) -> None:
        if self.requests.pop(req.rid, None) is None:
            return
        if self.by_id.get(req.request_id) == req.rid:
            del self.by_id[req.request_id]
        self.endpoint.forget(req.rid)
        self._deadlines.pop(req.rid, None)  # the timer, when it fires, waits for the next oldest
        if req.timer is not None:
            req.timer.cancel()
        floor = self.floor
        behind = floor < self._next_rid  # some requests are still in flight
        if error is not None:
            if not isinstance(error, RequestAborted):
                self.log.info("request failed", request_id=req.request_id, error=type(error).__name__,
                                 stage=getattr(error, "stage", None) or getattr(error, "process", None),
                                 reason=getattr(error, "reason", None) or str(error).split("\n", 1)[0])
            else:
                self.log.debug("request aborted", request_id=req.request_id)
            self._tell(wire.Abort(req.rid, floor))
            self._behind = set(self._processes) if behind else set()
            if not req.future.done():
                req.future.set_exception(error)
        else:
            self.log.debug("request done", request_id=req.request_id)
            if self._stateful:
                self._tell(wire.Forget(req.rid, floor), self._stateful)
                if behind:
                    self._behind.update(self._stateful)
                else:
                    self._behind.difference_update(self._stateful)
            if not req.future.done():
                req.future.set_result(value)
        if not self.requests and self._behind:
            # Idle: every process that may remember ended requests can forget them now.
            self._tell(wire.Forget(0, floor), self._behind)
            self._behind = set()
        if req.events is not None:
            req.events.put_nowait(None)

    def _tell(self, msg: wire.Message, names: Iterable[str] | None = None) -> None:
        """Post ``msg`` to the live processes among ``names`` (default: all)."""
        self.lifecycle.tell(self.endpoint, msg, names)

    def fail_where(self, processes: set[str], error: Callable[[Request], BaseException]) -> int:
        """Fail every request that is, or will be, in one of ``processes`` (decided by where
        each request is: the stages known done with it no longer count); returns how many."""
        hit = [req for rid, req in self.requests.items() if self.processes_of(rid, self.past(req)) & processes]
        for req in hit:
            exc = error(req)
            if self._retryable(req, exc):
                self._retry(req, exc)
            else:
                self.finish(req, error=exc)
        return len(hit)

    # -- retries -----------------------------------------------------------------------------------

    def _retryable(self, req: Request, exc: BaseException) -> bool:
        """Whether ``req`` runs again after ``exc``: its policy allows another attempt after
        this error, the pipeline restarts its processes, and (a stream) no chunk reached the
        caller yet: a stream is retried only before its first chunk."""
        return (req.attempt < req.attempts and type(exc).__name__ in req.retry_on
                and self.config.restart.policy == "on-failure"
                and not (req.events is not None and req.heard))

    def _retry(self, req: Request, exc: BaseException) -> None:
        """End ``req``'s failed attempt everywhere (as a failure ends a request) and start the
        next under a new rid, sent once the pipeline runs again; the caller waits on."""
        old = req.rid
        del self.requests[old]
        self.endpoint.forget(old)
        self._deadlines.pop(old, None)
        rid = self._next_rid
        self._next_rid += 1
        req.again(rid)
        self.requests[rid] = req
        self.by_id[req.request_id] = rid
        loop = asyncio.get_running_loop()
        timeout = self.config.limits.request_timeout
        if timeout:  # each attempt has the whole timeout (deadlines stay in rid order)
            self._deadlines[rid] = loop.time() + timeout
            if self._timer is None:
                self._timer = loop.call_at(self._deadlines[rid], self._on_deadline)
        self._tell(wire.Abort(old, self.floor))
        self._behind = set(self._processes)
        self.retries[type(exc).__name__] = self.retries.get(type(exc).__name__, 0) + 1
        self.log.warning("request retried", request_id=req.request_id, error=type(exc).__name__,
                         attempt=req.attempt, attempts=req.attempts,
                         process=getattr(exc, "process", None))
        task = loop.create_task(self._resend(req, rid, exc))
        self._resends.add(task)
        task.add_done_callback(self._resends.discard)

    async def _resend(self, req: Request, rid: int, exc: BaseException) -> None:
        """Send the retried attempt ``rid`` of ``req`` once its process group is back (the
        first error stands when the pipeline stops instead)."""
        await self.lifecycle.wait_running(self.config.limits.request_timeout)
        if self.requests.get(rid) is not req:
            return  # ended meanwhile (aborted, timed out, failed again, the pipeline stopped)
        if self.lifecycle.state != "running":
            self.finish(req, error=exc)
            return
        try:
            await self._send_inputs(req, req.inputs, req.from_network)
        except Exception as send_exc:
            if self.requests.get(rid) is req:
                self.finish(req, error=send_exc if isinstance(send_exc, OmniError) else StageError(
                    f"cannot send the inputs: {send_exc}", stage=self.config.entry, request_id=req.request_id,
                    error_type=type(send_exc).__name__))

    def abort_all(self, reason: BaseException | None) -> None:
        """The pipeline stopped: every request still in flight is aborted (``reason``: why,
        when the stop was not asked for)."""
        suffix = f" ({reason})" if reason is not None else ""
        self.fail_all(lambda req: RequestAborted(
            f"request {req.request_id!r} aborted: the pipeline stopped{suffix}", request_id=req.request_id))

    def in_flight(self) -> int:
        return len(self.requests)

    def ended(self) -> tuple[int, tuple[int, ...]]:
        floor = self.floor
        requests = self.requests
        return floor, tuple(rid for rid in range(floor, self._next_rid) if rid not in requests)

    def fail_all(self, error: Callable[[Request], BaseException]) -> None:
        for req in list(self.requests.values()):
            self.finish(req, error=error(req))
        if self._timer is not None:  # the pipeline stopped: no deadline left to watch
            self._timer.cancel()
            self._timer = None

    async def drain(self, deadline: float) -> None:
        """Wait for the requests in flight, until ``deadline`` (monotonic)."""
        pending = [r.future for r in self.requests.values()]
        timeout = deadline - time.monotonic()
        if pending and timeout > 0:
            await asyncio.wait(pending, timeout=timeout)

    def state(self) -> dict[str, int]:
        return {"requests": len(self.requests), "by_id": len(self.by_id), "ordered": len(self.endpoint.ordered)}

    @property
    def pending_deadlines(self) -> int:
        """How many requests have a ``request_timeout`` deadline armed (read-only)."""
        return len(self._deadlines)

    @property
    def timer_armed(self) -> bool:
        """Whether the request-timeout timer is set (read-only)."""
        return self._timer is not None

    @property
    def behind(self) -> frozenset[str]:
        """The processes that may still remember ended requests and get a ``Forget`` once none is
        in flight (read-only)."""
        return frozenset(self._behind)


def retry_config(value: RetryConfig | Mapping[str, Any] | int, default: RetryConfig) -> RetryConfig:
    """A request's own retry policy: a ``RetryConfig``, a mapping of its fields (``{"attempts":
    3, "on": ["ProcessDied"]}``; ``on`` defaults to the pipeline's) or a number of attempts."""
    if isinstance(value, RetryConfig):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"attempts": value}
    if not isinstance(value, Mapping):
        raise TypeError(f"retry must be a number of attempts or a mapping with attempts and on, got {type(value).__name__}")
    unknown = set(value) - {"attempts", "on"}
    if unknown:
        raise ValueError(f"retry: unknown key(s) {', '.join(sorted(map(str, unknown)))} (allowed: attempts, on)")
    attempts = value.get("attempts", default.attempts)
    if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1:
        raise ValueError(f"retry.attempts must be an integer of 1 or more, got {attempts!r}")
    on = value.get("on", default.on)
    if isinstance(on, str) or not all(name in RETRYABLE_ERRORS for name in on):
        raise ValueError(f"retry.on must be a list of {', '.join(RETRYABLE_ERRORS)}, got {on!r}")
    return RetryConfig(attempts=attempts, on=tuple(on))


def _retrieved(req: Request) -> None:
    """Mark the request's error as read: a caller that left (cancelled, abandoned the stream,
    its inputs could not be sent) gets another exception, and asyncio would log this one as
    "never retrieved"."""
    if req.future.done() and not req.future.cancelled():
        req.future.exception()

"""The coordinator (parent process): the request table, from admission to the request's end.

Requests enter through :meth:`Coordinator.submit` or :meth:`Coordinator.stream`, once
:mod:`.admission` lets them in. What the stage processes send back (results, the caller's
chunks, failures) is handled by :mod:`.replies` in the order it was sent, per request; a
streaming caller gives each chunk's credit back as it reads it. A request ends with its result,
a failure, an abort or its deadline (:mod:`.deadlines`), or runs again after a process death
(:mod:`.retries`); the processes that may hold its state are told (:mod:`.forgetting`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

from .. import tracing
from ..config.schema import CALLER_STAGE, PipelineConfig, RetryConfig
from ..errors import (
    RequestAborted,
    RequestTimeout,
)
from ..logs import get_logger
from ..plan.topology import Plan, replica_index
from ..registry import Registry
from ..relay.payload import pack
from . import wire
from .admission import Admission
from .deadlines import Deadlines
from .endpoint import Endpoint
from .forgetting import Forgetting
from .lifecycle import Lifecycle
from .replies import Replies
from .requests import Event, Graph, Request, unsent
from .retries import Retries, retry_config
from .types import CALLER, caller_edges


class Coordinator:
    """Requests in flight of one running pipeline. It sends and receives through the caller's
    ``endpoint`` (what comes back goes to its :class:`~.replies.Replies`) and reads from
    ``lifecycle`` whether the pipeline runs and which processes are live. Its parts: the
    requests' deadlines (:class:`~.deadlines.Deadlines`), their retries
    (:class:`~.retries.Retries`) and the replies of the stage processes."""

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
        self.admission = Admission(config, registry, lifecycle)
        self.forgetting = Forgetting(endpoint, lifecycle)
        self._entry = config.entry
        #: the caller's edges (its inputs out, the results and streamed chunks in) and their relays
        edges = caller_edges(config)
        self._input_relay = edges[(CALLER, self._entry, "work")]
        #: non-terminal stages with ``caller`` in their stream_to: a request waits for their stream's end
        self._caller_streams = frozenset(s.name for s in config.stages
                                         if not s.terminal and CALLER_STAGE in s.stream_to)
        self._uses: dict[str, list[list[str]]] = {}
        self.deadlines = Deadlines(config.limits.request_timeout, lambda: self.requests, self._expire)
        self.retrying = Retries(config, lifecycle, self.requests, self.log, finish=self.finish,
                                send=lambda req: self._send_inputs(req, req.inputs, req.from_network))
        #: requests run again after a process death, by the error of the failed attempt
        self.retries: dict[str, int] = self.retrying.counts
        self.replies = Replies(endpoint, self.requests, self.graph, self.finish,
                               batch=max(1, config.limits.stream_buffer // 4), edges=edges)

    def bind(self, plan: Plan) -> None:
        """Learn the plan: which processes keep per-request state, and which ones a request may
        use (requests are spread over replicas by rid, the same way every process routes)."""
        cfg = self.config
        self.admission.bind()
        stateful_stages = {s.name for s in cfg.stages if s.wait_for or any(s.name in o.stream_to for o in cfg.stages)}
        self.forgetting.bind([p.name for p in plan.leaders() if stateful_stages & set(p.stages)],
                             [p.name for p in plan.processes])
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
        await self.admission.check(request_id, len(self.requests), self.by_id)
        rid = self._next_rid
        if request_id is None:
            request_id = f"req-{rid}"
        expected = self.admission.terminals(inputs, request_id)
        self._next_rid += 1
        req = Request(rid, request_id, asyncio.get_running_loop().create_future(), expected, multi=len(expected) > 1,
                      events=asyncio.Queue() if streaming else None)
        if self._caller_streams:
            req.caller_streams, req.open_streams = self._caller_streams, set(self._caller_streams)
        if policy.attempts > 1:  # what a retry sends again
            req.attempts, req.retry_on, req.inputs = policy.attempts, policy.on, inputs
            req.from_network, req.terminals = from_network, frozenset(expected)
        self.requests[rid] = req
        self.by_id[request_id] = rid
        self.deadlines.add(rid)
        return req

    def _expire(self, rid: int) -> None:
        req = self.requests.get(rid)
        if req is not None:
            self.finish(req, error=RequestTimeout(
                f"request {req.request_id!r} took longer than limits.request_timeout "
                f"({self.config.limits.request_timeout:g} s)", request_id=req.request_id))

    async def _send_inputs(self, req: Request, inputs: Any, from_network: bool = False) -> None:
        entry = self._entry
        leaders = self._uses[entry][replica_index(req.rid, len(self._uses[entry]))]
        skeleton, tensors = pack(inputs, allow_pickle=self.config.allow_pickle)
        await self.endpoint.send_data(leaders[0], wire.Data("work", req.rid, req.request_id, entry, "", skeleton,
                                                            trace=tracing.traceparent(), from_network=from_network),
                                      tensors, self._input_relay)

    # -- the caller's API ------------------------------------------------------------------------

    async def submit(self, inputs: Any, *, request_id: str | None = None, from_network: bool = False,
                     retry: RetryConfig | Mapping[str, Any] | int | None = None) -> Any:
        req = await self._admit(inputs, request_id, streaming=False, retry=retry, from_network=from_network)
        try:
            await self._send_inputs(req, inputs, from_network)
            return await req.future
        except asyncio.CancelledError:
            self.finish(req, error=RequestAborted(f"request {req.request_id!r} was cancelled by the caller", request_id=req.request_id))
            req.error_read()
            raise
        except BaseException as exc:
            if req.rid in self.requests:  # the inputs could not be sent
                self.finish(req, error=unsent(exc, self.config.entry, req.request_id))
            req.error_read()
            raise

    async def stream(self, inputs: Any, *, request_id: str | None = None, from_network: bool = False,
                     retry: RetryConfig | Mapping[str, Any] | int | None = None) -> AsyncGenerator[Event, None]:
        req = await self._admit(inputs, request_id, streaming=True, retry=retry, from_network=from_network)
        try:
            try:
                await self._send_inputs(req, inputs, from_network)
            except BaseException as exc:
                if req.rid in self.requests and not isinstance(exc, asyncio.CancelledError):
                    self.finish(req, error=unsent(exc, self.config.entry, req.request_id))
                raise
            events = req.events
            assert events is not None  # a streamed request
            while True:
                item = await events.get()
                if item is None:
                    break
                event, origin = item
                self.replies.read(req, event.stage, origin)
                yield event
            yield Event("result", None if req.multi else next(iter(req.expected), None), await req.future)
        finally:
            if req.rid in self.requests:
                self.finish(req, error=RequestAborted(f"request {req.request_id!r} was abandoned by the caller", request_id=req.request_id))
            req.error_read()

    def abort(self, request_id: str) -> bool:
        rid = self.by_id.get(request_id)
        req = self.requests.get(rid) if rid is not None else None
        if req is None:
            return False
        self.finish(req, error=RequestAborted(f"request {request_id!r} was aborted", request_id=request_id))
        return True

    def past(self, req: Request) -> set[str]:
        """The stages known to be done with ``req`` (:meth:`.requests.Graph.past`)."""
        return self.graph.past(req)

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
        self.deadlines.discard(req.rid)
        if req.timer is not None:
            req.timer.cancel()
        floor = self.floor
        others = floor < self._next_rid  # some requests are still in flight
        if error is not None:
            if not isinstance(error, RequestAborted):
                self.log.info("request failed", request_id=req.request_id, error=type(error).__name__,
                                 stage=getattr(error, "stage", None) or getattr(error, "process", None),
                                 reason=getattr(error, "reason", None) or str(error).split("\n", 1)[0])
            else:
                self.log.debug("request aborted", request_id=req.request_id)
            self.forgetting.failed(req.rid, floor, others)
            if not req.future.done():
                req.future.set_exception(error)
        else:
            self.log.debug("request done", request_id=req.request_id)
            self.forgetting.done(req.rid, floor, others)
            if not req.future.done():
                req.future.set_result(value)
        if not self.requests:
            self.forgetting.idle(floor)
        if req.events is not None:
            req.events.put_nowait(None)

    def fail_where(self, processes: set[str], error: Callable[[Request], BaseException]) -> int:
        """Fail every request that is, or will be, in one of ``processes`` (decided by where
        each request is: the stages known done with it no longer count); returns how many."""
        hit = [req for rid, req in self.requests.items() if self.processes_of(rid, self.past(req)) & processes]
        for req in hit:
            exc = error(req)
            if self.retrying.allows(req, exc):
                self._retry(req, exc)
            else:
                self.finish(req, error=exc)
        return len(hit)

    def _retry(self, req: Request, exc: BaseException) -> None:
        """End ``req``'s failed attempt everywhere (as a failure ends a request) and start the
        next under a new rid, sent once the pipeline runs again; the caller waits on. Each
        attempt has the whole timeout (deadlines stay in rid order)."""
        old = req.rid
        del self.requests[old]
        self.endpoint.forget(old)
        self.deadlines.discard(old)
        rid = self._next_rid
        self._next_rid += 1
        req.again(rid)
        self.requests[rid] = req
        self.by_id[req.request_id] = rid
        self.deadlines.add(rid)
        self.forgetting.failed(old, self.floor, others=True)
        self.retrying.started(req, exc)

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
        self.deadlines.stop()  # the pipeline stopped: no deadline left to watch

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
        return len(self.deadlines)

    @property
    def timer_armed(self) -> bool:
        """Whether the request-timeout timer is set (read-only)."""
        return self.deadlines.armed

    @property
    def behind(self) -> frozenset[str]:
        """The processes that may still remember ended requests and get a ``Forget`` once none is
        in flight (read-only)."""
        return frozenset(self.forgetting.behind)


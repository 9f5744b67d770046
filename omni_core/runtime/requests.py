"""The coordinator's table entries for requests in flight, and when a request is complete.

A request is complete when every terminal stage expected to answer has answered and every
non-terminal stage streaming to the caller (``stream_to: [caller]``) that can still run ended that
stream (its chunks are all in before the result). Expected starts
as the per-request terminal set (``terminal_stages_fn``, else every terminal stage); when a stage
routes away from some targets (``Dropped``), stages that can no longer be reached are removed from
it, so routing never leaves a caller waiting for an answer that cannot come.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import attrs

from ..config.schema import PipelineConfig
from ..errors import OmniError, StageError


@attrs.frozen
class Event:
    """One item of ``Pipeline.stream``: a chunk a terminal stage emitted (``kind == "chunk"``),
    or the final result (``kind == "result"``, last)."""

    kind: str
    stage: str | None
    data: Any

    @property
    def is_result(self) -> bool:
        return self.kind == "result"


@attrs.define(eq=False)
class Request:
    rid: int
    request_id: str
    future: asyncio.Future
    expected: set[str]
    multi: bool
    results: dict[str, Any] = attrs.Factory(dict)
    dropped: set[tuple[str, str]] = attrs.Factory(set)
    dead: set[str] = attrs.Factory(set)
    #: streamed requests: (event, origin process) until the caller reads them; None at the end
    events: asyncio.Queue | None = None
    timer: asyncio.TimerHandle | None = None
    last_dropper: str | None = None
    #: stream credits read but not yet given back, per (stage, origin process)
    owed: dict[tuple[str, str], int] = attrs.Factory(dict)
    #: stages the caller got a chunk from (Coordinator.past: the stages done with the request)
    heard: set[str] = attrs.Factory(set)
    #: retries: how many times the request may run (1: once), which errors it is run again
    #: after, its attempt (1 for the first), and what the next attempt sends again
    attempts: int = 1
    retry_on: tuple[str, ...] = ()
    attempt: int = 1
    inputs: Any = None
    from_network: bool = False
    terminals: frozenset[str] = frozenset()
    #: the non-terminal stages streaming to the caller, and those of them whose stream is still open
    caller_streams: frozenset[str] = frozenset()
    open_streams: set[str] = attrs.Factory(set)

    def again(self, rid: int) -> None:
        """Start the next attempt under ``rid``: what the failed one gathered is forgotten."""
        self.rid = rid
        self.attempt += 1
        self.expected = set(self.terminals)
        self.results.clear()
        self.dropped.clear()
        self.dead.clear()
        self.owed.clear()
        self.heard.clear()
        self.last_dropper = None
        self.open_streams = set(self.caller_streams)

    @property
    def complete(self) -> bool:
        if self.open_streams and not self.open_streams <= self.dead:
            return False
        return self.expected <= self.results.keys()

    def error_read(self) -> None:
        """Mark the request's error as read: a caller that left (cancelled, abandoned the stream,
        its inputs could not be sent) gets another exception, and asyncio would log this one as
        "never retrieved"."""
        if self.future.done() and not self.future.cancelled():
            self.future.exception()

    def value(self) -> Any:
        if self.multi:
            return {name: self.results[name] for name in sorted(self.results)}
        return next(iter(self.results.values()))


class Graph:
    """The static ``next`` graph, for finding stages a request can no longer reach, and those
    it has passed."""

    def __init__(self, cfg: PipelineConfig):
        self.entry = cfg.entry
        self.preds: dict[str, list[str]] = {s.name: [] for s in cfg.stages}
        self.succ: dict[str, list[str]] = {s.name: list(s.next) for s in cfg.stages}
        for stage in cfg.stages:
            for target in stage.next:
                self.preds[target].append(stage.name)
        self.passed = {s.name: self._passed(cfg, s.name) for s in cfg.stages}

    def _passed(self, cfg: PipelineConfig, heard: str) -> frozenset[str]:
        """The stages certainly done with a request once ``heard`` sent something for it: those
        upstream of ``heard`` whose one output is a payload on a line to ``heard`` (one ``next``,
        no ``stream_to``) and that get no more input (the entry, or every predecessor done
        too). The largest such set: start from every ancestor and drop what breaks the rule."""
        ancestors: set[str] = set()
        todo = list(self.preds[heard])
        while todo:
            node = todo.pop()
            if node not in ancestors and node != heard:
                ancestors.add(node)
                todo.extend(self.preds[node])
        stages = {s.name: s for s in cfg.stages}
        done = set(ancestors)
        changed = True
        while changed:
            changed = False
            for name in list(done):
                s = stages[name]
                ok = (len(s.next) == 1 and not s.stream_to and (s.next[0] in done or s.next[0] == heard)
                      and (name == self.entry or (self.preds[name] and all(p in done for p in self.preds[name]))))
                if not ok:
                    done.discard(name)
                    changed = True
        return frozenset(done)

    def past(self, req: Request) -> set[str]:
        """The stages known to be done with ``req``: those that sent it a result (a stage's last
        word) and those on the line to a stage the caller heard from (a chunk or a result).
        Worked out only when a process dies: receiving costs nothing for it."""
        out = set(req.results)
        for stage in (*req.heard, *req.results):
            out.update(self.passed.get(stage, ()))
        return out

    def mark_dropped(self, req: Request, stage: str, targets: Iterable[str]) -> None:
        """Record that ``stage`` routed ``req`` away from ``targets`` and update ``req.dead``."""
        req.last_dropper = stage
        todo = []
        for target in targets:
            req.dropped.add((stage, target))
            todo.append(target)
        while todo:
            node = todo.pop()
            if node in req.dead or node == self.entry:
                continue
            preds = self.preds[node]
            if preds and all(p in req.dead or (p, node) in req.dropped for p in preds):
                req.dead.add(node)
                todo.extend(self.succ[node])
        req.expected -= req.dead


def unsent(exc: BaseException, entry: str, request_id: str) -> BaseException:
    """The error a request ends with when its inputs could not be sent to stage ``entry``: an
    omni error as it is, anything else as a ``StageError`` saying so."""
    if isinstance(exc, OmniError):
        return exc
    return StageError(f"cannot send the inputs: {exc}", stage=entry, request_id=request_id, error_type=type(exc).__name__)

"""The coordinator's table entries for requests in flight, and when a request is complete.

A request is complete when every terminal stage expected to answer has answered. Expected starts
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

    @property
    def complete(self) -> bool:
        return self.expected <= self.results.keys()

    def value(self) -> Any:
        if self.multi:
            return {name: self.results[name] for name in sorted(self.results)}
        return next(iter(self.results.values()))


class Graph:
    """The static ``next`` graph, for finding stages a request can no longer reach."""

    def __init__(self, cfg: PipelineConfig):
        self.entry = cfg.entry
        self.preds: dict[str, list[str]] = {s.name: [] for s in cfg.stages}
        self.succ: dict[str, list[str]] = {s.name: list(s.next) for s in cfg.stages}
        for stage in cfg.stages:
            for target in stage.next:
                self.preds[target].append(stage.name)

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

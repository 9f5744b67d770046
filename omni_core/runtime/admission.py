"""Who gets in: :class:`Admission`, the coordinator's checks of a new request.

A request is admitted only while the pipeline runs (during a restart it waits for it, bounded by
``limits.request_timeout``; a stopped pipeline refuses it with ``PipelineClosed``), while fewer
than ``limits.max_in_flight`` are in flight (else ``Overloaded``, at once), and with a request id
that is a string not in flight. :meth:`Admission.terminals` says which terminal stages answer it
(``terminal_stages_fn``, else all of them).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Container
from typing import Any

from ..config.schema import PipelineConfig
from ..errors import InvalidInput, Overloaded, PipelineClosed, StageError
from ..registry import Registry
from .lifecycle import Lifecycle
from .types import WiringError, chosen_names


class Admission:
    """The admission rules of one pipeline (``config``), reading its state from ``lifecycle``."""

    def __init__(self, config: PipelineConfig, registry: Registry, lifecycle: Lifecycle):
        self.config = config
        self.registry = registry
        self.lifecycle = lifecycle
        self._terminals = tuple(config.terminal_stages)
        self._terminal_fn: Callable[[Any], Any] | None = None

    def bind(self) -> None:
        """Resolve the pipeline's ``terminal_stages_fn`` (the run's plugins are loaded)."""
        if self.config.terminal_stages_fn:
            self._terminal_fn = self.registry.resolve("terminal_stages", self.config.terminal_stages_fn)

    async def check(self, request_id: str | None, in_flight: int, ids: Container[str]) -> None:
        """Raise why a new request cannot be admitted now (``in_flight`` requests are, with
        the request ids ``ids``); wait first while the pipeline restarts."""
        lifecycle, name, limits = self.lifecycle, self.config.name, self.config.limits
        if lifecycle.state == "restarting":
            await lifecycle.wait_running(limits.request_timeout)
        if lifecycle.state != "running":
            reason = f": {lifecycle.closed_reason}" if lifecycle.closed_reason else ""
            raise PipelineClosed(f"pipeline {name!r} is not running ({lifecycle.state}){reason}")
        if in_flight >= limits.max_in_flight:
            raise Overloaded(f"pipeline {name!r} has {in_flight} requests in flight (limits.max_in_flight); "
                             "retry later", request_id=request_id)
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in ids:
            raise ValueError(f"request id {request_id!r} is already in flight; ids can be reused once their request ended")

    def terminals(self, inputs: Any, request_id: str) -> set[str]:
        """The terminal stages that answer the request of ``inputs``."""
        if self._terminal_fn is None:
            return set(self._terminals)
        try:
            answer = self._terminal_fn(inputs)
        except Exception as exc:
            raise StageError(str(exc), stage="terminal_stages_fn", request_id=request_id, error_type=type(exc).__name__,
                             traceback="".join(traceback.format_exception(exc)),
                             invalid_input=isinstance(exc, InvalidInput),
                             field=exc.field if isinstance(exc, InvalidInput) else None) from None
        try:
            return set(chosen_names(answer, self._terminals, f"terminal_stages_fn {self.config.terminal_stages_fn!r}",
                                    none_is_all=True, empty_ok=False))
        except WiringError as exc:
            raise StageError(str(exc), stage="terminal_stages_fn", request_id=request_id,
                             error_type="WiringError") from None

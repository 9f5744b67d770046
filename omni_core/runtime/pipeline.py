"""The Python API of a running pipeline: :class:`Pipeline` and :func:`run`.

``Pipeline`` is a thin facade over the parts of the caller's process, each with one job, built
here and handed what they use: the :class:`~.endpoint.Endpoint` (sockets, edges, the receive
path), the :class:`~.lifecycle.Lifecycle` (the supervision state others read), the
:class:`~.coordinator.Coordinator` (admission, the request table, results, streams, aborts) and
the :class:`~.runner.Runner` (runtime dir, launch, readiness, the supervision state machine,
heartbeats, teardown).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from ..config import PipelineConfig, RetryConfig, load_config
from ..config.validate import stage_arg_check_issues
from ..errors import ConfigError
from ..logs import get_logger
from ..plan.topology import Plan, build_plan
from ..plugins import get_registry
from ..registry import Registry
from .coordinator import Coordinator
from .endpoint import Endpoint
from .launch import RUNTIME_DIR_PREFIX, Launch, sweep_stale_runtime_dirs
from .lifecycle import Lifecycle
from .reports import StateReports
from .requests import Event
from .runner import Runner

__all__ = ["RUNTIME_DIR_PREFIX", "Pipeline", "run", "sweep_stale_runtime_dirs"]


class Pipeline:
    """A running pipeline. Use ``async with Pipeline(config) as p:`` or ``start()``/``stop()``.

    ``config`` is anything :func:`omni_core.load_config` accepts. ``gpus`` simulates that many
    GPUs for placement (planning without devices). ``registry``: the plugin registry to resolve
    names with (default: the installed plugins')."""

    def __init__(self, config: str | os.PathLike | Mapping[str, Any] | PipelineConfig, *,
                 gpus: int | None = None, registry: Registry | None = None):
        self.config = load_config(config)
        self.gpus = gpus
        self.registry = registry if registry is not None else get_registry()
        self.log = get_logger(pipeline=self.config.name)
        self.plan: Plan | None = None
        self.lifecycle = Lifecycle(self.config.name)
        self.endpoint = Endpoint(self.config, self.registry, process="coordinator", origin="")
        self.coordinator = Coordinator(self.config, self.registry, self.endpoint, self.lifecycle)
        self.launch = Launch(self.config, self.registry)
        self.reports = StateReports(self.endpoint, self.lifecycle)
        self.runner = Runner(self.config, self.registry, self.endpoint, self.lifecycle, self.coordinator, self.launch)

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Pipeline:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start every process and wait until all are ready; ``StartupError`` otherwise (after
        cleaning up everything that was started)."""
        if self.lifecycle.state == "new":
            issues = stage_arg_check_issues(self.config, self.registry)  # before any process starts
            if issues:
                raise ConfigError(issues)
            self.plan = build_plan(self.config, self.registry, gpus=self.gpus)
            self.coordinator.bind(self.plan)
        assert self.plan is not None  # planned above, by this call or the first one
        await self.runner.start(self.plan)
        self.plan = self.launch.plan  # as launched: a multi-node launcher marks the edges that cross nodes

    async def stop(self, *, timeout: float | None = None) -> None:
        """Drain requests in flight, then shut every process down and free everything, all
        within ``timeout`` seconds (default ``limits.stop_timeout``). Idempotent."""
        await self.runner.stop(timeout)

    # -- state -----------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``new``, ``starting``, ``running``, ``restarting``, ``stopping`` or ``stopped``."""
        return self.lifecycle.state

    @property
    def running(self) -> bool:
        return self.lifecycle.state == "running"

    @property
    def run_id(self) -> str:
        return self.launch.run_id

    @property
    def runtime_dir(self) -> str | None:
        return self.launch.runtime_dir

    @property
    def addresses(self) -> dict[str, str]:
        """The control-plane address of every process (``""``: the coordinator)."""
        return self.endpoint.addresses

    @property
    def handles(self) -> dict:
        """Process name → the launcher's handle of every stage process."""
        return self.lifecycle.handles

    @property
    def requests(self) -> dict:
        """Requests in flight (rid → request)."""
        return self.coordinator.requests

    @property
    def by_id(self) -> dict[str, int]:
        return self.coordinator.by_id

    @property
    def restarts(self) -> int:
        """Process group restarts so far in this run."""
        return self.runner.restarts

    @property
    def retries(self) -> dict[str, int]:
        """Requests run again so far in this run (``retry``), by the error of the failed attempt."""
        return dict(self.coordinator.retries)

    def pids(self) -> dict[str, int | None]:
        """Process name → pid of every stage process."""
        return {name: h.pid for name, h in self.lifecycle.handles.items()}

    def process_states(self) -> dict[str, dict]:
        """Process name → ``{"state": ..., "restarts": n}`` (see ``Runner.process_states``)."""
        return self.runner.process_states()

    async def debug_state(self, timeout: float = 5.0) -> dict[str, dict[str, int]]:
        """How much per-request state each part holds: ``{"coordinator": {...}, process: {...}}``
        with the number of entries of every table (requests, ended ids, stream windows and
        buffers, fan-in parts, relay tables). All zero once no request is in flight."""
        out = {"coordinator": self.coordinator.state()}
        out.update(await self.reports.gather(timeout))
        return out

    # -- requests --------------------------------------------------------------------------------

    async def submit(self, inputs: Any, *, request_id: str | None = None, from_network: bool = False,
                     retry: RetryConfig | Mapping[str, Any] | int | None = None) -> Any:
        """Run one request and return its result (a dict of stage → result when several
        terminal stages answer). Raises ``StageError``, ``ProcessDied``, ``Overloaded``,
        ``RequestAborted``, ``RequestTimeout``. ``from_network``: the request came over the
        network (a server sets it): stages see ``ctx.from_network`` and refuse server paths in
        it unless ``serve.allow_local_files`` allows them (:mod:`omni_core.files`). ``retry``: this
        request's own retry policy instead of the pipeline's ``retry`` (a number of attempts, or
        ``{"attempts": N, "on": ["ProcessDied", "ProcessHung"]}``): an attempt that failed because
        its process died or hung runs again, with the same request id and inputs, once the
        process group is back; the caller sees one result."""
        return await self.coordinator.submit(inputs, request_id=request_id, from_network=from_network, retry=retry)

    def stream(self, inputs: Any, *, request_id: str | None = None, from_network: bool = False,
               retry: RetryConfig | Mapping[str, Any] | int | None = None) -> AsyncGenerator[Event, None]:
        """Run one request and yield ``Event``s: the chunks terminal stages emit, in order, as
        the caller reads them (a terminal stage waits while ``limits.stream_buffer`` chunks are
        unread), then the result (``event.is_result``). Leaving the loop early aborts it.
        ``from_network``, ``retry``: as for :meth:`submit`; a stream is retried only before its
        first chunk reached the caller (a chunk is never repeated or reordered)."""
        return self.coordinator.stream(inputs, request_id=request_id, from_network=from_network, retry=retry)

    async def abort(self, request_id: str) -> bool:
        """Abort a request in flight: every stage holding it is cancelled and its relay resources
        are freed. Returns False if no such request is in flight."""
        return self.coordinator.abort(request_id)


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

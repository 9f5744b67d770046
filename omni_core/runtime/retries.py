"""Running a request again after its process died or hung (``retry``).

:func:`retry_config` reads a request's own policy (``submit(..., retry=N)``); :class:`Retries`
decides whether a failed attempt runs again, counts the retries by error, and sends each new
attempt once its process group is back. Ending the failed attempt in the request table is the
coordinator's (:meth:`~.coordinator.Coordinator.fail_where`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..config.schema import RETRYABLE_ERRORS, PipelineConfig, RetryConfig
from .lifecycle import Lifecycle
from .requests import Request, unsent


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


class Retries:
    """The retries of one pipeline's requests: ``requests`` is the coordinator's table (read
    only), ``send(req)`` sends a request's inputs again, ``finish(req, error=...)`` ends it."""

    def __init__(self, config: PipelineConfig, lifecycle: Lifecycle, requests: Mapping[int, Request], log: Any,
                 send: Callable[[Request], Awaitable[None]], finish: Callable[..., None]):
        self.config = config
        self.lifecycle = lifecycle
        self.requests = requests
        self.log = log
        self._send = send
        self._finish = finish
        #: requests run again after a process death, by the error of the failed attempt
        self.counts: dict[str, int] = {}
        self._resends: set[asyncio.Task] = set()  # retried attempts waiting to be sent

    def allows(self, req: Request, exc: BaseException) -> bool:
        """Whether ``req`` runs again after ``exc``: its policy allows another attempt after
        this error, the pipeline restarts its processes, and (a stream) no chunk reached the
        caller yet: a stream is retried only before its first chunk."""
        return (req.attempt < req.attempts and type(exc).__name__ in req.retry_on
                and self.config.restart.policy == "on-failure"
                and not (req.events is not None and req.heard))

    def started(self, req: Request, exc: BaseException) -> None:
        """``req``'s next attempt (its new rid already in the table) is sent once the pipeline
        runs again."""
        name = type(exc).__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        self.log.warning("request retried", request_id=req.request_id, error=name, attempt=req.attempt,
                         attempts=req.attempts, process=getattr(exc, "process", None))
        task = asyncio.get_running_loop().create_task(self._resend(req, req.rid, exc))
        self._resends.add(task)
        task.add_done_callback(self._resends.discard)

    async def _resend(self, req: Request, rid: int, exc: BaseException) -> None:
        """Send the retried attempt ``rid`` of ``req`` once its process group is back (the
        first error stands when the pipeline stops instead)."""
        await self.lifecycle.wait_running(self.config.limits.request_timeout)
        if self.requests.get(rid) is not req:
            return  # ended meanwhile (aborted, timed out, failed again, the pipeline stopped)
        if self.lifecycle.state != "running":
            self._finish(req, error=exc)
            return
        try:
            await self._send(req)
        except Exception as send_exc:
            if self.requests.get(rid) is req:
                self._finish(req, error=unsent(send_exc, self.config.entry, req.request_id))

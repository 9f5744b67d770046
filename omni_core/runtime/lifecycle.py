"""What supervision publishes to the rest of the caller's process: :class:`Lifecycle`.

The runner alone changes it (the pipeline's state, why it closed, the handle of every stage
process); the coordinator reads it to admit requests (wait while a group restarts, refuse once
stopping) and to tell only live processes that a request ended; the ``Pipeline`` facade reads it
for its properties. Neither part holds the other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any, Protocol

from ..contracts import ProcessHandle
from ..logs import get_logger


class Poster(Protocol):
    """Where :meth:`Lifecycle.tell` posts (the caller's endpoint)."""

    def post_all(self, names: Iterable[str], msg: Any) -> None: ...


#: The pipeline's states, in the order a run goes through them (``running ⇄ restarting``).
STATES = ("new", "starting", "running", "restarting", "stopping", "stopped")


class Lifecycle:
    """The supervision state of one pipeline (see the module docstring)."""

    def __init__(self, pipeline: str):
        self.pipeline = pipeline
        self.log = get_logger(pipeline=pipeline)
        self.state = "new"
        self.closed_reason: BaseException | None = None
        #: Process name → the launcher's handle of its current generation.
        self.handles: dict[str, ProcessHandle] = {}
        self._changed: asyncio.Event | None = None

    def set(self, state: str) -> None:
        """Enter ``state`` (the runner's transitions)."""
        if state not in STATES:
            raise ValueError(f"unknown pipeline state {state!r}")
        if state != self.state:
            self.log.debug("pipeline state", state=state, was=self.state)
        self.state = state
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_running(self, timeout: float | None) -> None:
        """Wait while a restart is under way: until the pipeline is running again or stopping,
        at most ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            while self.state == "restarting":
                if self._changed is None:
                    self._changed = asyncio.Event()
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    return
                await asyncio.wait_for(self._changed.wait(), left)

    def live(self, name: str) -> bool:
        """Whether process ``name``'s current generation is running (not exited)."""
        handle = self.handles.get(name)
        return handle is not None and handle.exitcode is None

    def live_of(self, names: Iterable[str] | None = None) -> list[str]:
        """The live processes among ``names`` (default: every process)."""
        return [n for n in (self.handles if names is None else names) if self.live(n)]

    def tell(self, endpoint: Poster, msg: Any, names: Iterable[str] | None = None) -> None:
        """Post ``msg`` through ``endpoint`` to the live processes among ``names`` (default:
        all): how the runner and the coordinator talk to the processes."""
        endpoint.post_all(self.live_of(names), msg)

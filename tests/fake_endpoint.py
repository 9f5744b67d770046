"""An in-process stand-in for :class:`omni_core.runtime.endpoint.Endpoint`, for tests of the
runtime's parts (Host, Coordinator, Router, Runner) without sockets or other processes.

It records what its owner sends (``sent``: ``(to, message, frames)`` in order) and lets a test
play the other processes: :meth:`FakeEndpoint.receive` hands a message to the handler the owner
registered, a ``wire.Data`` through the same receive path as the real endpoint's (relay get,
per-request order, decode, the owner's ``DataReceiver``), since that path is the real one: the
fake subclasses the endpoint and only replaces its sockets.
"""

from __future__ import annotations

import asyncio
import functools
import gc
from collections.abc import Iterable, Mapping
from typing import Any

import pytest

from omni_core.relay.inline import inline_transfer
from omni_core.relay.payload import pack
from omni_core.runtime import wire
from omni_core.runtime.endpoint import Endpoint
from omni_core.runtime.types import CALLER_RELAY


class FakeEndpoint(Endpoint):
    """An :class:`Endpoint` whose outbox is a list and whose inbox is :meth:`receive`."""

    def __init__(self, config: Any, registry: Any, *, process: str = "coordinator", origin: str = ""):
        super().__init__(config, registry, process=process, origin=origin)
        self.outbox.close(linger_ms=0)  # no sockets: what is sent is recorded
        self.sent: list[tuple[str, Any, list]] = []
        self.listening = False
        self.closed = False

    # -- set-up -------------------------------------------------------------------------------

    def open(self, *, run_id: str = "test-run", runtime_dir: str = "/nonexistent",
             addresses: Mapping[str, str] | None = None, stages: tuple[str, ...] = (), secret: bytes = b"") -> None:
        super().open(run_id=run_id, runtime_dir=runtime_dir, addresses=addresses or {}, stages=stages, secret=secret)

    def listen(self) -> None:
        self.listening = True

    # -- out: recorded --------------------------------------------------------------------------

    def post(self, to: str, msg: Any, frames: Any = ()) -> None:
        self.sent.append((to, msg, list(frames)))

    async def send(self, to: str, msg: Any, frames: Any = ()) -> None:
        self.post(to, msg, frames)

    def post_all(self, names: Iterable[str], msg: Any) -> None:
        for name in names:
            self.post(name, msg)

    def flush(self) -> None:
        pass

    async def send_data(self, to: str, kind: str, rid: int, request_id: str, stage: str, src: str,
                        relay: str, skeleton: bytes, tensors: list, trace: str = "", from_network: bool = False) -> None:
        if tensors:
            relay, handle, frames = await self.edges.put(relay, rid, tensors, to or "coordinator")
            self.post(to, wire.Data(kind, rid, request_id, stage, src, skeleton, relay, handle, len(frames),
                                    self.origin, trace, from_network), frames)
        else:
            self.post(to, wire.Data(kind, rid, request_id, stage, src, skeleton, origin=self.origin, trace=trace,
                                    from_network=from_network))

    # -- in: played by the test ------------------------------------------------------------------

    def receive(self, msg: Any, frames: list | None = None) -> None:
        """Deliver ``msg`` (with its ``frames``) as the inbox would."""
        self._dispatch(msg, [_Frame(f) for f in frames or []])

    def receive_data(self, kind: str, rid: int, stage: str, payload: Any, *, src: str = "", origin: str = "",
                     request_id: str | None = None) -> None:
        """Deliver a payload as a peer would send it (its tensors through ``inline``)."""
        skeleton, tensors = pack(payload)
        request_id = request_id or f"req-{rid}"
        if not tensors:
            self.receive(wire.Data(kind, rid, request_id, stage, src, skeleton, origin=origin))
            return
        transfer = inline_transfer(tensors)
        self.receive(wire.Data(kind, rid, request_id, stage, src, skeleton, CALLER_RELAY, transfer.handle,
                               len(transfer.frames), origin), list(transfer.frames))

    # -- what was sent -----------------------------------------------------------------------------

    def of_type(self, kind: type, to: str | None = None) -> list[Any]:
        """The messages of type ``kind`` sent so far (to ``to`` only, when given)."""
        return [m for t, m, _ in self.sent if type(m) is kind and (to is None or t == to)]

    def close(self, linger_ms: int = 0) -> None:
        self.closed = True
        super().close(linger_ms=0)


class _Frame:
    """What the inbox hands on: an object with ``.buffer``."""

    __slots__ = ("buffer",)

    def __init__(self, data: Any):
        self.buffer = memoryview(data) if not isinstance(data, memoryview) else data


# -- running the parts' coroutines in tests -----------------------------------------------------


def aio(fn):
    """Run an async test in a fresh event loop, within a few seconds; an error the loop reports
    (an exception nobody retrieved, a callback that raised) fails it."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        reports: list[str] = []

        async def main():
            loop = asyncio.get_running_loop()
            loop.set_exception_handler(lambda _, ctx: reports.append(f"{ctx['message']}: {ctx.get('exception')!r}"))
            await asyncio.wait_for(fn(*args, **kwargs), 10)
            gc.collect()

        asyncio.run(main())
        assert reports == []

    return wrapper


async def until(predicate, what: str, deadline_s: float = 5.0, poll_s: float = 0.0) -> None:
    """Let the loop turn (every ``poll_s``: something outside the loop, a thread, must act) until
    ``predicate`` holds; fail naming ``what`` at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while not predicate():
        if loop.time() > deadline:
            pytest.fail(f"not within {deadline_s:g} s: {what}")
        await asyncio.sleep(poll_s)


async def turns(n: int = 5) -> None:
    """Let the loop turn ``n`` times (what the parts scheduled runs)."""
    for _ in range(n):
        await asyncio.sleep(0)

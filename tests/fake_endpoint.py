"""An in-process :class:`omni_core.runtime.endpoint.Endpoint`, for tests of the runtime's parts
(Host, Coordinator, Router, Runner) without sockets or other processes.

Only the transport is swapped (:class:`RecordingTransport`): every Endpoint method runs for real
(send_data's relay put and envelope, the receive path: relay get, per-request order, decode, the
owner's ``DataReceiver``). What the owner sends is recorded in ``sent`` (``(to, message,
frames)`` in order, ``to`` the process name); :meth:`FakeEndpoint.receive` plays the other
processes, handing a message to the inbox handler the endpoint registered.
"""

from __future__ import annotations

import asyncio
import functools
import gc
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from omni_core.relay.inline import inline_transfer
from omni_core.relay.payload import pack
from omni_core.runtime import wire
from omni_core.runtime.endpoint import Endpoint
from omni_core.runtime.types import INLINE_RELAY
from omni_core.testing import waiting


class RecordingTransport:
    """A :class:`omni_core.runtime.channel.Transport` whose outbox is a list (``sent``, by
    process name: ``names`` maps an address to it) and whose inbox the test plays (``handler``:
    what the endpoint listens with)."""

    def __init__(self) -> None:
        self.secret = b""
        self.sent: list[tuple[str, Any, list]] = []
        self.names: Callable[[], dict[str, str]] = dict
        self.handler: Callable[[Any, list], None] | None = None
        self.listening = False
        self.closed = False
        #: Called with ``(to, message)`` after each message is recorded (a test's peers answer).
        self.on_post: Callable[[str, Any], None] | None = None

    def post(self, address: str, msg: Any, frames: Sequence[Any] = ()) -> None:
        to = self.names().get(address, address)
        self.sent.append((to, msg, list(frames)))
        if self.on_post is not None:
            self.on_post(to, msg)

    async def send(self, address: str, msg: Any, frames: Sequence[Any] = ()) -> None:
        self.post(address, msg, frames)

    def flush(self) -> None:
        pass

    def listen(self, address: str, handler: Callable[[Any, list], None], *, name: str, secret: bytes) -> None:
        self.handler = handler
        self.listening = True

    def close_inbox(self) -> None:
        self.listening = False

    def close(self, linger_ms: int = 2000) -> None:
        self.listening = False
        self.closed = True


class FakeEndpoint(Endpoint):
    """An :class:`Endpoint` over a :class:`RecordingTransport`, with a test's hands on it."""

    def __init__(self, config: Any, registry: Any, *, process: str = "coordinator", origin: str = ""):
        self.recorder = RecordingTransport()
        super().__init__(config, registry, process=process, origin=origin, transport=self.recorder)
        self.recorder.names = self._names
        self._by_address: tuple[dict, dict[str, str]] = ({}, {})

    def _names(self) -> dict[str, str]:
        addresses, names = self._by_address
        if addresses is not self.addresses:
            names = {address: name for name, address in self.addresses.items()}
            self._by_address = (self.addresses, names)
        return names

    def open(self, *, run_id: str = "test-run", runtime_dir: str = "/nonexistent",
             addresses: Mapping[str, str] | None = None, stages: tuple[str, ...] = (), secret: bytes = b"") -> None:
        """:meth:`Endpoint.open` with a test's defaults."""
        super().open(run_id=run_id, runtime_dir=runtime_dir, addresses=addresses or {}, stages=stages, secret=secret)

    @property
    def sent(self) -> list[tuple[str, Any, list]]:
        """What was sent so far: ``(to, message, frames)`` in order."""
        return self.recorder.sent

    @property
    def listening(self) -> bool:
        return self.recorder.listening

    @property
    def closed(self) -> bool:
        return self.recorder.closed

    # -- in: played by the test ------------------------------------------------------------------

    def receive(self, msg: Any, frames: list | None = None) -> None:
        """Deliver ``msg`` (with its ``frames``) as the inbox would: to the handler the endpoint
        listens with."""
        if self.recorder.handler is None:  # a rig that never started the inbox: listen as a process does
            self.listen()
        self.recorder.handler(msg, [_Frame(f) for f in frames or []])

    def receive_data(self, kind: str, rid: int, stage: str, payload: Any, *, src: str = "", origin: str = "",
                     request_id: str | None = None) -> None:
        """Deliver a payload as a peer would send it (its tensors through ``inline``)."""
        skeleton, tensors = pack(payload)
        request_id = request_id or f"req-{rid}"
        if not tensors:
            self.receive(wire.Data(kind, rid, request_id, stage, src, skeleton, origin=origin))
            return
        transfer = inline_transfer(tensors)
        self.receive(wire.Data(kind, rid, request_id, stage, src, skeleton, INLINE_RELAY, transfer.handle,
                               len(transfer.frames), origin), list(transfer.frames))

    # -- what was sent -----------------------------------------------------------------------------

    def of_type(self, kind: type, to: str | None = None) -> list[Any]:
        """The messages of type ``kind`` sent so far (to ``to`` only, when given)."""
        return [m for t, m, _ in self.sent if type(m) is kind and (to is None or t == to)]


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
    """:func:`omni_core.testing.waiting.until`, letting the loop turn by default (every ``poll_s``
    when something outside the loop, a thread, must act)."""
    await waiting.until(predicate, what, deadline_s, poll_s)

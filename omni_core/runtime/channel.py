"""zmq plumbing for the control plane: one PULL inbox per process, PUSH outboxes per peer.

The inbox is read from the asyncio loop without a future per message: the socket's FD is watched
with ``loop.add_reader`` and every message that is ready is drained and handed to a synchronous
callback (batching what is ready, §9). Sends are non-blocking; if a peer's queue is full the send
waits for room, so memory stays bounded. Messages posted while other callbacks of the same loop
turn are still ready leave together at the end of the turn: a burst of sends wakes the zmq I/O
thread once rather than once per message (on a machine with few cores each wake-up is a context
switch that costs more than the message).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from ..logs import get_logger
from . import wire

log = get_logger()

Handler = Callable[[wire.Message, list[zmq.Frame]], None]


def _new_context() -> zmq.Context:
    return zmq.Context(io_threads=1)


class Inbox:
    """A bound PULL socket whose messages are delivered to ``handler(message, frames)`` on the
    event loop. Malformed messages are logged and dropped; an exception in the handler is logged
    and never stops the inbox."""

    def __init__(self, ctx: zmq.Context, address: str, handler: Handler, *, name: str = ""):
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.bind(address)
        self.address = address
        self.handler = handler
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.getsockopt(zmq.FD), self._drain)
        # Messages may already be queued: an edge-triggered FD would not wake us for them.
        self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        sock = self.sock
        handled = 0
        while True:
            try:
                # Ending a drain on zmq.Again costs about four EVENTS checks: ask first while
                # the drain is short (one request in flight), read until Again when it is long.
                if 0 < handled < 4 and not sock.get(zmq.EVENTS) & zmq.POLLIN:
                    return
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed underneath us during shutdown
                return
            handled += 1
            try:
                msg = wire.decode(frames[0].buffer)
            except Exception as exc:
                log.warning("dropped a malformed control message", inbox=self.name, error=str(exc))
                continue
            try:
                self.handler(msg, frames[1:])
            except Exception:
                log.exception("control message handler failed", inbox=self.name, message=type(msg).__name__)

    def close(self) -> None:
        if self._loop is not None and not self.sock.closed:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.sock.getsockopt(zmq.FD))
        self.sock.close(linger=0)


class Outbox:
    """PUSH sockets to peers, connected on first use, keyed by address.

    Messages to one address leave in the order they were posted. When a peer's queue is full,
    later messages wait in a per-address backlog that a flusher task drains; ``send`` awaits its
    message leaving (back-pressure), ``post`` does not (for synchronous callers)."""

    def __init__(self, ctx: zmq.Context):
        self.ctx = ctx
        self._socks: dict[str, zmq.Socket] = {}
        self._backlog: dict[str, deque] = {}
        self._flushers: dict[str, asyncio.Task] = {}
        self._pending: dict[str, list] = {}  # posted this loop turn, sent at its end
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: deque | None = None

    def _sock(self, address: str) -> zmq.Socket:
        sock = self._socks.get(address)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            sock.connect(address)
            self._socks[address] = sock
        return sock

    def _try(self, sock: zmq.Socket, msg: Any, frames: Sequence[Any]) -> bool:
        try:
            if frames:
                sock.send_multipart([wire.encode(msg), *frames], zmq.NOBLOCK, copy=False)
            else:
                sock.send(wire.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _bind_loop(self) -> asyncio.AbstractEventLoop | None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop running (a synchronous caller): send at once
            self._loop = self._ready = None
            return None
        if loop is not self._loop:
            self._loop = loop
            # The loop's queue of ready callbacks (asyncio's own loop); None elsewhere (uvloop):
            # then every post waits for the end of the turn.
            ready = getattr(loop, "_ready", None)
            self._ready = ready if isinstance(ready, deque) else None
        return loop

    def post(self, address: str, msg: Any, frames: Sequence[Any] = ()) -> asyncio.Future | None:
        """Send now if possible, else queue behind earlier messages to the same address.

        While other callbacks of this loop turn are ready (more messages are likely to follow),
        the message waits for the end of the turn and leaves with the others. Returns None when
        sent or waiting for the turn's end, or a future that completes when a message queued
        because the peer was full leaves."""
        backlog = self._backlog.get(address)
        if not backlog:
            pending = self._pending
            if pending:
                queued = pending.get(address)
                if queued is None:
                    pending[address] = [(msg, frames)]
                else:
                    queued.append((msg, frames))
                return None
            loop = self._bind_loop()
            if loop is not None and (self._ready is None or self._ready):
                pending[address] = [(msg, frames)]
                loop.call_soon(self._send_pending)
                return None
            if self._try(self._sock(address), msg, frames):
                return None
        return self._queue(address, msg, frames)

    def _send_pending(self) -> None:
        """Send what was posted during the last loop turn, a burst per peer, order kept."""
        pending, self._pending = self._pending, {}
        for address, messages in pending.items():
            sock = self._sock(address)
            for i, (msg, frames) in enumerate(messages):
                if self._backlog.get(address) or not self._try(sock, msg, frames):
                    for later_msg, later_frames in messages[i:]:
                        self._queue(address, later_msg, later_frames)
                    break

    def _queue(self, address: str, msg: Any, frames: Sequence[Any]) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._backlog.setdefault(address, deque()).append((msg, frames, fut))
        if address not in self._flushers:
            self._flushers[address] = asyncio.get_running_loop().create_task(self._flush(address))
        return fut

    async def send(self, address: str, msg: Any, frames: Sequence[Any] = ()) -> None:
        """Send, waiting while the peer's queue is full (order kept)."""
        fut = self.post(address, msg, frames)
        if fut is not None:
            await fut

    async def _flush(self, address: str) -> None:
        backlog = self._backlog[address]
        sock = self._sock(address)
        delay = 0.0002
        try:
            while backlog:
                msg, frames, fut = backlog[0]
                if self._try(sock, msg, frames):
                    backlog.popleft()
                    if not fut.done():
                        fut.set_result(None)
                    delay = 0.0002
                else:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.05)
        finally:
            self._flushers.pop(address, None)

    def close(self, linger_ms: int = 2000) -> None:
        if self._pending:
            pending, self._pending = self._pending, {}
            for address, messages in pending.items():
                with contextlib.suppress(zmq.ZMQError):
                    for msg, frames in messages:
                        if not self._try(self._sock(address), msg, frames):
                            break
        for task in self._flushers.values():
            task.cancel()
        for backlog in self._backlog.values():
            for _, _, fut in backlog:
                if not fut.done():
                    fut.cancel()
        for sock in self._socks.values():
            sock.close(linger=linger_ms)
        self._socks.clear()

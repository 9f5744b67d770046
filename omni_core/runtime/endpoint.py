"""One process's end of the control plane: :class:`Endpoint`.

Every process of a running pipeline has one endpoint, the caller's process (the coordinator's)
included. It owns what every process needs to talk to the others, written once:

- the transport: the process's inbox and its outbox (:class:`.channel.Transport`; zmq sockets
  unless another is handed in, as in-process tests do), peers named by process name (``""``:
  the coordinator);
- the edges (:class:`~.edges.Edges`): relay instances, tensors out (``send_data``: the
  ``wire.Data`` message is the envelope) and in;
- the receive path of data messages: relay ``get`` → per-request order (:mod:`.ordered`) →
  small chunks copied out of relay memory → ``unpack``, then the owner's
  :class:`DataReceiver`;
- dispatch of every other message by its type to the handler its owner registered with
  :meth:`Endpoint.on`.

The owner (:class:`~.host.Host` in a stage process; :class:`~.runner.Runner` and
:class:`~.coordinator.Coordinator` in the caller's) receives the endpoint when it is built and
registers its handlers there; the endpoint knows nothing of stages, requests or supervision.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from ..config.schema import PipelineConfig
from ..logs import get_logger
from ..registry import Registry
from ..relay.payload import unpack
from . import wire
from .channel import Transport, ZmqTransport
from .edges import Edges
from .ordered import OrderedDelivery
from .types import Inbound

__all__ = ["DataReceiver", "Endpoint"]


class DataReceiver(Protocol):
    """What an endpoint's owner does with data messages (``wire.Data``)."""

    def accept(self, msg: wire.Data) -> bool:
        """On arrival, before anything is fetched: False drops the message (its request ended
        here, or the owner's own checks failed it and the owner has failed its request)."""

    def wanted(self, rid: int) -> bool:
        """Whether request ``rid`` is still live here once a message's tensors are in (a relay
        ``get`` may wait); if not, the message is dropped and its relay memory released."""

    def deliver(self, msg: wire.Data, payload: Any, inbound: Inbound | None) -> None:
        """The decoded payload, in the order the sender sent its messages for the request;
        ``inbound``: what to release once the receiver is done with it (None: nothing)."""

    def reject(self, msg: wire.Data, exc: BaseException) -> None:
        """The message cannot be used (bad frames, a relay ``get`` that failed, a payload that
        does not decode): fail its request."""


class Endpoint:
    """The sockets, edges and receive path of one process (see the module docstring).

    ``process`` names the process in relay contexts and metrics (``"coordinator"`` for the
    caller's); ``origin`` is its name on the wire (``""`` for the coordinator); ``transport``:
    what messages travel through (a :class:`~.channel.ZmqTransport` of its own by default)."""

    #: The relay instances and tensors of this process's edges (made by :meth:`open`).
    edges: Edges

    def __init__(self, config: PipelineConfig, registry: Registry, *, process: str, origin: str,
                 transport: Transport | None = None):
        self.config = config
        self.registry = registry
        self.process = process
        self.origin = origin
        self.log = get_logger(pipeline=config.name, process=process)
        self.allow_pickle = config.allow_pickle
        self.ordered = OrderedDelivery()
        self.addresses: dict[str, str] = {}
        self.transport: Transport = ZmqTransport() if transport is None else transport
        self._listening = False
        self._opened = False
        self._handlers: dict[type, Callable[[Any], None]] = {}
        self._receiver: DataReceiver | None = None
        self.secret = b""

    # -- set-up -----------------------------------------------------------------------------------

    def on(self, kind: type, handler: Callable[[Any], None]) -> None:
        """Messages of type ``kind`` go to ``handler(message)``."""
        if kind is wire.Data:
            raise TypeError("data messages go to the endpoint's DataReceiver (on_data)")
        self._handlers[kind] = handler

    def on_data(self, receiver: DataReceiver) -> None:
        self._receiver = receiver

    def open(self, *, run_id: str, runtime_dir: str, addresses: Mapping[str, str],
             stages: tuple[str, ...] = (), secret: bytes = b"") -> None:
        """Make the edges for a run: ``addresses`` maps every process name (``""``: the
        coordinator) to its inbox address as this process reaches it. ``secret``: the run's,
        which every message sent carries a MAC of and every message received must
        (:mod:`.wire`; b"": none, for in-process tests)."""
        self.addresses = dict(addresses)
        self.secret = self.transport.secret = secret
        self._opened = True
        self.edges = Edges(config=self.config, registry=self.registry, run_id=run_id, process=self.process,
                           runtime_dir=runtime_dir, stages=stages)

    def listen(self) -> None:
        """Bind this process's inbox and start reading it (in the running event loop)."""
        assert self._opened, "open() first"
        self.transport.listen(self.addresses[self.origin], self._dispatch, name=self.process or "coordinator",
                              secret=self.secret)
        self._listening = True

    # -- out ----------------------------------------------------------------------------------------

    def post(self, to: str, msg: Any, frames: Any = ()) -> Any:
        """Send ``msg`` to process ``to`` without waiting (see :meth:`.Outbox.post`)."""
        return self.transport.post(self.addresses[to], msg, frames)

    async def send(self, to: str, msg: Any, frames: Any = ()) -> None:
        """Send ``msg`` to process ``to``, waiting while its queue is full."""
        await self.transport.send(self.addresses[to], msg, frames)

    def post_all(self, names: Iterable[str], msg: Any) -> None:
        for name in names:
            self.transport.post(self.addresses[name], msg)

    def flush(self) -> None:
        """What waits for the end of the loop turn or of an inbox drain leaves now."""
        self.transport.flush()

    async def send_data(self, to: str, msg: wire.Data, tensors: list, relay: str) -> None:
        """Send a packed payload to process ``to``: ``msg`` is its envelope (kind, request,
        stage, sender, skeleton, trace; the endpoint fills in ``origin`` and, with ``tensors``,
        where they are), the tensors go through the edge's ``relay`` before it; waits while
        the peer's queue is full."""
        address = self.addresses[to]
        msg.origin = self.origin
        if tensors:
            msg.relay, msg.handle, frames = await self.edges.put(relay, msg.rid, tensors, to or "coordinator")
            msg.nframes = len(frames)
            await self.transport.send(address, msg, frames)
        else:
            fut = self.transport.post(address, msg)
            if fut is not None:
                await fut

    # -- in -----------------------------------------------------------------------------------------

    def in_order(self, rid: int, step: Callable[[], None]) -> None:
        """Run ``step`` after what request ``rid`` still has on its way in (at once if nothing)."""
        self.ordered.run(rid, step)

    def forget(self, rid: int) -> None:
        """Request ``rid`` ended here: drop what of it is still on its way in."""
        self.ordered.drop(rid)

    def _dispatch(self, msg: wire.Message, frames: list) -> None:
        """The inbox's handler: every message of this process comes through here."""
        if type(msg) is not wire.Data:
            handler = self._handlers.get(type(msg))
            if handler is None:
                self.log.warning("dropped an unexpected control message", message=type(msg).__name__)
            else:
                handler(msg)
            return
        receiver = self._receiver
        if receiver is None:
            self.log.warning("dropped a data message: nothing receives data here", stage=msg.stage)
            return
        try:
            if not receiver.accept(msg):
                if msg.relay and self._opened:  # dropped unread: its relay memory is freed all the same
                    self.edges.discard(msg.relay, msg.handle)
                return
            if msg.nframes != len(frames):
                receiver.reject(msg, ValueError(
                    f"a message for stage {msg.stage!r} announced {msg.nframes} frames and carried {len(frames)}"))
                return
            rid = msg.rid
            if msg.relay:
                self.ordered.start(rid, lambda: self._receive(msg, frames))
            elif self.ordered.busy(rid):  # behind a message of the request still being fetched
                self.ordered.run(rid, lambda: self._decoded(msg, [], Inbound()))
            else:  # accepted just now: decoded at once
                self._decoded(msg, [], Inbound(), checked=True)
        except Exception as exc:
            self._broken(receiver, msg, exc)

    def _broken(self, receiver: DataReceiver, msg: wire.Data, exc: Exception) -> None:
        """Handling a data message raised (a bug): its request fails rather than wait forever."""
        self.log.exception("data message handling failed", stage=msg.stage)
        with contextlib.suppress(Exception):
            receiver.reject(msg, exc)

    async def _receive(self, msg: wire.Data, frames: list) -> None:
        try:
            tensors, inbound = await self.edges.get(msg.relay, msg.handle, [f.buffer for f in frames])
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: B902 - a bad handle fails this request only
            receiver = self._receiver
            assert receiver is not None  # only data a receiver wanted gets here
            receiver.reject(msg, exc)
            return
        self._decoded(msg, tensors, inbound)

    def _decoded(self, msg: wire.Data, tensors: list, inbound: Inbound, checked: bool = False) -> None:
        receiver = self._receiver
        assert receiver is not None  # only data a receiver accepted gets here
        if not checked and not receiver.wanted(msg.rid):
            inbound.release()
            return
        held: Inbound | None = inbound
        if msg.kind == "chunk" and tensors:
            held = Edges.detach_chunk(tensors, inbound)  # small chunks: copied, released
        try:
            payload = unpack(msg.skeleton, tensors, allow_pickle=self.allow_pickle)
        except Exception as exc:
            if held is not None:
                held.release()
            receiver.reject(msg, exc)
            return
        try:
            receiver.deliver(msg, payload, held)
        except Exception as exc:
            self._broken(receiver, msg, exc)

    # -- end ----------------------------------------------------------------------------------------

    def state(self) -> dict[str, int]:
        out = {"ordered": len(self.ordered)}
        if self._opened:
            out.update(self.edges.state())
        for dropped in ("refused", "malformed"):  # what the inbox dropped, once it dropped any
            count = getattr(self.transport, dropped, 0)
            if count:
                out[f"inbox.{dropped}"] = count
        return out

    def close_inbox(self) -> None:
        """Stop receiving (what is on its way in is dropped)."""
        self.ordered.close()
        if self._listening:
            self.transport.close_inbox()
            self._listening = False

    def close(self, linger_ms: int = 1000) -> None:
        """Close the inbox, the edges' relays and the transport (waiting up to ``linger_ms`` for
        what its outbox still holds to leave)."""
        self.close_inbox()
        if self._opened:
            self.edges.close()
        self.transport.close(linger_ms=linger_ms)

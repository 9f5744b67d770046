"""zmq plumbing for the control plane: one PULL inbox per process, PUSH outboxes per peer.

Endpoints are ipc within one machine. A launcher that spans machines binds tcp inboxes ahead of
time with :func:`bind_inbox` (a port chosen by binding, so no race) and every tcp socket is
authenticated and encrypted with CurveZMQ under the run's :class:`CurveKeys` (see "tcp endpoints"
below).

The inbox is read from the asyncio loop without a future per message: the socket's FD is watched
with ``loop.add_reader`` and every message that is ready is drained and handed to a synchronous
callback (batching what is ready, docs/performance.md). Sends are non-blocking; if a peer's queue is full the send
waits for room, so memory stays bounded. Messages posted while other callbacks of the same loop
turn are still ready leave together at the end of the turn: a burst of sends wakes the zmq I/O
thread once rather than once per message (on a machine with few cores each wake-up is a context
switch that costs more than the message).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import zmq

from .._compat import ready_queue
from ..logs import get_logger
from . import wire

log = get_logger()

Handler = Callable[[wire.Message, list[zmq.Frame]], None]

#: At most this many messages travel in one batch.
_BATCH = 256
# Plain ints: the flag enums cost a constructor call per use on the hot path.
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
# Posts held for the end of a turn or an inbox drain leave early after the 16th, 32nd, 64th, then
# every 32nd: the next process starts on the first ones while the rest are made. Held to the end,
# the requests of a long drain travel through a pipeline as one convoy, one process busy at a
# time (measured: 1.0 core busy of 2 at 64 in flight; 1.6 and 1.5 x the rate with this schedule).
_FIRST_FLUSH, _FLUSH_STEP = 16, 32
# pyzmq's compiled send, called without its Python layer (Socket.send's routing_id and group
# handling): measured 0.6-0.7 µs a small send instead of 1.2-1.6 µs. (recv gains nothing so.)
_send = zmq.backend.Socket.send


def _new_context() -> zmq.Context:
    return zmq.Context(io_threads=1)


class Inbox:
    """A bound PULL socket whose messages are delivered to ``handler(message, frames)`` on the
    event loop. Malformed messages are logged and dropped; an exception in the handler is logged
    and never stops the inbox."""

    def __init__(self, ctx: zmq.Context, address: str, handler: Handler, *, name: str = "",
                 outbox: Outbox | None = None, secret: bytes = b""):
        sock = adopt_inbox(address)
        if sock is None:
            if address.startswith("tcp://"):
                raise ValueError(f"tcp endpoint {address} must be bound with bind_inbox (CurveZMQ keys) first")
            sock = ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.bind(address)
        self.sock = sock
        self.address = address
        self.handler = handler
        self.name = name
        #: Held while a drain runs: what its handlers post leaves together at the end of the drain
        #: (the first ones earlier, by the outbox's flush schedule).
        self.outbox = outbox
        #: The run's secret: a message whose MAC does not verify is dropped (b"": no MAC).
        self.sealer = wire.Sealer(secret) if secret else None
        self.refused = 0
        self.malformed = 0  # messages dropped because they could not be read
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd: int = self.sock.getsockopt(zmq.FD)  # type: ignore[assignment]  # an int for FD
        self._loop.add_reader(self._fd, self._drain)
        # Messages may already be queued: an edge-triggered FD would not wake us for them.
        self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        outbox = self.outbox
        if outbox is None:
            self._read()
            return
        outbox.hold()
        try:
            self._read()
        finally:
            outbox.release()

    def _read(self) -> None:
        sock = self.sock
        handler = self.handler
        handled = 0
        while True:
            try:
                # Ending a drain on zmq.Again costs about four EVENTS checks: ask first while
                # the drain is short (one request in flight), read until Again when it is long.
                if 0 < handled < 4 and not sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]  # an int
                    return
                # recv and Frame.more instead of recv_multipart (a getsockopt per part): half
                # the cost of a one-part message, a third of a two-part one.
                frame = sock.recv(_NOBLOCK, copy=False)
                frames = [frame]
                while frame.more:
                    frame = sock.recv(_NOBLOCK, copy=False)
                    frames.append(frame)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed underneath us during shutdown
                return
            handled += 1
            body = frames[0].buffer
            if self.sealer is not None:
                body = self.sealer.unseal(body)
                if body is None:
                    self.refused += 1
                    log.warning("refused a control message without the run's MAC", inbox=self.name,
                                refused=self.refused, frames=len(frames))
                    continue
            try:
                msg = wire.decode(body)
            except Exception as exc:
                self.malformed += 1
                log.warning("dropped a malformed control message", inbox=self.name, error=str(exc))
                continue
            if type(msg) is wire.Batch:
                self._unbatch(msg.messages, frames)
            else:
                try:
                    handler(msg, frames[1:])  # type: ignore[arg-type]  # not a Batch (checked above)
                except Exception:
                    log.exception("control message handler failed", inbox=self.name, message=type(msg).__name__)

    def _unbatch(self, messages: list, frames: list) -> None:
        counts = [m.nframes if type(m) is wire.Data else 0 for m in messages]
        if sum(counts) != len(frames) - 1:
            self.malformed += 1
            log.warning("dropped a malformed control message", inbox=self.name,
                        error=f"a batch announced {sum(counts)} frames and carried {len(frames) - 1}")
            return
        handler = self.handler
        start = 1
        for msg, count in zip(messages, counts, strict=True):
            try:
                handler(msg, frames[start:start + count] if count else [])
            except Exception:
                log.exception("control message handler failed", inbox=self.name, message=type(msg).__name__)
            start += count

    def close(self) -> None:
        if self._loop is not None and not self.sock.closed:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._fd)
        _close_listener(self.sock)


class Outbox:
    """PUSH sockets to peers, connected on first use, keyed by address.

    Messages to one address leave in the order they were posted. When a peer's queue is full,
    later messages wait in a per-address backlog that a flusher task drains; ``send`` awaits its
    message leaving (back-pressure), ``post`` does not (for synchronous callers)."""

    def __init__(self, ctx: zmq.Context, secret: bytes = b""):
        self.ctx = ctx
        self.secret = secret
        self._socks: dict[str, zmq.Socket] = {}
        self._backlog: dict[str, deque] = {}
        self._flushers: dict[str, asyncio.Task] = {}
        self._pending: dict[str, list] = {}  # posted this loop turn, sent at its end
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: deque | None = None
        self._held = 0  # > 0 while an inbox drains or a step's outputs are made: posts wait for its end
        self._step_held = 0  # > 0 while a step's outputs are made (send_together): no early sends
        self._posted = 0  # messages posted since pending was last empty
        self._flush_at = _FIRST_FLUSH  # ... at which count they leave without waiting for the end
        #: zmq messages sent (or queued to be sent) per destination address, batches counted once.
        self.sent: dict[str, int] = {}
        #: What the steps' sends (:func:`send_together`) made: messages per destination per step.
        self.step_sends = StepSends()
        _outboxes.add(self)

    def _sock(self, address: str) -> zmq.Socket:
        sock = self._socks.get(address)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            connect(sock, address)
            self._socks[address] = sock
        return sock

    @property
    def secret(self) -> bytes:
        """The run's secret: every message leaves sealed with its MAC (b"": none)."""
        return self._secret

    @secret.setter
    def secret(self, secret: bytes) -> None:
        self._secret = secret
        self._seal = wire.Sealer(secret).seal if secret else None

    def _try(self, sock: zmq.Socket, msg: Any, frames: Sequence[Any]) -> bool:
        seal = self._seal
        try:
            if frames:  # part by part (send_multipart costs twice as much); atomic all the same:
                # zmq takes the later parts of a message whose first part it took
                _send(sock, seal(wire.encode(msg)) if seal is not None else wire.encode(msg), _SNDMORE, False)
                for frame in frames[:-1]:
                    _send(sock, frame, _SNDMORE, False)
                _send(sock, frames[-1], _NOBLOCK, False)
            else:
                _send(sock, seal(wire.encode(msg)) if seal is not None else wire.encode(msg), _NOBLOCK)
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
            self._ready = ready_queue(loop)
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
            if pending or self._held:
                queued = pending.get(address)
                if queued is None:
                    pending[address] = [(msg, frames)]
                else:
                    queued.append((msg, frames))
                self._posted += 1
                if self._posted >= self._flush_at and not self._step_held:
                    self._flush_at += min(self._flush_at, _FLUSH_STEP)
                    self._send_pending(reset=False)
                return None
            loop = self._bind_loop()
            if loop is not None and (self._ready is None or self._ready):
                pending[address] = [(msg, frames)]
                loop.call_soon(self._send_pending)
                return None
            sent = self.sent
            sent[address] = sent.get(address, 0) + 1
            if self._try(self._sock(address), msg, frames):
                return None
            return self._queue(address, msg, frames)
        sent = self.sent
        sent[address] = sent.get(address, 0) + 1
        return self._queue(address, msg, frames)

    def hold(self) -> None:
        """Posts wait until :meth:`release` (an inbox drains: its handlers' outputs leave together)."""
        self._held += 1

    def release(self) -> None:
        self._held -= 1
        if not self._held and self._pending:
            self._send_pending()

    def hold_step(self, loop: asyncio.AbstractEventLoop) -> None:
        """What the callbacks already scheduled on ``loop`` post (the tasks one batched step
        woke) waits, without early sends, until they all ran, then leaves as one message per
        destination (see :func:`send_together`)."""
        self._held += 1
        self._step_held += 1
        loop.call_soon(self._release_step)

    def _release_step(self) -> None:
        self._held -= 1
        self._step_held -= 1
        if self._held or not self._pending:
            return
        counts: dict[str, tuple[int, int]] = {}
        self._send_pending(counts=counts)
        self.step_sends.record(counts)

    def flush(self) -> None:
        """Send what waits for the end of the turn or of a hold now."""
        if self._pending:
            self._send_pending()

    def _send_pending(self, reset: bool = True, counts: dict[str, tuple[int, int]] | None = None) -> None:
        """Send what was posted during the last loop turn (or hold), order kept: several
        messages to one peer leave as one zmq message (:class:`~.wire.Batch`). ``reset=False``:
        an early send in the middle of a turn or hold, whose flush schedule goes on. ``counts``
        (a step's release) gets, per address, the zmq messages sent and the messages they carry."""
        pending, self._pending = self._pending, {}
        if reset:
            self._posted, self._flush_at = 0, _FIRST_FLUSH
        sent = self.sent
        for address, messages in pending.items():
            sock = self._sock(address)
            backlogged = bool(self._backlog.get(address))
            n = len(messages) if backlogged else -(-len(messages) // _BATCH)  # zmq messages
            sent[address] = sent.get(address, 0) + n
            if counts is not None:
                counts[address] = (n, len(messages))
            if backlogged:
                for msg, frames in messages:
                    self._queue(address, msg, frames)
                continue
            for start in range(0, len(messages), _BATCH):
                chunk = messages[start:start + _BATCH]
                if len(chunk) == 1:
                    msg, frames = chunk[0]
                else:
                    msg = wire.Batch([m for m, _ in chunk])
                    frames = [f for _, fs in chunk for f in fs]
                if not self._try(sock, msg, frames):
                    self._queue(address, msg, frames)
                    for later in range(start + _BATCH, len(messages), _BATCH):
                        later_chunk = messages[later:later + _BATCH]
                        self._queue(address, wire.Batch([m for m, _ in later_chunk]) if len(later_chunk) > 1 else later_chunk[0][0],
                                    [f for _, fs in later_chunk for f in fs])
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


@attrs.define
class StepSends:
    """What the releases of batched steps' outputs (:func:`send_together`) sent: ``steps`` that
    sent anything, and per destination address the zmq ``messages`` sent, the messages they
    ``carried`` (chunks, results, stream ends: one per row and output) and the ``most`` zmq
    messages one step sent there (1: one message per step per destination)."""

    steps: int = 0
    messages: dict[str, int] = attrs.Factory(dict)
    carried: dict[str, int] = attrs.Factory(dict)
    most: dict[str, int] = attrs.Factory(dict)

    def record(self, counts: dict[str, tuple[int, int]]) -> None:
        if not counts:
            return
        self.steps += 1
        for address, (sent, carried) in counts.items():
            self.messages[address] = self.messages.get(address, 0) + sent
            self.carried[address] = self.carried.get(address, 0) + carried
            self.most[address] = max(self.most.get(address, 0), sent)

    def add(self, other: StepSends) -> None:
        self.steps += other.steps
        for mine, theirs in ((self.messages, other.messages), (self.carried, other.carried)):
            for address, n in theirs.items():
                mine[address] = mine.get(address, 0) + n
        for address, n in other.most.items():
            self.most[address] = max(self.most.get(address, 0), n)


#: Every outbox of this process (a stage process has one; a caller one per running pipeline).
_outboxes: weakref.WeakSet[Outbox] = weakref.WeakSet()


def send_together() -> None:
    """One message per step per destination: call it right after handing one batched step's
    results to the tasks waiting for them (a decode step's rows, a micro-batch's callers; the
    kits of :mod:`omni_core.kits` do). What those tasks post before they next wait (chunks,
    results, stream ends), in the next turn of the running event loop, leaves at its end as one
    zmq message per destination process instead of being sent early in pieces (16, 32, 64 ...
    messages) as a long turn's posts are; the receiver hands the messages out one by one, per
    request, as if they came alone. A task whose send waits (no credit left, a relay put that
    suspends) sends later, on its own. Outside an event loop, or with no outbox bound to it,
    nothing happens."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    for outbox in list(_outboxes):
        if outbox._loop is loop:
            outbox.hold_step(loop)


def step_sends() -> StepSends:
    """What :func:`send_together` sent in this process so far, every outbox's summed (a test's or
    a bench's count of messages per step per destination)."""
    total = StepSends()
    for outbox in list(_outboxes):
        total.add(outbox.step_sends)
    return total


def messages_sent() -> dict[str, int]:
    """zmq messages this process sent so far per destination address (a batch counts once),
    every outbox's summed."""
    total: dict[str, int] = {}
    for outbox in list(_outboxes):
        for address, n in outbox.sent.items():
            total[address] = total.get(address, 0) + n
    return total


class Transport(Protocol):
    """What an :class:`~.endpoint.Endpoint` sends and receives through, by address: the
    process's outbox (``post``/``send``/``flush``, messages sealed with the run's ``secret``)
    and its inbox (``listen``: every message that arrives goes to ``handler(message, frames)``,
    each frame with a ``.buffer``). :class:`ZmqTransport` is the one processes use; a test can
    hand an endpoint another (tests/fake_endpoint.py records what is sent and plays the inbox)."""

    secret: bytes

    def post(self, address: str, msg: Any, frames: Sequence[Any] = ()) -> asyncio.Future | None: ...

    async def send(self, address: str, msg: Any, frames: Sequence[Any] = ()) -> None: ...

    def flush(self) -> None: ...

    def listen(self, address: str, handler: Handler, *, name: str, secret: bytes) -> None: ...

    def close_inbox(self) -> None: ...

    def close(self, linger_ms: int = 2000) -> None: ...


class ZmqTransport(Outbox):
    """The zmq :class:`Transport`: its own context, the :class:`Outbox` (it is one, so a post
    costs no extra call) and, once listening, the process's :class:`Inbox`."""

    def __init__(self) -> None:
        self._zctx: zmq.Context | None = _new_context()
        super().__init__(self._zctx)
        self._inbox: Inbox | None = None

    def listen(self, address: str, handler: Handler, *, name: str, secret: bytes) -> None:
        """Bind the inbox at ``address`` and start reading it (in the running event loop)."""
        assert self._zctx is not None, "closed"
        self._inbox = Inbox(self._zctx, address, handler, name=name, outbox=self, secret=secret)
        self._inbox.start()

    @property
    def refused(self) -> int:
        """How many messages the inbox refused for lacking the run's MAC."""
        return self._inbox.refused if self._inbox is not None else 0

    @property
    def malformed(self) -> int:
        """How many messages the inbox dropped because they could not be read."""
        return self._inbox.malformed if self._inbox is not None else 0

    def close_inbox(self) -> None:
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None

    def close(self, linger_ms: int = 2000) -> None:
        """Close the inbox and the outbox (waiting up to ``linger_ms`` for what it still holds
        to leave), then the context."""
        self.close_inbox()
        super().close(linger_ms=linger_ms)
        if self._zctx is not None:
            self._zctx.term()
            self._zctx = None


# -- tcp endpoints ---------------------------------------------------------------------------------
#
# A tcp inbox is a CurveZMQ server: it accepts a connection only from a client that knows the
# run's server public key *and* presents the run's client key pair, checked by a ZAP handler
# (pyzmq's ThreadAuthenticator) per run domain. Outboxes find the keys of a tcp address in
# :func:`trust`'s table. Keys reach stage processes through the launcher (for Ray: actor
# arguments), never a command line or an environment variable.


@attrs.frozen(repr=False)
class CurveKeys:
    """One run's CurveZMQ keys (z85): the inboxes' server pair and the processes' client pair."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    @property
    def domain(self) -> str:
        """The ZAP domain of the run's inboxes (derived from the public server key)."""
        return "omni-" + hashlib.sha256(self.server_public).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"CurveKeys(server_public={self.server_public!r}, secrets hidden)"


_tcp_lock = threading.Lock()
_tcp_ctx: zmq.Context | None = None
_tcp_auth: Any = None
_domains: dict[str, bytes] = {}
_prebound: dict[str, zmq.Socket] = {}
_trusted: dict[str, CurveKeys] = {}
#: The tcp endpoints each bound inbox socket listens on (closing waits for their ports).
_listening: dict[zmq.Socket, tuple[str, ...]] = {}


class _AllowRunKey:
    def callback(self, domain: str, key: bytes) -> bool:
        return _domains.get(domain) == key


def _tcp_context(keys: CurveKeys) -> zmq.Context:
    """The context of this process's tcp inboxes, with its ZAP handler (started once)."""
    global _tcp_ctx, _tcp_auth
    with _tcp_lock:
        if _tcp_ctx is None:
            from zmq.auth.thread import ThreadAuthenticator

            _tcp_ctx = zmq.Context(io_threads=1)
            _tcp_auth = ThreadAuthenticator(_tcp_ctx)
            _tcp_auth.start()
        if keys.domain not in _domains:
            _domains[keys.domain] = keys.client_public
            _tcp_auth.configure_curve_callback(keys.domain, credentials_provider=_AllowRunKey())
        return _tcp_ctx


def bind_inbox(ipc: str | None, *, keys: CurveKeys | None = None, host: str | None = None,
               port_range: tuple[int, int] | None = None, tcp: str | None = None) -> str | None:
    """Bind an inbox socket now, before the process's :class:`Inbox` is built: to ``ipc`` (when
    given) and, with ``keys``, to a tcp port on ``host`` chosen by binding (within ``port_range``,
    else any free port), or to the exact ``tcp`` address (a restarted process keeps its address).
    The socket waits for the :class:`Inbox` of either address to adopt it. Returns the tcp address
    (None without tcp)."""
    ctx = _tcp_context(keys) if keys is not None else zmq.Context.instance()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    address = None
    try:
        if ipc:
            sock.bind(ipc)
        if keys is not None:
            sock.curve_server = True
            sock.curve_secretkey = keys.server_secret
            sock.curve_publickey = keys.server_public
            sock.zap_domain = keys.domain.encode()
            if tcp is not None:
                bind_when_free(sock, tcp)
                address = tcp
            elif port_range is not None:
                port = sock.bind_to_random_port(f"tcp://{host}", port_range[0], port_range[1] + 1, max_tries=1000)
                address = f"tcp://{host}:{port}"
            else:
                sock.bind(f"tcp://{host}:0")
                address = sock.last_endpoint.decode()
    except BaseException:
        sock.close(linger=0)
        raise
    with _tcp_lock:
        if address is not None:
            _listening[sock] = (address,)
        for name in (ipc, address):
            if name:
                _prebound[name] = sock
    if address is not None:
        trust([address], keys)
    return address


def adopt_inbox(address: str) -> zmq.Socket | None:
    """The socket :func:`bind_inbox` bound for ``address`` (and forget it), or None."""
    with _tcp_lock:
        sock = _prebound.pop(address, None)
        if sock is not None:
            for name in [n for n, s in _prebound.items() if s is sock]:
                del _prebound[name]
    return sock


def release_inboxes(addresses: Sequence[str]) -> None:
    """Close the inboxes bound for ``addresses`` that nobody adopted (a failed start)."""
    with _tcp_lock:
        socks = {id(s): s for a, s in _prebound.items() if a in addresses}
        for address in [a for a, s in _prebound.items() if id(s) in socks]:
            del _prebound[address]
    for sock in socks.values():
        _close_listener(sock)


#: How long a released tcp port may take to be closed, or a port to be let go of by a process
#: that is still exiting, before binding it again fails.
_PORT_TIMEOUT = 10.0


def _close_listener(sock: zmq.Socket, timeout: float = _PORT_TIMEOUT) -> None:
    """Close an inbox socket. A tcp listener returns only once zmq's I/O thread has closed its
    port: ``close(linger=0)`` returns before that, and binding the port again right after it fails
    with EADDRINUSE (measured: 74-197 times in 300 bind/release/rebind loops)."""
    with _tcp_lock:
        endpoints = _listening.pop(sock, ())
    if not endpoints or sock.closed:
        sock.close(linger=0)
        return
    from zmq.utils.monitor import recv_monitor_message

    monitor = sock.get_monitor_socket(zmq.EVENT_CLOSED)
    try:
        pending = 0
        for endpoint in endpoints:
            with contextlib.suppress(zmq.ZMQError):
                sock.unbind(endpoint)
                pending += 1
        deadline = time.monotonic() + timeout
        while pending and (left := deadline - time.monotonic()) > 0:
            if not monitor.poll(int(left * 1000) + 1):
                break
            if recv_monitor_message(monitor)["event"] == zmq.EVENT_CLOSED:
                pending -= 1
        if pending:
            log.warning("a released tcp inbox did not close its port in time", endpoints=list(endpoints))
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


def bind_when_free(sock: zmq.Socket, address: str, timeout: float = _PORT_TIMEOUT) -> None:
    """Bind ``address`` exactly, waiting up to ``timeout`` while the port is still held (a
    restarted process keeps its address; its predecessor may still be exiting)."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            sock.bind(address)
            return
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                if exc.errno == errno.EADDRINUSE:
                    raise zmq.ZMQError(exc.errno, f"{address} is still in use after {timeout:.0f} s: another "
                                                  "process holds the port") from exc
                raise
        time.sleep(delay)  # polling a port another process holds: there is no event to wait for
        delay = min(delay * 2, 0.2)


def trust(addresses: Sequence[str], keys: CurveKeys | None) -> None:
    """Outboxes of this process connect to these tcp ``addresses`` with the run's ``keys``."""
    if keys is None:
        return
    with _tcp_lock:
        for address in addresses:
            if address.startswith("tcp://"):
                _trusted[address] = keys


def forget_trust(keys: CurveKeys) -> None:
    """Drop a finished run's keys from this process (its addresses and its ZAP domain)."""
    with _tcp_lock:
        for address in [a for a, k in _trusted.items() if k is keys or k == keys]:
            del _trusted[address]
        _domains.pop(keys.domain, None)


def connect(sock: zmq.Socket, address: str) -> None:
    """Connect ``sock`` to ``address``; a tcp address with the run's CurveZMQ client keys."""
    if address.startswith("tcp://"):
        _curve_client(sock, address)
    sock.connect(address)


def _curve_client(sock: zmq.Socket, address: str) -> None:
    keys = _trusted.get(address)
    if keys is None:
        sock.close(linger=0)
        raise ValueError(f"no CurveZMQ keys for tcp endpoint {address}: tcp peers must be announced with trust()")
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret

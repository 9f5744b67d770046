"""The ``tcp`` relay: tensors between processes on different machines over a data connection of
their own, beside the control plane.

- **Listener and handles.** A sending process binds one tcp listener on its first ``put`` (on
  ``relay.options.host``, default this node's address; the port is the kernel's choice). The
  handle of a transfer carries the listener's address, a 32-byte secret drawn by this relay
  instance, a ticket and the tensors' dtypes and shapes. Handles only travel in control
  messages, which the run's CurveZMQ keys protect across machines (ipc in a 0700 directory on one).
- **Connections.** A receiving process connects to a sender's listener on its first ``get`` of a
  handle of that sender, and both ends prove they hold the secret (HMAC-SHA256 over fresh nonces,
  :mod:`omni_tcp.wire`); a process that never saw one of the run's handles is refused before it
  can send or read a byte of a transfer. ``relay.options.encrypt`` adds AES-256-GCM with a key
  derived from the same secret and nonces.
- **Transfers.** ``put`` pins the tensors (no copy of a contiguous CPU tensor: a caller that
  writes into a tensor after ``put`` may send the new values, as with ``inline``), takes a credit
  and queues the transfer for the target's writer thread, which sends it in chunks of
  ``chunk_bytes``, taking turns with the other transfers in flight toward that target, so a large
  tensor does not hold small ones back. Transfers put before the receiver connected are sent once
  it does. The receiver's reader thread writes each chunk straight into a reused buffer; ``get``
  waits for its transfer without blocking the event loop and returns views of that buffer, valid
  until ``release``. Transfers of fewer than ``inline_below`` bytes travel as frames of the control
  message, as ``inline`` sends them.
- **Credits.** At most ``credits`` transfers per target are unreleased; ``release`` sends the
  ticket back over the connection. A ``put`` without a credit waits in arrival order and raises
  ``RelayTimeout`` after ``timeout`` seconds, naming the target and the requests holding them;
  one second once the target's connection closed (the receiver died or closed its relay).
- **Aborts and failures.** ``cleanup(request_id)`` on the sender gives the request's credits up
  and tells the receiver to drop those transfers (a late ``get`` of one is a clear error); on the
  receiver it releases what the request holds or has received. A connection that ends fails the
  ``get`` calls waiting on it; the next ``get`` of that sender connects again.
- **Lifetime.** Nothing is shared but sockets: ``close`` closes the listener and every connection
  and joins every thread; a crashed process leaves nothing behind (``sweep`` has nothing to do).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import torch
from omni_core.logs import get_logger
from omni_core.relay import checks
from omni_core.relay.base import InvalidHandle, Relay, RelayContext, RelayError, Transfer
from omni_core.relay.inline import dtype_name, inline_tensors, inline_transfer, tensor_bytes
from omni_core.relay.kit import (
    BufferPool,
    Credits,
    CreditWait,
    dead_wait_text,
    relay_options,
    wait_for_credit,
)

from . import wire
from .plugin import CAPABILITIES, OPTIONS

_ALIGN = 64
_SECRET = 32


class TcpRelayError(RelayError):
    """A tcp relay transfer failed (connection refused, ended, or not authenticated)."""


class Handle(msgspec.Struct, array_like=True):
    address: str  # the sender's listener, host:port ("" for a transfer of empty tensors only)
    secret: bytes
    sender: str
    ticket: int
    request: int
    size: int
    dtypes: list[str]
    shapes: list[list[int]]


# A handle's wire format, public: the tests that forge handles write it with these.
encode_handle = msgspec.msgpack.Encoder().encode
decode_handle = msgspec.msgpack.Decoder(Handle).decode


def _layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of tensors of ``sizes`` bytes in one buffer, each 64-byte aligned; its size."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // _ALIGN) * _ALIGN
    return offsets, end


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or len(address) > 300:
        raise InvalidHandle(f"tcp relay: handle names address {address!r}, not host:port")
    return host.strip("[]"), int(port)


class _Ledger:
    """Where the receiver's releases of one target land (written by the link's reader thread,
    read by :class:`~omni_core.relay.kit.Credits` on the event loop)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.slots: dict[int, int] = {}  # ticket -> slot, while issued
        self.done: dict[int, int] = {}  # slot -> the last ticket released in it
        self.outbox: wire.Outbox | None = None

    def issue(self, slot: int, ticket: int) -> None:
        with self.lock:
            self.slots[ticket] = slot

    def released(self, slot: int) -> int:
        return self.done.get(slot, 0)

    def abandon(self, slot: int, ticket: int) -> None:
        with self.lock:
            self.slots.pop(ticket, None)
        self.outbox.abandon(ticket)

    def on_release(self, ticket: int) -> None:
        with self.lock:
            slot = self.slots.pop(ticket, None)
            if slot is not None:
                self.done[slot] = ticket


class _Target:
    """The sender's state toward one target process: credits, ledger, outbox."""

    def __init__(self, name: str, credits: int, chunk: int):
        self.ledger = _Ledger()
        self.outbox = self.ledger.outbox = wire.Outbox(name, chunk, self.ledger.on_release)
        self.credits = Credits(credits)


class TcpRelay(Relay):
    """Tensors over an authenticated tcp connection per pair of processes (see the module
    docstring)."""

    name = "tcp"
    capabilities = CAPABILITIES

    def __init__(self, ctx: RelayContext):
        super().__init__(ctx)
        options = relay_options("tcp", OPTIONS, ctx.options)
        self.credits, self.timeout = options["credits"], float(options["timeout"])
        self.chunk, self.inline_below = options["chunk_bytes"], options["inline_below"]
        self.encrypt, self.host = options["encrypt"], options["host"]
        self.connect_timeout = float(options["connect_timeout"])
        if self.encrypt:
            wire.Cipher(bytes(32), b"test", b"test")  # a clear error now if cryptography is missing
        self.log = get_logger(process=ctx.process, relay="tcp")
        self._secret = os.urandom(_SECRET)
        self._tickets = itertools.count(1)
        self._lock = threading.Lock()
        self._connecting = threading.Lock()
        self._closed = False
        # sender
        self._listener: socket.socket | None = None
        self._address = ""
        self._acceptor: threading.Thread | None = None
        self._admitting: dict[threading.Thread, socket.socket] = {}
        self._targets: dict[str, _Target] = {}
        self._server_links: list[wire.ServerLink] = []
        # receiver
        self._links: dict[tuple[str, bytes], wire.ClientLink] = {}
        self._held: dict[tuple[str, bytes, int], tuple[wire.ClientLink, wire.Incoming]] = {}
        self._lent: collections.Counter[int] = collections.Counter()
        self._pool = BufferPool(keep=8)

    # -- sender ---------------------------------------------------------------------------------

    async def put(self, request_id: int, tensors: Sequence[torch.Tensor], target: str) -> Transfer:
        if self._closed:
            raise TcpRelayError("tcp relay: put after close")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tcp relay: item {i} of the put is a {type(t).__name__}, not a tensor")
        sizes = [t.nbytes for t in tensors]
        nbytes = sum(sizes)
        if 0 < nbytes < self.inline_below:
            return inline_transfer(tensors)
        dtypes, shapes = [dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors]
        if nbytes == 0:
            return Transfer(encode_handle(Handle("", b"", self.ctx.process, 0, request_id, 0, dtypes, shapes)))
        if not isinstance(target, str) or not target:
            raise ValueError(f"tcp relay: target must be a process name, got {target!r}")
        offsets, size = _layout(sizes)
        segments = [(off, tensor_bytes(t.resolve_conj().resolve_neg()))
                    for t, off, n in zip(tensors, offsets, sizes, strict=True) if n]
        address = self._serve()
        tgt = self._target(target)
        credit = None if tgt.credits.waiters else tgt.credits.take(request_id, self._tickets, tgt.ledger)
        if credit is None:
            credit = await wait_for_credit(self._wait(tgt, target, nbytes),
                                           lambda: tgt.credits.take(request_id, self._tickets, tgt.ledger))
        tgt.outbox.push(wire.Outgoing(credit.ticket, request_id, size, nbytes, segments))
        return Transfer(encode_handle(Handle(address, self._secret, self.ctx.process, credit.ticket, request_id,
                                             size, dtypes, shapes)))

    def _wait(self, tgt: _Target, target: str, nbytes: int) -> CreditWait:
        def why(dead: bool) -> str:
            box = tgt.outbox
            state = ("its data connection closed (the receiver died or closed its relay)" if box.lost
                     else "the receiver is connected but did not release them" if box.link is not None
                     else "the receiver has not connected yet")
            return (f"tcp relay: put of {nbytes} bytes from process {self.ctx.process!r} to process {target!r} "
                    f"waited {dead_wait_text(dead, self.timeout)} for a credit ({self.credits} unreleased "
                    f"transfers per target), held by requests {tgt.credits.holders()[:10]}; {state}. The "
                    "runtime frees a dead receiver's credits with cleanup(request_id); raise relay.options "
                    "timeout or credits if the receiver is merely slow")

        return CreditWait(tgt.credits.waiters, self.timeout, lambda: tgt.outbox.lost, why, lambda: self._closed,
                          lambda: TcpRelayError("tcp relay: closed while a put waited for a credit"))

    def _target(self, name: str) -> _Target:
        with self._lock:
            tgt = self._targets.get(name)
            if tgt is None:
                tgt = self._targets[name] = _Target(name, self.credits, self.chunk)
            return tgt

    def _serve(self) -> str:
        """The listener's address, binding it on first use."""
        if self._listener is not None:
            return self._address
        with self._lock:
            if self._listener is None:
                host = self.host or wire.node_address()
                try:
                    sock = socket.create_server((host, 0), backlog=64)
                except OSError as exc:
                    raise TcpRelayError(f"tcp relay: cannot listen on {host!r} ({exc}); set relay.options.host "
                                        "to an address of this machine that the other nodes reach") from None
                port = sock.getsockname()[1]
                self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                self._acceptor = threading.Thread(target=self._accept, args=(sock,), name="omni-tcp-accept",
                                                  daemon=True)
                self._listener = sock
                self._acceptor.start()
        return self._address

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                thread = threading.Thread(target=self._admit, args=(conn,), name="omni-tcp-handshake", daemon=True)
                self._admitting[thread] = conn
            thread.start()

    def _admit(self, conn: socket.socket) -> None:
        """Authenticate a connection; it becomes its process's link, or is closed."""
        try:
            conn.settimeout(self.connect_timeout)
            name, cipher = wire.server_handshake(conn, self._secret, self.encrypt)
            conn.settimeout(None)
            wire.tune(conn)
        except (OSError, wire.LinkError) as exc:
            self.log.warning("tcp relay: refused a data connection", reason=str(exc))
            wire.shut(conn)
            with self._lock:
                self._admitting.pop(threading.current_thread(), None)
            return
        with self._lock:
            self._admitting.pop(threading.current_thread(), None)
            if self._closed:
                wire.shut(conn)
                return
            tgt = self._targets.get(name)
            if tgt is None:
                tgt = self._targets[name] = _Target(name, self.credits, self.chunk)
            link = wire.ServerLink(conn, cipher, tgt.outbox)
            self._server_links = [x for x in self._server_links if x.reader.ident is None or x.reader.is_alive()] + [link]
        link.start()
        tgt.outbox.attach(link)

    # -- receiver -------------------------------------------------------------------------------

    async def get(self, handle: bytes, frames: Sequence[Any] = ()) -> list[torch.Tensor]:
        if self._closed:
            raise TcpRelayError("tcp relay: get after close")
        key = bytes(handle)
        if frames:  # a small transfer: its bytes came as frames of the control message
            return inline_tensors(key, frames)
        h = checks.decode(decode_handle, key, "tcp")
        specs = checks.tensor_specs(h.dtypes, h.shapes, "tcp")
        if not h.address:
            checks.no_bytes(specs, "tcp")
            return [torch.empty(shape, dtype=dtype) for dtype, shape, _ in specs]
        sizes = [n for _, _, n in specs]
        offsets, size = _layout(sizes)
        if h.size != size or type(h.ticket) is not int or h.ticket <= 0 or len(h.secret) != _SECRET:
            raise InvalidHandle(f"tcp relay: handle of request {h.request} declares a buffer of {h.size!r} bytes "
                                f"and ticket {h.ticket!r} (its tensors need {size})")
        _split_address(h.address)
        link = await self._link(h)
        entry = await self._arrival(link, h)
        if entry.size != size or entry.payload != sum(sizes):
            raise InvalidHandle(f"tcp relay: transfer {h.ticket} from {h.sender!r} holds {entry.payload} bytes, "
                                f"its handle declares {sum(sizes)}")
        if link.claim(h.ticket) is None:
            raise TcpRelayError(f"tcp relay: transfer {h.ticket} of request {h.request} was dropped while it "
                                "was received (its request was cleaned up)")
        self._held[(h.address, h.secret, h.ticket)] = (link, entry)
        self._lent[entry.buffer.untyped_storage().data_ptr()] += 1
        buffer = entry.buffer
        return [buffer[off:off + n].view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)
                for (dtype, shape, n), off in zip(specs, offsets, strict=True)]

    async def _link(self, h: Handle) -> wire.ClientLink:
        link = self._links.get((h.address, h.secret))
        if link is not None and (link.error is None or link.progress(h.ticket) >= 0):
            return link
        return await asyncio.to_thread(self._connect, h.address, h.secret, h.sender)

    def _connect(self, address: str, secret: bytes, sender: str) -> wire.ClientLink:
        """Connect and authenticate to a sender's listener (once per sender; a link whose
        connection ended is replaced)."""
        with self._connecting:
            return self._connect_once(address, secret, sender)

    def _connect_once(self, address: str, secret: bytes, sender: str) -> wire.ClientLink:
        with self._lock:
            link = self._links.get((address, secret))
            if link is not None and link.error is None:
                return link
            if self._closed:
                raise TcpRelayError("tcp relay: closed")
        if link is not None:
            link.close()
        host, port = _split_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=self.connect_timeout)
        except OSError as exc:
            raise TcpRelayError(f"tcp relay: cannot reach sender {sender!r} at {address} ({exc}): it died or "
                                "closed its relay, or a firewall blocks the port") from None
        try:
            cipher = wire.client_handshake(sock, secret, self.ctx.process)
            sock.settimeout(None)
            wire.tune(sock)
        except (OSError, wire.LinkError) as exc:
            wire.shut(sock)
            raise TcpRelayError(f"tcp relay: the data connection to sender {sender!r} at {address} failed to "
                                f"authenticate ({exc})") from None
        link = wire.ClientLink(sock, cipher, sender, address, self._pool.take, self._pool.give)
        with self._lock:
            if self._closed:
                wire.shut(sock)
                raise TcpRelayError("tcp relay: closed")
            self._links[(address, secret)] = link
        link.start()
        return link

    async def _arrival(self, link: wire.ClientLink, h: Handle) -> wire.Incoming:
        """The complete transfer of ``h`` once its last chunk arrived; TcpRelayError when the
        connection ends, the sender abandons it, or nothing arrives for ``timeout`` seconds."""
        got = link.wait(h.ticket, asyncio.get_running_loop())
        if isinstance(got, wire.Incoming):
            return got
        if isinstance(got, BaseException):
            raise TcpRelayError(f"tcp relay: {got}")
        seen = link.progress(h.ticket)
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(got), self.timeout)
                except asyncio.TimeoutError:
                    now = link.progress(h.ticket)
                    if now == seen:
                        raise TcpRelayError(
                            f"tcp relay: transfer {h.ticket} of request {h.request} from process {h.sender!r} "
                            f"made no progress for {self.timeout:g} s ({max(now, 0)} bytes arrived)") from None
                    seen = now
        except wire.LinkError as exc:
            raise TcpRelayError(f"tcp relay: {exc}") from None
        finally:
            if not got.done():
                got.cancel()
                link.forget(h.ticket)

    def owns(self, tensor: Any) -> bool:
        """Tensors viewing a received buffer: it is reused once released."""
        if not self._lent or not tensor.numel() or tensor.device.type != "cpu":
            return False
        return tensor.untyped_storage().data_ptr() in self._lent

    def release(self, handle: bytes) -> None:
        try:
            h = decode_handle(bytes(handle))
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError):
            return  # an inline transfer's handle, or not one of ours: nothing is held
        held = self._held.pop((h.address, h.secret, h.ticket), None)
        if held is not None:
            self._give_back(*held)

    def _give_back(self, link: wire.ClientLink, entry: wire.Incoming) -> None:
        ptr = entry.buffer.untyped_storage().data_ptr()
        self._lent[ptr] -= 1
        if self._lent[ptr] <= 0:
            del self._lent[ptr]
        self._pool.give(entry.buffer)
        link.release(entry.ticket)

    def cleanup(self, request_id: int) -> None:
        with self._lock:
            targets = list(self._targets.values())
            links = list(self._links.values())
        for tgt in targets:
            tgt.credits.abandon(request_id)
        for key in [k for k, (_, e) in self._held.items() if e.request == request_id]:
            self._give_back(*self._held.pop(key))
        for link in links:
            for ticket in link.drop_request(request_id):
                link.release(ticket)

    def open_links(self) -> dict[str, dict[str, dict[str, Any]]]:
        """What this relay holds open toward other processes, a read-only snapshot for leak checks
        and tests: ``{"sending": {target: {"held": [request ids holding credits], "waiting": puts
        waiting for a credit}}, "receiving":
        {sender address: {"arriving": {ticket: bytes received so far}}}}``. Both are empty after
        :meth:`close`; a refused handle connects nothing."""
        with self._lock:
            targets, links = dict(self._targets), list(self._links.items())
        receiving: dict[str, dict[str, Any]] = {}
        for (address, _), link in links:
            with link.lock:
                receiving[address] = {"arriving": {t: e.received for t, e in link.incoming.items()}}
        return {"sending": {name: Credits.snapshot(tgt.credits) for name, tgt in targets.items()},
                "receiving": receiving}

    def debug_state(self) -> dict[str, int]:
        with self._lock:
            targets, links = list(self._targets.values()), list(self._links.values())
        for tgt in targets:
            tgt.credits.reclaim()  # releases that came back since the last put
        return {
            "received": len(self._held),
            "unclaimed": sum(link.unclaimed() for link in links),
            "credits": sum(len(t.credits.held) for t in targets),
            "queued": sum(t.outbox.pending() for t in targets),
        }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            listener, acceptor, self._listener = self._listener, self._acceptor, None
            admitting = dict(self._admitting)
            targets, links, servers = list(self._targets.values()), list(self._links.values()), self._server_links
            self._targets, self._links, self._server_links = {}, {}, []
        if listener is not None:
            wire.shut(listener)
        if acceptor is not None:
            acceptor.join(10)
        for thread, conn in admitting.items():
            wire.shut(conn)
            thread.join(10)
        for tgt in targets:
            tgt.outbox.close()
        for link in servers:
            link.close()
            link.join()
        for link in links:
            link.close()
        self._held.clear()
        self._lent.clear()
        self._pool.clear()


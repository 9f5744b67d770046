"""The data connection of the ``tcp`` relay: framing, the authentication handshake, the optional
cipher, and the two ends of a link (the sender's, which writes transfers chunk by chunk, and the
receiver's, which reads them into buffers).

One tcp connection per pair of processes that exchange tensors: the receiver connects to the
sender's listener (its address and secret came in a handle, over the run's authenticated control
plane). Every message is a fixed header, then ``length`` bytes (plus a 16-byte tag when the link
is encrypted):

- ``DATA`` (sender → receiver): bytes ``[offset, offset + length)`` of transfer ``ticket`` of
  request ``request``, whose buffer is ``size`` bytes and which carries ``payload`` bytes in all.
- ``ABANDON`` (sender → receiver): the sender cleaned transfer ``ticket`` up; drop it.
- ``RELEASE`` (receiver → sender): the receiver is done with ``ticket``; its credit is free.

The handshake proves, both ways, knowledge of the sender relay's secret without sending it
(HMAC-SHA256 over fresh nonces of both ends), so a process that never saw one of the run's
handles can neither read transfers nor inject any; the session key of the cipher is derived from
the same secret and nonces.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

DATA, ABANDON, RELEASE = 1, 2, 3
HEADER = struct.Struct("<BQqQIQQ")  # kind, ticket, request, offset, length, size, payload
MAGIC = b"OMNITCP1"
NONCE = 16
MAC = 32
TAG = 16
MAX_NAME = 255


class LinkError(ConnectionError):
    """The data connection failed: refused, not authenticated, or closed by the other end."""


# -- socket helpers -------------------------------------------------------------------------------

def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; LinkError when the connection ends first."""
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise LinkError("connection closed by the other end")
        got += k


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf))
    return bytes(buf)


def send_all(sock: socket.socket, buffers: list) -> None:
    """``sendmsg`` of ``buffers`` until every byte went (the kernel may take part of them)."""
    views = [memoryview(b).cast("B") for b in buffers if memoryview(b).nbytes]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def shut(sock: socket.socket) -> None:
    """Wake every thread blocked on ``sock`` (accept, recv, send), then close it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def tune(sock: socket.socket) -> None:
    """No Nagle delay; keepalive probes, so a peer machine that vanished without closing the
    connection (power loss, a cut link) is noticed within about half a minute."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def node_address() -> str:
    """This machine's address toward other machines: the source address of a route to a
    private network (a UDP socket is only connected, nothing is sent); loopback without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


# -- authentication and the cipher ----------------------------------------------------------------

def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


class Cipher:
    """AES-256-GCM per message: the header is authenticated data, nonces count messages per
    direction (the connection keeps them in order)."""

    def __init__(self, key: bytes, send_dir: bytes, recv_dir: bytes):
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError:  # pragma: no cover - depends on the environment
            raise LinkError("tcp relay: relay.options.encrypt needs the 'cryptography' package: "
                            "pip install 'omni-tcp[encrypt]'") from None
        self.aes = AESGCM(key)
        self.send_dir, self.recv_dir = send_dir, recv_dir
        self.sent = self.received = 0
        self.out = bytearray()  # reused for each message's ciphertext (sent before the next)
        self.in_place = hasattr(self.aes, "encrypt_into") and hasattr(self.aes, "decrypt_into")

    def seal(self, header: bytes, data: Any) -> Any:
        """``data`` encrypted, its tag appended (valid until the next call)."""
        self.sent += 1
        nonce = self.send_dir + self.sent.to_bytes(8, "little")
        if not self.in_place:
            return self.aes.encrypt(nonce, bytes(data), header)
        n = memoryview(data).nbytes + TAG
        if len(self.out) < n:
            self.out = bytearray(n)
        view = memoryview(self.out)[:n]
        self.aes.encrypt_into(nonce, data, header, view)
        return view

    def open_into(self, header: bytes, data: Any, into: memoryview) -> None:
        """Decrypt ``data`` (ciphertext and tag) into ``into``; LinkError if it fails its tag."""
        from cryptography.exceptions import InvalidTag

        self.received += 1
        nonce = self.recv_dir + self.received.to_bytes(8, "little")
        try:
            if self.in_place and into.nbytes:
                self.aes.decrypt_into(nonce, data, header, into)
            else:
                plain = self.aes.decrypt(nonce, bytes(data), header)
                if into.nbytes:
                    into[:] = plain
        except InvalidTag:
            raise LinkError("a message failed its authentication tag (tampered with, or out of order)") from None


def client_handshake(sock: socket.socket, secret: bytes, name: str) -> Cipher | None:
    """The receiver's side: say who it is, check that the sender knows ``secret``, prove it
    knows it too. Returns the link's cipher (None: not encrypted)."""
    nonce_c = os.urandom(NONCE)
    raw = name.encode()
    send_all(sock, [MAGIC, nonce_c, struct.pack("<H", len(raw)), raw])
    nonce_s, flags, mac_s = recv_bytes(sock, NONCE), recv_bytes(sock, 1), recv_bytes(sock, MAC)
    if not hmac.compare_digest(mac_s, _mac(secret, b"omni-tcp server", nonce_c, nonce_s, flags, raw)):
        raise LinkError("the listener did not prove it holds the sender's secret (not the sender "
                        "the handle names)")
    send_all(sock, [_mac(secret, b"omni-tcp client", nonce_s, nonce_c, raw)])
    if recv_bytes(sock, 1) != b"\x01":
        raise LinkError("the sender refused the connection")
    if flags == b"\x01":
        return Cipher(_mac(secret, b"omni-tcp key", nonce_c, nonce_s), b"c2s\x00", b"s2c\x00")
    return None


def server_handshake(sock: socket.socket, secret: bytes, encrypt: bool) -> tuple[str, Cipher | None]:
    """The sender's side: ``(peer process name, cipher)`` once the peer proved it knows
    ``secret``; LinkError otherwise (the caller closes the connection)."""
    if recv_bytes(sock, len(MAGIC)) != MAGIC:
        raise LinkError("not an omni tcp relay client")
    nonce_c = recv_bytes(sock, NONCE)
    (size,) = struct.unpack("<H", recv_bytes(sock, 2))
    if size > MAX_NAME:
        raise LinkError("process name too long")
    raw = recv_bytes(sock, size)
    nonce_s, flags = os.urandom(NONCE), b"\x01" if encrypt else b"\x00"
    send_all(sock, [nonce_s, flags, _mac(secret, b"omni-tcp server", nonce_c, nonce_s, flags, raw)])
    if not hmac.compare_digest(recv_bytes(sock, MAC), _mac(secret, b"omni-tcp client", nonce_s, nonce_c, raw)):
        raise LinkError("the client did not prove it holds the sender's secret")
    send_all(sock, [b"\x01"])
    try:
        name = raw.decode()
    except UnicodeDecodeError:
        raise LinkError("process name is not UTF-8") from None
    cipher = Cipher(_mac(secret, b"omni-tcp key", nonce_c, nonce_s), b"s2c\x00", b"c2s\x00") if encrypt else None
    return name, cipher


def send_message(sock: socket.socket, cipher: Cipher | None, kind: int, ticket: int, request: int = 0,
                 offset: int = 0, data: Any = b"", size: int = 0, payload: int = 0) -> None:
    length = memoryview(data).nbytes
    header = HEADER.pack(kind, ticket, request, offset, length, size, payload)
    send_all(sock, [header, cipher.seal(header, data)] if cipher else [header, data])


def read_header(sock: socket.socket, buf: bytearray) -> tuple:
    recv_exact(sock, memoryview(buf))
    return HEADER.unpack(buf)


def read_body(sock: socket.socket, cipher: Cipher | None, header: bytes, into: memoryview,
              scratch: bytearray) -> None:
    """The ``into.nbytes`` bytes after ``header``: straight into ``into``, or through the cipher."""
    if cipher is None:
        recv_exact(sock, into)
        return
    n = into.nbytes + TAG
    if len(scratch) < n:
        scratch.extend(bytes(n - len(scratch)))
    view = memoryview(scratch)[:n]
    recv_exact(sock, view)
    cipher.open_into(header, view, into)


# -- the sender's end -----------------------------------------------------------------------------

class Outgoing:
    """One transfer on its way: ``segments`` are ``(offset in the receiver's buffer, bytes)``,
    pinned until sent; ``cursor`` is where the next chunk starts."""

    __slots__ = ("ticket", "request", "size", "payload", "segments", "cursor", "at")

    def __init__(self, ticket: int, request: int, size: int, payload: int, segments: list):
        self.ticket, self.request, self.size, self.payload = ticket, request, size, payload
        self.segments, self.cursor, self.at = segments, 0, 0


class Outbox:
    """What one sender has for one target process: transfers queued and in progress, the
    target's link (once it connected), and the thread that writes to it. Transfers take turns
    of ``chunk`` bytes, so a large one never holds small ones back for long."""

    def __init__(self, target: str, chunk: int, on_release: Callable[[int], None]):
        self.target = target
        self.chunk = chunk
        self.on_release = on_release
        self.queue: collections.deque[Outgoing] = collections.deque()
        self.abandons: list[int] = []
        self.cond = threading.Condition()
        self.link: ServerLink | None = None
        self.lost = False  # a link existed and closed, and none replaced it
        self.closed = False
        self.writer: threading.Thread | None = None

    def push(self, out: Outgoing) -> None:
        with self.cond:
            self.queue.append(out)
            self.cond.notify()

    def abandon(self, ticket: int) -> None:
        """Drop ``ticket`` if it is still queued and tell the receiver to drop what it has."""
        with self.cond:
            for out in [o for o in self.queue if o.ticket == ticket]:
                self.queue.remove(out)
            if self.link is not None:
                self.abandons.append(ticket)
                self.cond.notify()

    def attach(self, link: ServerLink) -> None:
        """``link`` now reaches the target (a first or a new connection)."""
        with self.cond:
            old, self.link, self.lost = self.link, link, False
            self.cond.notify()
            if self.writer is None:
                self.writer = threading.Thread(target=self._write, name=f"omni-tcp-write-{self.target}", daemon=True)
                self.writer.start()
        if old is not None:
            old.close()

    def detach(self, link: ServerLink) -> None:
        """``link`` closed: the transfer it was writing is lost (its receiver saw the link end);
        queued ones wait for the next link."""
        with self.cond:
            if self.link is link:
                self.link, self.lost = None, True
                started = [o for o in self.queue if o.cursor or o.at]  # their gets failed with the link
                for out in started:
                    self.queue.remove(out)
                self.abandons.clear()
                self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.queue.clear()
            link, self.link = self.link, None
            self.cond.notify()
        if link is not None:
            link.close()
        if self.writer is not None and self.writer is not threading.current_thread():
            self.writer.join(10)

    def pending(self) -> int:
        with self.cond:
            return len(self.queue)

    def _write(self) -> None:
        while True:
            with self.cond:
                while not self.closed and (self.link is None or (not self.queue and not self.abandons)):
                    self.cond.wait()
                if self.closed:
                    return
                link, abandons, self.abandons = self.link, self.abandons, []
                out = self.queue[0] if self.queue else None
            try:
                for ticket in abandons:
                    link.send(ABANDON, ticket)
                if out is not None:
                    done = self._send_chunk(link, out)
                    with self.cond:
                        if self.queue and self.queue[0] is out:
                            self.queue.popleft()
                            if not done:
                                self.queue.append(out)  # its next chunk after the others' turn
            except Exception:  # noqa: BLE001 - the connection is unusable whatever went wrong
                link.close()
                self.detach(link)

    def _send_chunk(self, link: ServerLink, out: Outgoing) -> bool:
        """Up to ``chunk`` bytes of ``out`` (pieces of consecutive tensors); True once all sent."""
        budget = self.chunk
        while budget > 0 and out.cursor < len(out.segments):
            offset, data = out.segments[out.cursor]
            piece = data[out.at:out.at + budget]
            link.send(DATA, out.ticket, out.request, offset + out.at, piece, out.size, out.payload)
            out.at += piece.nbytes
            budget -= max(piece.nbytes, 1)
            if out.at >= data.nbytes:
                out.cursor, out.at = out.cursor + 1, 0
        return out.cursor >= len(out.segments)


class ServerLink:
    """The sender's end of one connection: writes go through its outbox's thread, a reader
    thread takes the receiver's releases."""

    def __init__(self, sock: socket.socket, cipher: Cipher | None, outbox: Outbox):
        self.sock, self.cipher, self.outbox = sock, cipher, outbox
        self.closed = False
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name=f"omni-tcp-acks-{outbox.target}", daemon=True)

    def start(self) -> None:
        self.reader.start()

    def send(self, kind: int, ticket: int, request: int = 0, offset: int = 0, data: Any = b"",
             size: int = 0, payload: int = 0) -> None:
        with self.lock:
            send_message(self.sock, self.cipher, kind, ticket, request, offset, data, size, payload)

    def _read(self) -> None:
        buf, scratch = bytearray(HEADER.size), bytearray()
        try:
            while True:
                header = read_header(self.sock, buf)
                kind, ticket, length = header[0], header[1], header[4]
                if kind != RELEASE or length:
                    raise LinkError(f"unexpected message kind {kind} from the receiver")
                read_body(self.sock, self.cipher, bytes(buf), memoryview(b""), scratch)
                self.outbox.on_release(ticket)
        except Exception:  # noqa: BLE001 - the connection is unusable whatever went wrong
            pass
        self.close()
        self.outbox.detach(self)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        shut(self.sock)

    def join(self) -> None:
        if self.reader.is_alive() and self.reader is not threading.current_thread():
            self.reader.join(10)


# -- the receiver's end ---------------------------------------------------------------------------

class Incoming:
    """A transfer arriving (or arrived) on a client link."""

    __slots__ = ("ticket", "request", "buffer", "view", "size", "payload", "received", "waiter", "dropped")

    def __init__(self, ticket: int, request: int, buffer: Any, size: int, payload: int):
        self.ticket, self.request, self.buffer, self.size, self.payload = ticket, request, buffer, size, payload
        self.view = memoryview(buffer.numpy()) if buffer is not None else None
        self.received = 0
        self.waiter: Any = None  # (loop, future) of a get waiting for it
        self.dropped = False

    @property
    def complete(self) -> bool:
        return self.received >= self.payload


class ClientLink:
    """The receiver's end of one connection to one sender relay: a reader thread fills buffers
    (from ``take(size)``) as chunks arrive and wakes the ``get`` waiting for each transfer."""

    def __init__(self, sock: socket.socket, cipher: Cipher | None, sender: str, address: str,
                 take: Callable[[int], Any], give: Callable[[Any], None]):
        self.sock, self.cipher, self.sender, self.address = sock, cipher, sender, address
        self.take, self.give = take, give
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.incoming: dict[int, Incoming] = {}
        self.abandoned: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.error: str | None = None
        self.reader = threading.Thread(target=self._read, name=f"omni-tcp-read-{sender}", daemon=True)

    def start(self) -> None:
        self.reader.start()

    def release(self, ticket: int) -> None:
        """Tell the sender ``ticket``'s credit is free (nothing when the link is gone)."""
        with self.send_lock:
            if self.error is None:
                with contextlib.suppress(OSError):
                    send_message(self.sock, self.cipher, RELEASE, ticket)

    def _read(self) -> None:
        buf, scratch = bytearray(HEADER.size), bytearray()
        try:
            while True:
                kind, ticket, request, offset, length, size, payload = read_header(self.sock, buf)
                header = bytes(buf)
                if kind == ABANDON and not length:
                    read_body(self.sock, self.cipher, header, memoryview(b""), scratch)
                    self._abandoned(ticket)
                    continue
                if kind != DATA or offset + length > size or length > payload:
                    raise LinkError(f"malformed message (kind {kind}, {length} bytes at {offset} of {size})")
                entry = self._entry(ticket, request, size, payload)
                read_body(self.sock, self.cipher, header, entry.view[offset:offset + length], scratch)
                self._arrived(entry, length)
        except Exception as exc:  # noqa: BLE001 - the connection is unusable whatever went wrong
            self._lost(f"{type(exc).__name__}: {exc}" if not isinstance(exc, (OSError, LinkError)) else str(exc))

    def _entry(self, ticket: int, request: int, size: int, payload: int) -> Incoming:
        """The transfer's entry, its buffer taken on its first chunk (a get may already wait
        on a placeholder for it)."""
        with self.lock:
            entry = self.incoming.get(ticket)
        if entry is not None and entry.size >= 0:
            if entry.size != size or entry.payload != payload:
                raise LinkError(f"transfer {ticket} changed its size between chunks")
            return entry
        buffer = self.take(size)
        with self.lock:
            entry = self.incoming.get(ticket)
            if entry is None:
                entry = self.incoming[ticket] = Incoming(ticket, request, buffer, size, payload)
            else:  # the placeholder of a waiting get
                entry.request, entry.buffer, entry.size, entry.payload = request, buffer, size, payload
                entry.view = memoryview(buffer.numpy())
        return entry

    def _arrived(self, entry: Incoming, length: int) -> None:
        with self.lock:
            entry.received += max(length, 0)
            if not entry.complete:
                return
            if entry.dropped:
                self.incoming.pop(entry.ticket, None)
                waiter = None
            else:
                waiter, entry.waiter = entry.waiter, None
        if entry.dropped:
            if entry.buffer is not None:
                self.give(entry.buffer)
        elif waiter is not None:
            wake(waiter, entry)

    def _abandoned(self, ticket: int) -> None:
        with self.lock:
            entry = self.incoming.pop(ticket, None)
            self.abandoned[ticket] = None
            while len(self.abandoned) > 4096:
                self.abandoned.popitem(last=False)
        if entry is None:
            return
        if entry.waiter is not None:
            wake(entry.waiter, LinkError(f"transfer {ticket} was cleaned up by its sender (request "
                                         f"{entry.request} aborted or failed)"))
        if entry.buffer is not None:  # unclaimed: no get holds it
            self.give(entry.buffer)

    def _lost(self, why: str) -> None:
        with self.lock:
            if self.error is None:
                self.error = why
            waiters = [(e.waiter, e.ticket) for e in self.incoming.values() if e.waiter is not None]
            for entry in [e for e in self.incoming.values() if not e.complete]:
                del self.incoming[entry.ticket]
            for entry in self.incoming.values():
                entry.waiter = None
        for waiter, ticket in waiters:
            wake(waiter, LinkError(f"the connection to sender {self.sender!r} at {self.address} ended "
                                   f"before transfer {ticket} arrived ({why}): the sender died or closed its relay"))

    def wait(self, ticket: int, loop: Any) -> Any:
        """The transfer if it is complete, else a future the reader completes (or fails)."""
        with self.lock:
            entry = self.incoming.get(ticket)
            if entry is not None and entry.complete:
                return entry
            if ticket in self.abandoned:
                return LinkError(f"transfer {ticket} was cleaned up by its sender (its request aborted or failed)")
            if self.error is not None:
                return LinkError(f"the connection to sender {self.sender!r} at {self.address} ended: {self.error}")
            if entry is None:  # a placeholder: the reader fills it in on the first chunk
                entry = self.incoming[ticket] = Incoming(ticket, 0, None, -1, 1)
            future = loop.create_future()
            entry.waiter = (loop, future)
            return future

    def claim(self, ticket: int) -> Incoming | None:
        """Take the complete transfer ``ticket`` out of the link (a get holds it now)."""
        with self.lock:
            entry = self.incoming.get(ticket)
            if entry is None or not entry.complete:
                return None
            return self.incoming.pop(ticket)

    def forget(self, ticket: int) -> None:
        """A get stopped waiting: drop its placeholder if nothing arrived for it."""
        with self.lock:
            entry = self.incoming.get(ticket)
            if entry is not None and entry.size < 0:
                del self.incoming[ticket]

    def drop_request(self, request: int) -> list[int]:
        """The receiver's cleanup of ``request``: drop its unclaimed transfers (one still
        arriving is read to its end, then dropped); the tickets, for their releases."""
        freed, dropped = [], []
        with self.lock:
            for entry in [e for e in self.incoming.values() if e.size >= 0 and e.request == request]:
                dropped.append(entry)
                if entry.complete:
                    del self.incoming[entry.ticket]
                    freed.append(entry.buffer)
                else:
                    entry.dropped = True
                if entry.waiter is not None:
                    waiter, entry.waiter = entry.waiter, None
                    wake(waiter, LinkError(f"request {request} was cleaned up while its transfer arrived"))
        for buffer in freed:
            self.give(buffer)
        return [e.ticket for e in dropped]

    def unclaimed(self) -> int:
        with self.lock:
            return len(self.incoming)

    def progress(self, ticket: int) -> int:
        with self.lock:
            entry = self.incoming.get(ticket)
            return -1 if entry is None else entry.received

    def close(self) -> None:
        with self.send_lock:
            if self.error is None:
                self.error = "the receiver closed its relay"
        shut(self.sock)
        if self.reader.is_alive() and self.reader is not threading.current_thread():
            self.reader.join(10)


def wake(waiter: tuple, value: Any) -> None:
    """Complete a get's future from a link thread (its loop may be gone: then nobody waits)."""
    loop, future = waiter

    def settle() -> None:
        if not future.done():
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle)

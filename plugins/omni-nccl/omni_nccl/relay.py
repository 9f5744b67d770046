"""The ``nccl`` relay: torch.distributed point-to-point between the two processes of an edge.

Links. One relay instance per process talks to many peers, so it never touches the global
default group: each ordered pair (this process → target) and device kind gets a *link* of its own,
a 2-rank process group (sender rank 0, receiver rank 1) built with the c10d backend constructor
directly: ``ProcessGroupGloo`` for CPU tensors, ``ProcessGroupNCCL`` for CUDA tensors. The
rendezvous is a ``FileStore`` in the run's private runtime dir named after the link, so there is no
port to pick and no bind race. A link is created lazily on both sides: the sender writes the link's
ledger (:mod:`.ledger`) on its first ``put`` toward the target and returns at once; the receiver
maps the ledger and joins when the first handle of the link reaches its ``get``; the sender's
connect thread sees the receiver join and builds its end of the group. Sends queued before that
go out in order once connected.

Transfers. ``put`` copies the tensors into one flat staging buffer (one copy in; a mixed CPU/CUDA
put goes through the CUDA link), takes a credit, describes the transfer in the ledger's ring
(sequence number, size, slot, ticket, request) and issues a non-blocking send tagged with the
sequence number. The handle carries the link name and the sequence number. On the receiving side
one thread per link receives transfers in sequence order as the ring announces them, into reused
buffers; ``get`` waits (without blocking the event loop) for its sequence number and returns
zero-copy views of the received buffer, valid until ``release``.

Credits and back-pressure. At most ``credits`` transfers per link are unreleased; ``release``
writes the ticket back into the ledger and the sender reclaims lazily. A ``put`` without a credit
waits, in FIFO order, up to ``timeout`` seconds and then raises
:class:`~omni_core.relay.base.RelayTimeout` naming the target, the receiver's pid and state and
the requests holding the credits; once the receiver is seen dead the wait ends one second later.

Aborts. ``cleanup(request_id)`` on the sender abandons that request's credits (``issued`` = 0 in
the ledger): its data may still be in flight, and the receiving thread still takes it off the
pair (that is what keeps sequence numbers in step; nothing else is ever skipped) and discards it
instead of keeping it. A transfer whose receiver never calls ``get`` is therefore received
anyway, parked until its ``get``, and freed when either side cleans its request up; a ``get`` of a
handle whose request the sender cleaned up is a clear error. ``cleanup`` on the receiver releases
what it holds and what is parked for the request.

Failures. A link whose receiver died or closed its relay (seen through the ledger's pid and flags,
or a failed send) is torn down on the next ``put`` and replaced by a new generation, which a
restarted receiver joins; credits held by the dead receiver stay held until ``cleanup``. A
receiver whose sender died fails the ``get`` calls of that link with the reason. Waits on the
group run in the link threads (never on the event loop) and are bounded by ``link_timeout``; gloo
also fails them as soon as the peer's connection closes.

Lifetime. ``close`` stops the link threads, destroys the groups, unlinks the ledger and store
files this process created and releases what it holds. The files live in the runtime dir, which
the runner removes after a crash, so ``sweep`` has nothing to do.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import datetime
import itertools
import os
import re
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs
import msgspec
import torch
from omni_core.relay import checks
from omni_core.relay.base import Relay, RelayContext, RelayError, Transfer
from omni_core.relay.dtypes import dtype_from_name, dtype_name
from omni_core.relay.kit import (
    BufferPool,
    Credit,
    Credits,
    CreditWait,
    dead_wait_text,
    receiver_text,
    relay_options,
    wait_for_credit,
)

from .ledger import Ledger, LedgerError
from .plugin import CAPABILITIES, OPTIONS

__all__ = ["NcclRelay", "NcclRelayError", "DEFAULTS"]

DEFAULTS = {name: option.default for name, option in OPTIONS.items()}
_ALIGN = 64
_HEALTH_EVERY_S = 0.2
_POLL_MIN_S, _POLL_MAX_S = 2e-3, 50e-3
_TAG_MASK = 0x3FFFFFFF


class NcclRelayError(RelayError):
    """A transfer of the ``nccl`` relay failed; the message names the link and the reason."""


class _LinkBroken(Exception):
    pass


class Handle(msgspec.Struct, array_like=True):
    link: str  # the link's ledger file in the runtime dir; "" for a transfer without bytes
    sender: str  # the sending process, for messages
    seq: int
    slot: int
    ticket: int
    request_id: int
    nbytes: int
    offsets: list[int]
    dtypes: list[str]
    shapes: list[list[int]]
    host: list[bool]  # per tensor: it was a CPU tensor (a mixed put travels through CUDA)


# A handle's wire format, public: the tests that forge handles write it with these.
encode_handle = msgspec.msgpack.Encoder().encode
decode_handle = msgspec.msgpack.Decoder(Handle).decode


# -- options, names, layout ---------------------------------------------------------------------

def _options(options: dict[str, Any]) -> tuple[int, float, float]:
    """``(credits, timeout, link_timeout)`` from ``relay.options`` (other keys: other relays)."""
    values = relay_options("nccl", OPTIONS, options)
    return values["credits"], float(values["timeout"]), float(values["link_timeout"])


def _clean(text: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", text)[:limit] or "_"


def _tag(seq: int) -> int:
    return 1 + (seq & _TAG_MASK)  # tag 0 is the connection check


def _layout(tensors: Sequence[Any]) -> tuple[str, torch.device | None, list[int], int]:
    """The link kind (``"cpu"``/``"cuda"``), the CUDA device of the staging buffer, each tensor's
    64-aligned byte offset in it and its size. Checks every item before anything is copied."""
    kind, device, offsets, cursor = "cpu", None, [], 0
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise TypeError(f"nccl relay: item {i} is a {type(t).__name__} "
                            f"{getattr(t, 'layout', '')}, not a dense torch.Tensor")
        if t.device.type == "cuda":
            kind, device = "cuda", device or t.device
        elif t.device.type != "cpu":
            raise TypeError(f"nccl relay: item {i} is on {t.device}; this relay moves cpu and cuda tensors")
        dtype_from_name(dtype_name(t.dtype))  # unsupported dtypes fail here
        offset = -(-cursor // _ALIGN) * _ALIGN
        offsets.append(offset)
        cursor = offset + t.numel() * t.element_size()
    return kind, device, offsets, cursor


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


# -- process groups -----------------------------------------------------------------------------

def _new_group(kind: str, store_path: str, rank: int, timeout_s: float):
    """A 2-rank group for one link (rank 0 sends, rank 1 receives), rendezvous in ``store_path``."""
    from torch.distributed import FileStore

    store = FileStore(store_path, 2)
    timeout = datetime.timedelta(seconds=timeout_s)
    if kind == "cpu":
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()
        opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = timeout
        opts._threads = 1  # point-to-point never uses gloo's collective workers
        return ProcessGroupGloo(store, rank, 2, opts)
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return ProcessGroupNCCL(store, rank, 2, opts)


def _wait(work: Any, kind: str, timeout_s: float) -> None:
    """Block (in a link thread) until ``work`` finished. Gloo's wait ends at completion, when the
    peer's connection closes, or at the group's timeout; NCCL work is polled, so that a dead peer
    cannot block the thread for longer than ``timeout_s``."""
    if kind == "cpu":
        work.wait()
        return
    deadline, delay = time.monotonic() + timeout_s, 20e-6
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no completion in {timeout_s:g} s (relay.options.link_timeout)")
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
    work.wait()  # raises the error of a failed operation


def _hello(group: Any, rank: int, kind: str, device: torch.device | None, timeout_s: float) -> None:
    """One small transfer over a new link: it makes NCCL build its communicator here, in the link
    thread, and proves the pair works before any real transfer relies on it."""
    probe = torch.full((1,), 7 if rank == 0 else 0, dtype=torch.int64, device=device or "cpu")
    work = group.send([probe], 1, 0) if rank == 0 else group.recv([probe], 0, 0)
    _wait(work, kind, timeout_s)
    if rank == 1 and int(probe.item()) != 7:
        raise NcclRelayError(f"the connection check carried {int(probe.item())} instead of 7")


def _drop_group(group: Any, kind: str) -> None:
    if group is not None and kind == "cuda":
        with contextlib.suppress(Exception):
            group.abort()  # frees NCCL kernels still waiting for a peer that is gone


# -- buffers and credits ------------------------------------------------------------------------

class _Credits(Credits):
    """The sender's credits toward one target for one device kind (see
    :class:`omni_core.relay.kit.Credits`). They outlive links: credits a dead receiver held stay
    held until ``cleanup``."""

    def move(self, credit: Credit, ledger: Ledger) -> None:
        """Post ``credit`` on another link (its first one broke before the transfer went out)."""
        credit.ledger.abandon(credit.slot, credit.ticket)
        credit.ledger = ledger
        ledger.issue(credit.slot, credit.ticket)


# -- the sending end of a link --------------------------------------------------------------------

@attrs.define(eq=False)
class _Send:
    buffer: torch.Tensor
    nbytes: int
    seq: int = 0
    work: Any = None


class _SendLink:
    """This process → ``target`` for one device kind, one generation (see the module docstring)."""

    def __init__(self, relay: NcclRelay, target: str, kind: str, device: torch.device | None, generation: int):
        self.relay, self.target, self.kind, self.device = relay, target, kind, device
        ctx = relay.ctx
        self.name = (f"nccl.{_clean(ctx.run_id, 60)}.{_clean(ctx.process, 40)}.{_clean(target, 40)}."
                     f"{kind}.p{os.getpid()}.{relay.token}.g{generation}")
        self.path = os.path.join(ctx.runtime_dir, self.name)
        try:
            self.ledger = Ledger.create(self.path, relay.credits, relay.ring, kind)
        except OSError as exc:
            raise NcclRelayError(f"nccl relay: cannot create the link file {self.path} ({exc.strerror}); "
                                 "the run's runtime dir must exist and be writable") from None
        self.seq = 0
        self.group: Any = None
        self.queued: list[_Send] = []
        self.pending: collections.deque[_Send] = collections.deque()
        self.error: str | None = None
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.next_health = time.monotonic() + _HEALTH_EVERY_S
        self.thread = threading.Thread(target=self._connect, name=f"omni-nccl-connect:{target}", daemon=True)
        self.thread.start()

    # -- health ---------------------------------------------------------------------------------

    def broken(self) -> str | None:
        """Why this link cannot carry new transfers, or None."""
        if self.error is None:
            if self.ledger.receiver_closed:  # one word: checked every time
                self.error = f"its receiver (pid {self.ledger.receiver[0]}) closed its relay"
            elif time.monotonic() >= self.next_health:  # /proc: a few times a second at most
                self.next_health = time.monotonic() + _HEALTH_EVERY_S
                if self.ledger.receiver_gone():
                    self.error = f"its receiver (pid {self.ledger.receiver[0]}) died"
        return self.error

    def ring_free(self) -> bool:
        return self.seq + 1 - self.ledger.received <= self.ledger.ring

    # -- sending --------------------------------------------------------------------------------

    def post(self, send: _Send, credit: Credit) -> None:
        """Describe ``send`` in the ring and issue it (or queue it until the link connects)."""
        with self.lock:
            if self.error is not None:
                raise _LinkBroken(self.error)
            self.seq += 1
            send.seq = self.seq
            self.ledger.post(send.seq, send.nbytes, credit.slot, credit.ticket, credit.request_id)
            if self.group is None:
                self.queued.append(send)
            else:
                self._issue(send)

    def _issue(self, send: _Send) -> None:
        try:
            send.work = self.group.send([send.buffer[: send.nbytes]], 1, _tag(send.seq))
        except RuntimeError as exc:
            self.error = f"a send failed ({_first_line(exc)})"
            raise _LinkBroken(self.error) from None
        self.pending.append(send)

    def reap(self) -> None:
        """Return the staging buffers of sends the receiver has taken to the pool."""
        with self.lock:
            received = self.ledger.received
            while self.pending and self.pending[0].seq <= received:
                send = self.pending[0]
                if self.kind == "cuda" and not send.work.is_completed():
                    break
                try:
                    send.work.wait()  # gloo: done, the receiver has every byte
                except RuntimeError as exc:
                    self.error = f"a send failed ({_first_line(exc)})"
                    break
                self.pending.popleft()
                self.relay.staging_pool(self.kind, send.buffer.device).give(send.buffer)

    # -- connecting -----------------------------------------------------------------------------

    def _connect(self) -> None:
        try:
            if self.kind == "cuda":
                torch.cuda.set_device(self.device)
            delay = 1e-3
            while not self.ledger.receiver[0]:
                if self.stopping.wait(delay):
                    return
                delay = min(delay * 2, _POLL_MAX_S)
            if self.ledger.receiver_closed:
                raise NcclRelayError("the receiver closed its relay before the link connected")
            self.ledger.mark_connecting()
            group = _new_group(self.kind, self.path + ".store", 0, self.relay.link_timeout)
            _hello(group, 0, self.kind, self.device, self.relay.link_timeout)
        except Exception as exc:
            with self.lock:
                self.error = f"connecting failed ({_first_line(exc)}){failure_hint(exc)}"
                self.queued.clear()
            return
        with self.lock:
            if self.stopping.is_set():
                _drop_group(group, self.kind)
                return
            self.group = group
            queued, self.queued = self.queued, []
            for send in queued:
                try:
                    self._issue(send)
                except _LinkBroken:
                    break

    def close(self) -> None:
        """Stop connecting, drop the group and the queued sends, remove the link's files. The
        ledger stays mapped: credits posted on it may still come back through it."""
        self.stopping.set()
        if self.thread is not threading.current_thread():
            self.thread.join()
        with self.lock:
            group, self.group = self.group, None
            self.queued.clear()
            self.pending.clear()
            self.error = self.error or "closed"
        self.ledger.mark_sender_closed()
        _drop_group(group, self.kind)
        del group
        self.ledger.unlink()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path + ".store")


# -- the receiving end of a link ------------------------------------------------------------------

@attrs.define(eq=False)
class _Arrival:
    seq: int
    buffer: torch.Tensor
    nbytes: int
    slot: int
    ticket: int
    request_id: int


class _RecvLink:
    """The receiving end of one link: a thread that takes transfers off the pair in sequence order
    as the ledger's ring announces them, whether or not their ``get`` has come yet."""

    def __init__(self, relay: NcclRelay, name: str, sender: str):
        self.relay, self.name, self.sender = relay, name, sender
        self.path = os.path.join(relay.ctx.runtime_dir, name)
        self.ledger = Ledger.open(self.path)
        try:
            if self.ledger.receiver_closed or self.ledger.sender_gone():
                raise LedgerError(f"{self.path} belongs to a link that was closed")
            self.kind = self.ledger.kind
            self.device = relay.cuda_device() if self.kind == "cuda" else None
        except BaseException:
            self.ledger.close()
            raise
        self.pool = BufferPool(relay.credits) if self.kind == "cpu" else None
        self.cond = threading.Condition()
        self.next = 1
        self.stash: dict[int, _Arrival] = {}
        self.waiting: dict[int, concurrent.futures.Future] = {}
        self.error: str | None = None
        self.stopping = False
        self.ledger.join()
        self.thread = threading.Thread(target=self._run, name=f"omni-nccl-recv:{sender}", daemon=True)
        self.thread.start()

    def describe(self) -> str:
        return f"link {self.name} from process {self.sender!r} (pid {self.ledger.sender[0]})"

    # -- called on the event loop thread ---------------------------------------------------------

    def request(self, seq: int) -> concurrent.futures.Future:
        """A future for the arrival of transfer ``seq``."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.cond:
            arrival = self.stash.pop(seq, None)
            if arrival is not None:
                fut.set_result(arrival)
            elif seq < self.next:
                fut.set_exception(NcclRelayError(
                    f"nccl relay: transfer {seq} of {self.describe()} is stale: it was already "
                    "taken, or its request was cleaned up"))
            elif self.error is not None:
                fut.set_exception(NcclRelayError(f"nccl relay: {self.describe()} failed: {self.error}"))
            else:
                self.waiting[seq] = fut
                self.cond.notify()
        return fut

    def release(self, arrival: _Arrival) -> None:
        self.ledger.release(arrival.slot, arrival.ticket)
        if self.pool is not None:
            self.pool.give(arrival.buffer)

    def cleanup(self, request_id: int) -> None:
        with self.cond:
            for seq in [s for s, a in self.stash.items() if a.request_id == request_id]:
                self.release(self.stash.pop(seq))

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join()
        with self.cond:
            for arrival in self.stash.values():
                self.release(arrival)
            self.stash.clear()
            self._fail_waiting("the receiving relay closed")
        self.ledger.mark_receiver_closed()
        if self.pool is not None:
            self.pool.clear()

    # -- the link thread -------------------------------------------------------------------------

    def _run(self) -> None:
        group = None
        try:
            if self.kind == "cuda":
                torch.cuda.set_device(self.device)
            if not self._sender_connecting():
                return
            group = _new_group(self.kind, self.path + ".store", 1, self.relay.link_timeout)
            _hello(group, 1, self.kind, self.device, self.relay.link_timeout)
            self._receive(group)
        except Exception as exc:
            with self.cond:
                self.error = f"{_first_line(exc)}{failure_hint(exc)}"
                self._fail_waiting(self.error)
        finally:
            _drop_group(group, self.kind)
            del group
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path + ".store")

    def _sender_connecting(self) -> bool:
        """Wait, interruptibly, until the sender builds its end of the group: only then does
        this end block in the group's rendezvous, so a sender that closes first never leaves
        this thread (and the relay's close) waiting for ``link_timeout``."""
        delay, next_check = 1e-3, 0.0
        with self.cond:
            while not self.ledger.connecting:
                if self.stopping:
                    return False
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + _HEALTH_EVERY_S
                    if self.ledger.sender_gone():
                        raise NcclRelayError("its sender closed the link or died before connecting")
                self.cond.wait(delay)
                delay = min(delay * 2, _POLL_MAX_S)
        return True

    def _receive(self, group: Any) -> None:
        idle, next_check = _POLL_MIN_S, 0.0
        while True:
            with self.cond:
                while True:
                    if self.stopping:
                        return
                    entry = self.ledger.entry(self.next)
                    if entry is not None:
                        break
                    self._prune()
                    now = time.monotonic()
                    if now >= next_check:
                        next_check = now + _HEALTH_EVERY_S
                        if self.ledger.sender_gone():
                            self.error = "its sender closed the link or died"
                            self._fail_waiting(self.error)
                            return
                    self.cond.wait(idle)
                    idle = min(idle * 2, _POLL_MAX_S)
                seq = self.next
            idle = _POLL_MIN_S
            nbytes, slot, ticket, request_id = entry
            buffer = (self.pool.take(nbytes, "cpu") if self.pool is not None
                      else torch.empty(nbytes, dtype=torch.uint8, device=self.device))
            _wait(group.recv([buffer[:nbytes]], 0, _tag(seq)), self.kind, self.relay.link_timeout)
            with self.cond:
                self.next = seq + 1
                self.ledger.set_received(seq)
                self._arrive(_Arrival(seq, buffer, nbytes, slot, ticket, request_id))

    def _arrive(self, arrival: _Arrival) -> None:
        fut = self.waiting.pop(arrival.seq, None)
        if fut is not None and fut.set_running_or_notify_cancel():
            fut.set_result(arrival)
        elif self.ledger.issued(arrival.slot) != arrival.ticket:
            self._discard(arrival)  # the sender cleaned its request up
        else:
            self.stash[arrival.seq] = arrival  # parked until its get (or a cleanup)

    def _prune(self) -> None:
        for seq in [s for s, a in self.stash.items() if self.ledger.issued(a.slot) != a.ticket]:
            self._discard(self.stash.pop(seq))

    def _discard(self, arrival: _Arrival) -> None:
        if self.pool is not None:
            self.pool.give(arrival.buffer)

    def _fail_waiting(self, why: str) -> None:
        for fut in self.waiting.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(NcclRelayError(f"nccl relay: {self.describe()} failed: {why}"))
        self.waiting.clear()


def failure_hint(exc: BaseException) -> str:
    if "Duplicate GPU" in str(exc):
        return ("; both ends of the link are on the same GPU, and NCCL needs one GPU per rank: "
                "use the cuda_ipc relay between stages that share a GPU")
    return ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


# -- the relay ------------------------------------------------------------------------------------

class NcclRelay(Relay):
    """Transfers over torch.distributed point-to-point, one 2-rank group per link (see the module
    docstring).

    Options (``relay.options``): ``credits`` (unreleased transfers per target and device kind,
    default 16), ``timeout`` (seconds a ``put`` waits for a credit, default 30), ``link_timeout``
    (seconds for connecting a link and for any one send or receive on it, default 60).
    """

    name = "nccl"
    capabilities = CAPABILITIES

    def __init__(self, ctx: RelayContext):
        super().__init__(ctx)
        self.credits, self.timeout, self.link_timeout = _options(dict(ctx.options))
        self.ring = max(2 * self.credits, 16)
        self.token = secrets.token_hex(3)
        self._tickets = itertools.count(1)
        self._generations = itertools.count(1)
        self._links: dict[tuple[str, str], _SendLink] = {}
        self._credits: dict[tuple[str, str], _Credits] = {}
        self._staging: dict[tuple[str, Any], BufferPool] = {}
        self._retired: list[_SendLink] = []
        self._rlinks: dict[str, _RecvLink] = {}
        self._held: dict[bytes, tuple[_RecvLink, _Arrival, int]] = {}
        self._closed = False

    # -- sender ---------------------------------------------------------------------------------

    async def put(self, request_id: int, tensors: Sequence[torch.Tensor], target: str) -> Transfer:
        if self._closed:
            raise NcclRelayError("nccl relay: put after close")
        if not isinstance(target, str) or not target:
            raise ValueError(f"nccl relay: target must be a process name, got {target!r}")
        kind, device, offsets, nbytes = _layout(tensors)
        meta = ([dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors],
                [t.device.type == "cpu" for t in tensors])
        if nbytes == 0:
            return Transfer(encode_handle(Handle("", self.ctx.process, 0, 0, 0, request_id, 0, offsets, *meta)))
        if kind == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (target, kind)
        credits = self._credits.setdefault(key, _Credits(self.credits))
        credit = await self._acquire(key, credits, request_id, nbytes, device)
        send = None
        try:
            send = _Send(self._stage(tensors, offsets, nbytes, kind, device), nbytes)
            for attempt in (1, 2):
                link = self._link(target, kind, device)
                if credit.ledger is not link.ledger:
                    credits.move(credit, link.ledger)
                try:
                    link.post(send, credit)
                    break
                except _LinkBroken as exc:
                    if attempt == 2:
                        raise NcclRelayError(f"nccl relay: put from process {self.ctx.process!r} to "
                                             f"process {target!r} failed: {exc}") from None
        except BaseException:
            credits.free(credit)
            if send is not None:  # neither queued nor pending on any link: the buffer is free
                self.staging_pool(kind, send.buffer.device).give(send.buffer)
            raise
        handle = Handle(link.name, self.ctx.process, send.seq, credit.slot, credit.ticket,
                        request_id, nbytes, offsets, *meta)
        return Transfer(encode_handle(handle))

    def _stage(self, tensors, offsets: list[int], nbytes: int, kind: str, device) -> torch.Tensor:
        """One copy in: every tensor into a flat staging buffer on the link's device."""
        buffer = self.staging_pool(kind, device or torch.device("cpu")).take(nbytes, device or "cpu")
        for t, offset in zip(tensors, offsets, strict=True):
            size = t.numel() * t.element_size()
            if size:
                buffer[offset : offset + size].view(t.dtype).view(t.shape).copy_(t.detach())
        return buffer

    def staging_pool(self, kind: str, device: torch.device) -> BufferPool:
        key = (kind, str(device))
        pool = self._staging.get(key)
        if pool is None:
            pool = self._staging[key] = BufferPool(self.credits)
        return pool

    def _link(self, target: str, kind: str, device) -> _SendLink:
        """The healthy link toward ``target`` for ``kind``: a broken one is retired and replaced."""
        key = (target, kind)
        link = self._links.get(key)
        if link is not None and link.broken() is not None:
            self._retire(key)
            link = None
        if link is None:
            link = self._links[key] = _SendLink(self, target, kind, device, next(self._generations))
        return link

    def _retire(self, key: tuple[str, str]) -> None:
        link = self._links.pop(key, None)
        if link is not None:
            link.close()
            self._retired.append(link)

    async def _acquire(self, key, credits: _Credits, request_id: int, nbytes: int, device) -> Credit:
        """A credit toward ``key``'s target on a link with room in its ring, waiting in FIFO order;
        :class:`RelayTimeout` after ``timeout`` (one second once the receiver is seen dead)."""
        target, kind = key

        def attempt() -> Credit | None:
            link = self._link(target, kind, device)
            link.reap()
            if not link.ring_free():
                return None
            return credits.take(request_id, self._tickets, link.ledger)

        def receiver_dead() -> bool:
            link = self._links.get(key)
            ledgers = credits.ledgers() + ([link.ledger] if link is not None else [])
            return any(ledger.receiver_gone() for ledger in ledgers)

        def why(dead: bool) -> str:
            return (
                f"nccl relay: put of {nbytes} bytes from process {self.ctx.process!r} to process "
                f"{target!r} waited {dead_wait_text(dead, self.timeout)} for a credit ({credits.n} unreleased {kind} transfers "
                f"per target), held by requests {credits.holders()[:10]}; {_receiver_text(credits)}. "
                "The runtime frees a dead receiver's credits with cleanup(request_id); raise "
                "relay.options timeout or credits if the receiver is merely slow"
            )

        wait = CreditWait(credits.waiters, self.timeout, receiver_dead, why, lambda: self._closed,
                          lambda: NcclRelayError("nccl relay: closed while a put waited for a credit"))
        return await wait_for_credit(wait, attempt)

    # -- receiver -------------------------------------------------------------------------------

    async def get(self, handle: bytes, frames: Sequence[Any] = ()) -> list[torch.Tensor]:
        key = bytes(handle)
        h = checks.decode(decode_handle, key, "nccl")
        specs = checks.tensor_specs(h.dtypes, h.shapes, "nccl", ("offsets", h.offsets), ("host flags", h.host))
        if not h.link:
            checks.no_bytes(specs, "nccl")
            return [torch.empty(shape, dtype=dtype, device=self._device_for(host, None))
                    for (dtype, shape, _), host in zip(specs, h.host, strict=True)]
        checks.resource_name(h.link, f"nccl.{_clean(self.ctx.run_id, 60)}.", "nccl", "link")
        if type(h.nbytes) is not int or h.nbytes < 0:
            raise checks.InvalidHandle(f"nccl relay: handle declares {h.nbytes!r} bytes")
        checks.spans(specs, h.offsets, h.nbytes, "nccl", "the transfer")
        link = self._recv_link(h)
        checks.index(h.slot, link.ledger.credits, "nccl", "slot")
        if type(h.seq) is not int or h.seq < 1 or link.ledger.entry(h.seq) is None and h.seq >= link.next:
            # The sender posts a transfer's ring entry before put returns, so a real handle's
            # sequence number is always posted by the time its message arrives.
            raise checks.InvalidHandle(f"nccl relay: handle names transfer {h.seq!r} of "
                                       f"{link.describe()}, which its sender never posted")
        arrival = await asyncio.wrap_future(link.request(h.seq))
        if (arrival.slot, arrival.ticket, arrival.nbytes) != (h.slot, h.ticket, h.nbytes):
            link.release(arrival)
            raise NcclRelayError(f"nccl relay: transfer {h.seq} of {link.describe()} does not match "
                                 "its handle (the two ends of the link are out of step)")
        if link.ledger.issued(h.slot) != h.ticket:
            link._discard(arrival)
            raise NcclRelayError(f"nccl relay: handle of request {h.request_id} is stale: its sender "
                                 "cleaned the request up (aborted or failed)")
        out = []
        for (dtype, shape, size), offset, host in zip(specs, h.offsets, h.host, strict=True):
            if size == 0:
                out.append(torch.empty(shape, dtype=dtype, device=self._device_for(host, link)))
                continue
            view = arrival.buffer[offset : offset + size].view(dtype).view(shape)
            out.append(view.cpu() if host and view.device.type != "cpu" else view)
        self._held[key] = (link, arrival, h.request_id)
        return out

    def owns(self, tensor: Any) -> bool:
        """Views of a held arrival's buffer: CPU buffers go back to the link's pool at release;
        a CUDA buffer is the receiver's own, dropped at release (a view keeps it alive)."""
        if not tensor.numel():
            return False
        ptr = tensor.untyped_storage().data_ptr()
        return any(link.pool is not None and arrival.buffer.untyped_storage().data_ptr() == ptr
                   for link, arrival, _ in self._held.values())

    def _device_for(self, host: bool, link: _RecvLink | None):
        if host:
            return "cpu"
        return link.device if link is not None and link.device is not None else self.cuda_device()

    def cuda_device(self) -> torch.device:
        if not torch.cuda.is_available():
            raise NcclRelayError(
                f"nccl relay: process {self.ctx.process!r} received CUDA tensors but has no CUDA "
                "device; place the stage on a GPU or move the tensors to the CPU before they leave")
        return torch.device("cuda", torch.cuda.current_device())

    def _recv_link(self, h: Handle) -> _RecvLink:
        link = self._rlinks.get(h.link)
        if link is None:
            if self._closed:
                raise NcclRelayError("nccl relay: get after close")
            try:
                link = self._rlinks[h.link] = _RecvLink(self, h.link, h.sender)
            except LedgerError:
                raise NcclRelayError(
                    f"nccl relay: link {h.link} from process {h.sender!r} is closed: its sender "
                    "closed its relay or died (or this process closed its end) before this "
                    "transfer was received") from None
        return link

    def release(self, handle: bytes) -> None:
        held = self._held.pop(bytes(handle), None)
        if held is not None:
            held[0].release(held[1])

    # -- both -----------------------------------------------------------------------------------

    def open_links(self) -> dict[str, dict[str, dict[str, Any]]]:
        """What this relay holds open toward other processes, a read-only snapshot for leak checks
        and tests: ``{"sending": {"<target>/<kind>": {"held": [request ids holding credits],
        "waiting": puts waiting for a credit, "received": transfers the receiver took off the link,
        "pending": [sequence numbers of sends not yet complete]}}, "receiving": {link name: {"from":
        sender, "next": the sequence number expected next, "parked": transfers taken off the link
        before their get, "error": why the link failed or None}}}``. Credits outlive a link (a dead receiver's stay held
        until cleanup), so a target may be listed with no link. Both are empty after
        :meth:`close`; a refused handle opens nothing."""
        sending: dict[str, dict[str, Any]] = {}
        for target, kind in {*self._links, *self._credits}:
            link, credits = self._links.get((target, kind)), self._credits.get((target, kind))
            received, pending = 0, []
            if link is not None:
                with link.lock:
                    received, pending = link.ledger.received, [send.seq for send in link.pending]
            sending[f"{target}/{kind}"] = {**Credits.snapshot(credits), "received": received, "pending": pending}
        receiving: dict[str, dict[str, Any]] = {}
        for name, rlink in self._rlinks.items():
            with rlink.cond:
                receiving[name] = {"from": rlink.sender, "next": rlink.next,
                                   "parked": len(rlink.stash), "error": rlink.error}
        return {"sending": sending, "receiving": receiving}

    def debug_state(self) -> dict[str, int]:
        parked = 0
        for link in self._rlinks.values():
            with link.cond:
                parked += len(link.stash)
        for credits in self._credits.values():
            credits.reclaim()
        return {"received": len(self._held), "parked": parked,
                "sent": sum(len(c.held) for c in self._credits.values())}

    def cleanup(self, request_id: int) -> None:
        for key in [k for k, (_, _, rid) in self._held.items() if rid == request_id]:
            self.release(key)
        for link in self._rlinks.values():
            link.cleanup(request_id)
        for credits in self._credits.values():
            credits.abandon(request_id)

    def close(self) -> None:
        self._closed = True
        for key in list(self._links):
            self._retire(key)
        for link in self._rlinks.values():
            link.close()
        for link, arrival, _ in self._held.values():
            link.release(arrival)
        for link in self._rlinks.values():
            link.ledger.close()
        for link in self._retired:
            link.ledger.close()
        self._held.clear()
        self._rlinks.clear()
        self._retired.clear()
        self._credits.clear()
        for pool in self._staging.values():
            pool.clear()
        self._staging.clear()

    @classmethod
    def sweep(cls, run_id: str | None = None, *, dry_run: bool = False) -> list[str]:
        """Nothing outside the runtime dir: ledgers and stores live there and go with it."""
        return []


def _receiver_text(credits: _Credits) -> str:
    return receiver_text((ledger.receiver for ledger in credits.ledgers()),
                         "the receiver has not joined the link yet (no get of it has run)")

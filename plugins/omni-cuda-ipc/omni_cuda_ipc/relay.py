"""The ``cuda_ipc`` relay: CUDA tensors between stage processes of one node through CUDA IPC.

Same GPU: zero copy. ``put`` shares each tensor's CUDA allocation (``storage._share_cuda_()``:
an IPC memory handle plus torch's reference count for it) and *pins* the tensor, holding a
reference until the receiver releases it; a non-contiguous tensor is first made contiguous (a
copy). ``get`` opens the handles (torch caches opened allocations) and returns tensors viewing
the sender's memory. Nothing is copied.

Different GPUs: a peer copy into a slot pool. The receiver opens the sender's allocation on the
sender's GPU when it can see it, else on its own (CUDA maps it through peer access), and copies
each tensor into a flat buffer of its own GPU taken from a per-link pool of reused buffers; the
copy runs on a side stream the receiver's current stream then waits for. The stage reads local
memory, and the sender's pin is dropped at ``release`` like on one GPU.

Ordering. Each credit slot of a link has an interprocess CUDA event
(``torch.cuda.Event(interprocess=True)``), created once. ``put`` records it on the sender's
current stream after the tensors' writes; ``get`` makes the stream that reads them wait on it
(``from_ipc_handle``, opened once per slot), so the reader never sees unfinished writes and the
sender's host never blocks. The receiver side cannot be made asynchronous the same way: torch's
IPC storages synchronize the receiver's current stream when they are freed before returning the
reference count (the sender's memory must not be reused while the receiver still reads it).

Credits and release. At most ``credits`` transfers per link are unreleased; ``release`` writes
the slot's ticket into the link's ledger (:mod:`.ledger`, a file in the runtime dir: the
protocol has no back-channel) and the sender drops its pin when it next looks. A ``put`` without
a credit waits up to ``timeout`` seconds and raises
:class:`~omni_core.relay.base.RelayTimeout` naming the target, its receiver and the requests
holding the credits; one second once the receiver is seen dead. Memory a receiver still views is
never reused: torch keeps a shared allocation whose count is not back to zero in its "limbo".

Aborts. ``cleanup(request_id)`` on the sender abandons the request's slots. A transfer the
receiver never opened gets its torch reference count returned by the sender (a record lock on
the slot decides which side does it, so it happens exactly once) and its memory is freed; a get
of it afterwards is a clear error. ``cleanup`` on the receiver releases what it holds. A failure
of one transfer (a CPU tensor, a failed open, a stale handle) raises from that call only.

Limits. Same node only. Cross-GPU transfers need peer access between the two GPUs. A receiver
that dies while holding shared tensors never returns torch's count for them: those allocations
stay in the sender's limbo until the sender exits (a limit of torch's CUDA IPC). Allocations from
``expandable_segments`` cannot be shared on older torch versions.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import secrets
import time
from collections.abc import Sequence
from typing import Any

import attrs
import msgspec
import torch
from omni_core.relay import checks
from omni_core.relay.base import Relay, RelayContext, RelayError, Transfer
from omni_core.relay.inline import dtype_from_name, dtype_name
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

__all__ = ["CudaIpcRelay", "CudaIpcRelayError", "DEFAULTS"]

DEFAULTS = {name: option.default for name, option in OPTIONS.items()}
_ALIGN = 256
_RECV_GRANULE = 1 << 16  # receive buffers are sized in 64 KiB steps
_HEALTH_EVERY_S = 0.2
_NO_EVENT = bytes(64)  # CUDA_IPC_HANDLE_SIZE: the unused event argument of _new_shared_cuda
_COUNTER = re.compile(rb"/torch_[A-Za-z0-9_]{1,200}")  # torch's reference-count file names


class CudaIpcRelayError(RelayError):
    """A transfer of the ``cuda_ipc`` relay failed; the message says which and why."""


class Shared(msgspec.Struct, array_like=True):
    """One tensor's CUDA allocation as ``storage._share_cuda_()`` describes it."""

    handle: bytes  # cudaIpcMemHandle of the allocation
    size: int  # bytes of the tensor's storage
    offset: int  # byte offset of the storage in the allocation
    counter: bytes  # torch's reference-count file for this share
    counter_offset: int
    tensor_offset: int  # elements from the storage's start to the tensor's


class Handle(msgspec.Struct, array_like=True):
    link: str  # the link's ledger file in the runtime dir; "" when no tensor has bytes
    sender: str  # the sending process, for messages
    slot: int
    ticket: int
    request_id: int
    device: str  # UUID of the sender's GPU
    event: bytes  # IPC handle of the slot's event, recorded after the tensors' writes
    dtypes: list[str]
    shapes: list[list[int]]
    shared: list[Shared | None]  # None for a tensor without bytes


# A handle's wire format, public: the tests that forge handles write it with these.
encode_handle = msgspec.msgpack.Encoder().encode
decode_handle = msgspec.msgpack.Decoder(Handle).decode


# -- options, checks, helpers -------------------------------------------------------------------

def parse_options(options: dict[str, Any]) -> tuple[int, float]:
    """``(credits, timeout)`` from ``relay.options`` (other keys belong to other relays)."""
    values = relay_options("cuda_ipc", OPTIONS, options)
    return values["credits"], float(values["timeout"])


def require_cuda(process: str) -> None:
    if not torch.cuda.is_available():
        raise CudaIpcRelayError(
            f"cuda_ipc relay: process {process!r} has no usable CUDA device (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); this relay moves "
            "tensors between GPU stages only: place both stages on GPUs, or use the shm or nccl relay")


def check_tensors(tensors: Sequence[Any]) -> torch.device | None:
    """The CUDA device of the first tensor; every item must be a dense CUDA tensor."""
    device = None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise TypeError(f"cuda_ipc relay: item {i} is a {type(t).__name__} "
                            f"{getattr(t, 'layout', '')}, not a dense torch.Tensor")
        if t.device.type != "cuda":
            raise TypeError(
                f"cuda_ipc relay: item {i} is on {t.device}; this relay moves CUDA tensors only "
                "(the runtime sends the others through inline beside them; for host data use shm)")
        dtype_from_name(dtype_name(t.dtype))  # unsupported dtypes fail here
        device = device or t.device
    return device


def check_handle(handle: bytes, run_id: str) -> Handle:
    """The decoded handle, after the checks that need no GPU (see :mod:`omni_core.relay.checks`):
    its link is a plain ledger name of this run, one share per declared tensor (None exactly for
    the empty ones), each share large enough for its tensor."""
    h = checks.decode(decode_handle, handle, "cuda_ipc")
    specs = checks.tensor_specs(h.dtypes, h.shapes, "cuda_ipc", ("shares", h.shared))
    if not h.link:
        checks.no_bytes(specs, "cuda_ipc")
        return h
    checks.resource_name(h.link, f"cuda_ipc.{_clean(run_id, 60)}.", "cuda_ipc", "link")
    if len(h.event) != len(_NO_EVENT):
        raise checks.InvalidHandle(f"cuda_ipc relay: the event handle has {len(h.event)} bytes")
    for i, ((dtype, _, nbytes), shared) in enumerate(zip(specs, h.shared, strict=True)):
        if shared is None:
            if nbytes:
                raise checks.InvalidHandle(f"cuda_ipc relay: tensor {i} has {nbytes} bytes but no share")
            continue
        if len(shared.handle) != len(_NO_EVENT) or not _COUNTER.fullmatch(shared.counter):
            # torch opens the counter by name (a shared-memory file): only its own names pass.
            raise checks.InvalidHandle(f"cuda_ipc relay: tensor {i} has an invalid share "
                                       f"(memory handle of {len(shared.handle)} bytes, counter "
                                       f"{shared.counter[:80]!r})")
        if (min(shared.size, shared.offset, shared.tensor_offset, shared.counter_offset) < 0
                or shared.tensor_offset * dtype.itemsize + nbytes > shared.size):
            raise checks.InvalidHandle(
                f"cuda_ipc relay: tensor {i} ({nbytes} bytes at element {shared.tensor_offset}) "
                f"exceeds its shared storage ({shared.size} bytes)")
    return h


def _clean(text: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", text)[:limit] or "_"


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def byte_layout(dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """Aligned byte offsets of each tensor in a flat receive buffer, and the buffer's size."""
    offsets, cursor = [], 0
    for dt, shape in zip(dtypes, shapes, strict=True):
        offset = -(-cursor // _ALIGN) * _ALIGN
        offsets.append(offset)
        cursor = offset + dtype_from_name(dt).itemsize * _numel(shape)
    return offsets, cursor


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _open(shared: Shared, dtype: torch.dtype, shape: Sequence[int], device: int) -> torch.Tensor:
    """A tensor viewing the sender's allocation, opened on local ``device``."""
    storage = torch.UntypedStorage._new_shared_cuda(
        device, shared.handle, shared.size, shared.offset, shared.counter, shared.counter_offset,
        _NO_EVENT, False,
    )
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    return torch._utils._rebuild_tensor(typed, shared.tensor_offset, tuple(shape), contiguous_strides(shape))


def _return_counts(counters: Sequence[tuple[bytes, int]]) -> None:
    """Return torch's reference counts of shares no receiver will ever open."""
    for counter, offset in counters:
        with contextlib.suppress(Exception):
            torch.UntypedStorage._release_ipc_counter(counter, offset, device=None)


# -- sender side ----------------------------------------------------------------------------------

@attrs.define(eq=False)
class _Credit(Credit):
    pins: list = attrs.Factory(list)  # the shared tensors, alive until released
    counters: list = attrs.Factory(list)  # torch's reference count of each share


class _Credits(Credits):
    """The sender's credits toward one target from one GPU (see
    :class:`omni_core.relay.kit.Credits`): each holds a transfer's tensors from ``put`` until the
    receiver releases them (or cleanup)."""

    def __init__(self, n: int):
        super().__init__(n, _Credit)

    def abandoned(self, credit: _Credit) -> None:
        """Return torch's counts if the receiver never opened the transfer."""
        if not credit.ledger.abandon(credit.slot, credit.ticket):
            _return_counts(credit.counters)


class _Link:
    """This process's GPU → ``target``: the ledger and one interprocess event per credit slot."""

    def __init__(self, relay: CudaIpcRelay, target: str, device: torch.device, generation: int):
        ctx = relay.ctx
        self.target, self.device = target, device
        self.uuid = device_uuid(device.index)
        self.name = (f"cuda_ipc.{_clean(ctx.run_id, 60)}.{_clean(ctx.process, 40)}.{_clean(target, 40)}."
                     f"gpu{device.index}.p{os.getpid()}.{relay.token}.g{generation}")
        self.path = os.path.join(ctx.runtime_dir, self.name)
        try:
            self.ledger = Ledger.create(self.path, relay.credits)
        except OSError as exc:
            raise CudaIpcRelayError(f"cuda_ipc relay: cannot create the link file {self.path} "
                                    f"({exc.strerror}); the run's runtime dir must exist and be writable") from None
        self.events: dict[int, tuple[torch.cuda.Event, bytes]] = {}
        self.next_health = time.monotonic() + _HEALTH_EVERY_S
        self.error: str | None = None

    def event(self, slot: int) -> tuple[torch.cuda.Event, bytes]:
        got = self.events.get(slot)
        if got is None:
            with torch.cuda.device(self.device):
                event = torch.cuda.Event(interprocess=True)
                event.record(torch.cuda.current_stream(self.device))  # a handle needs a recorded event
                got = self.events[slot] = (event, bytes(event.ipc_handle()))
        return got

    def broken(self) -> str | None:
        if self.error is None:
            if self.ledger.receiver_closed:
                self.error = f"its receiver (pid {self.ledger.receiver[0]}) closed its relay"
            elif time.monotonic() >= self.next_health:
                self.next_health = time.monotonic() + _HEALTH_EVERY_S
                if self.ledger.receiver_gone():
                    self.error = f"its receiver (pid {self.ledger.receiver[0]}) died"
        return self.error

    def close(self) -> None:
        """Remove the link's file; the ledger stays mapped while credits posted on it live."""
        self.ledger.mark_sender_closed()
        self.ledger.unlink()


# -- receiver side --------------------------------------------------------------------------------

class _Peer:
    """The receiving end of one link: its ledger, the sender's slot events, a receive pool."""

    def __init__(self, relay: CudaIpcRelay, name: str, sender: str):
        self.name, self.sender = name, sender
        self.ledger = Ledger.open(os.path.join(relay.ctx.runtime_dir, name))
        if self.ledger.receiver_closed or self.ledger.sender_gone():
            self.ledger.close()
            raise LedgerError(f"{name} belongs to a link that was closed")
        self.ledger.join()
        self.events: dict[tuple[int, bytes, int], torch.cuda.Event] = {}
        self.pool = BufferPool(relay.credits, _RECV_GRANULE)

    def event(self, slot: int, handle: bytes, device: int) -> torch.cuda.Event:
        key = (slot, handle, device)
        event = self.events.get(key)
        if event is None:
            event = self.events[key] = torch.cuda.Event.from_ipc_handle(device, handle)
        return event

    def describe(self) -> str:
        return f"link {self.name} from process {self.sender!r} (pid {self.ledger.sender[0]})"


@attrs.define(eq=False)
class _Held:
    peer: _Peer
    slot: int
    ticket: int
    request_id: int
    keep: list  # what the returned tensors view: opened tensors, or a pool buffer
    buffer: torch.Tensor | None = None


# -- the relay ------------------------------------------------------------------------------------

class CudaIpcRelay(Relay):
    """Same-node CUDA tensors through CUDA IPC (see the module docstring).

    Options (``relay.options``): ``credits`` (unreleased transfers per target and GPU, default
    32), ``timeout`` (seconds a ``put`` waits for a credit, default 30).
    """

    name = "cuda_ipc"
    capabilities = CAPABILITIES

    def __init__(self, ctx: RelayContext):
        super().__init__(ctx)
        self.credits, self.timeout = parse_options(dict(ctx.options))
        require_cuda(ctx.process)
        self.token = secrets.token_hex(3)
        self._tickets = itertools.count(1)
        self._generations = itertools.count(1)
        self._links: dict[tuple[str, int], _Link] = {}
        self._credits: dict[tuple[str, int], _Credits] = {}
        self._retired: list[_Link] = []
        self._peers: dict[str, _Peer] = {}
        self._held: dict[bytes, _Held] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._closed = False

    # -- sender ---------------------------------------------------------------------------------

    async def put(self, request_id: int, tensors: Sequence[torch.Tensor], target: str) -> Transfer:
        if self._closed:
            raise CudaIpcRelayError("cuda_ipc relay: put after close")
        if not isinstance(target, str) or not target:
            raise ValueError(f"cuda_ipc relay: target must be a process name, got {target!r}")
        device = check_tensors(tensors)
        dtypes = [dtype_name(t.dtype) for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        if all(t.numel() == 0 for t in tensors):
            return Transfer(encode_handle(Handle("", self.ctx.process, 0, 0, request_id, "", b"", dtypes, shapes,
                                                 [None] * len(tensors))))
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(device):
            # Pinned as they are when contiguous (zero copy); otherwise one contiguous copy.
            prepared = [t.detach().to(device) if t.device != device else t.detach() for t in tensors]
            prepared = [t if t.is_contiguous() else t.contiguous() for t in prepared]
        key = (target, device.index)
        credits = self._credits.setdefault(key, _Credits(self.credits))
        credit, link = await self._acquire(key, credits, request_id, device)
        try:
            with torch.cuda.device(device):
                event, event_handle = link.event(credit.slot)
                shared = []
                for t in prepared:
                    if t.numel() == 0:
                        shared.append(None)
                        continue
                    _, handle, size, offset, counter, counter_offset, _, _ = t.untyped_storage()._share_cuda_()
                    credit.counters.append((counter, counter_offset))
                    shared.append(Shared(handle, size, offset, counter, counter_offset, t.storage_offset()))
                credit.pins = prepared
                event.record(torch.cuda.current_stream(device))
        except BaseException as exc:
            credits.free(credit)
            if isinstance(exc, RuntimeError):
                raise CudaIpcRelayError(
                    f"cuda_ipc relay: cannot share the tensors of request {request_id} with process "
                    f"{target!r}: {exc} (allocations from PYTORCH_CUDA_ALLOC_CONF="
                    "expandable_segments:True may not be shareable)") from exc
            raise
        handle = Handle(link.name, self.ctx.process, credit.slot, credit.ticket, request_id, link.uuid,
                        event_handle, dtypes, shapes, shared)
        return Transfer(encode_handle(handle))

    def _link(self, key: tuple[str, int], device: torch.device) -> _Link:
        link = self._links.get(key)
        if link is not None and link.broken() is not None:
            self._retire(key)
            link = None
        if link is None:
            link = self._links[key] = _Link(self, key[0], device, next(self._generations))
        return link

    def _retire(self, key: tuple[str, int]) -> None:
        link = self._links.pop(key, None)
        if link is not None:
            link.close()
            self._retired.append(link)

    async def _acquire(self, key, credits: _Credits, request_id: int, device) -> tuple[_Credit, _Link]:
        target = key[0]

        def attempt():
            link = self._link(key, device)
            credit = credits.take(request_id, self._tickets, link.ledger)
            return None if credit is None else (credit, link)

        def receiver_dead() -> bool:
            link = self._links.get(key)
            ledgers = credits.ledgers() + ([link.ledger] if link is not None else [])
            return any(ledger.receiver_gone() for ledger in ledgers)

        def why(dead: bool) -> str:
            return (
                f"cuda_ipc relay: put from process {self.ctx.process!r} to process {target!r} waited "
                f"{dead_wait_text(dead, self.timeout)} for a credit ({credits.n} unreleased transfers per target and GPU), held "
                f"by requests {credits.holders()[:10]}; {_receiver_text(credits)}. The runtime frees a "
                "dead receiver's credits with cleanup(request_id); raise relay.options timeout or "
                "credits if the receiver is merely slow"
            )

        wait = CreditWait(credits.waiters, self.timeout, receiver_dead, why, lambda: self._closed,
                          lambda: CudaIpcRelayError("cuda_ipc relay: closed while a put waited for a credit"))
        return await wait_for_credit(wait, attempt)

    # -- receiver -------------------------------------------------------------------------------

    async def get(self, handle: bytes, frames: Sequence[Any] = ()) -> list[torch.Tensor]:
        key = bytes(handle)
        h = check_handle(key, self.ctx.run_id)
        local = torch.device("cuda", torch.cuda.current_device())
        if not h.link:
            return [torch.empty(tuple(s), dtype=dtype_from_name(d), device=local) for d, s in zip(h.dtypes, h.shapes, strict=True)]
        peer = self._peer(h)
        checks.index(h.slot, peer.ledger.credits, "cuda_ipc", "slot")
        if not peer.ledger.claim(h.slot, h.ticket):
            raise CudaIpcRelayError(f"cuda_ipc relay: handle of request {h.request_id} is stale: its "
                                    "sender cleaned the request up (aborted or failed) or it was taken")
        opened: list[int] = []  # shares opened here: torch returns their counts when freed
        try:
            if h.device == device_uuid(local.index):
                held, out = self._open_here(peer, h, local, opened)
            else:
                held, out = self._copy_here(peer, h, local, opened)
        except Exception as exc:
            _return_counts([(s.counter, s.counter_offset) for i, s in enumerate(h.shared)
                            if s is not None and i not in opened])
            peer.ledger.release(h.slot, h.ticket)
            raise CudaIpcRelayError(f"cuda_ipc relay: cannot open transfer of request {h.request_id} "
                                    f"from {peer.describe()}: {exc}") from exc
        self._held[key] = held
        return out

    def _open_here(self, peer: _Peer, h: Handle, local: torch.device, opened: list[int]):
        """Same GPU: the sender's memory itself, after the sender's writes (its slot event)."""
        torch.cuda.current_stream(local).wait_event(peer.event(h.slot, h.event, local.index))
        out = []
        for i, (dt, shape, shared) in enumerate(zip(h.dtypes, h.shapes, h.shared, strict=True)):
            dtype = dtype_from_name(dt)
            if shared is None:
                out.append(torch.empty(tuple(shape), dtype=dtype, device=local))
            else:
                out.append(_open(shared, dtype, shape, local.index))
                opened.append(i)
        return _Held(peer, h.slot, h.ticket, h.request_id, list(out)), out

    def _copy_here(self, peer: _Peer, h: Handle, local: torch.device, opened: list[int]):
        """Another GPU: peer copies into a pooled buffer of this GPU, on a side stream."""
        source = _local_index(h.device)
        where = source if source is not None else local.index
        stream = self._stream(where)
        stream.wait_event(peer.event(h.slot, h.event, where))
        offsets, nbytes = byte_layout(h.dtypes, h.shapes)
        buffer = peer.pool.take(nbytes, local)
        out = []
        try:
            with torch.cuda.device(where), torch.cuda.stream(stream):
                remote = []
                for i, (dt, shape, offset, shared) in enumerate(zip(h.dtypes, h.shapes, offsets, h.shared, strict=True)):
                    dtype = dtype_from_name(dt)
                    size = dtype.itemsize * _numel(shape)
                    view = buffer[offset : offset + size].view(dtype).view(tuple(shape))
                    if shared is not None:
                        remote.append(_open(shared, dtype, shape, where))
                        opened.append(i)
                        view.copy_(remote[-1])
                    out.append(view)
                # Freed here, torch waits for this stream (only the copies) before it returns
                # each share's count to the sender.
                del remote
        except BaseException:
            peer.pool.give(buffer)
            raise
        torch.cuda.current_stream(local).wait_stream(stream)
        return _Held(peer, h.slot, h.ticket, h.request_id, [], buffer), out

    def _stream(self, device: int) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _peer(self, h: Handle) -> _Peer:
        peer = self._peers.get(h.link)
        if peer is None:
            if self._closed:
                raise CudaIpcRelayError("cuda_ipc relay: get after close")
            try:
                peer = self._peers[h.link] = _Peer(self, h.link, h.sender)
            except LedgerError:
                raise CudaIpcRelayError(
                    f"cuda_ipc relay: link {h.link} from process {h.sender!r} is closed: its sender "
                    "closed its relay or died (or this process closed its end) before this "
                    "transfer was received") from None
        if peer.ledger.sender_closed:  # a dead sender shows when its memory fails to open
            raise CudaIpcRelayError(f"cuda_ipc relay: {peer.describe()} is gone: the sender closed "
                                    "its relay or died, and its memory with it")
        return peer

    def owns(self, tensor: Any) -> bool:
        """Every received CUDA tensor: on one GPU it views the sender's allocation (reused by the
        sender once released, and not shareable again from here), across GPUs a pooled buffer."""
        if not tensor.numel() or tensor.device.type != "cuda":
            return False
        ptr = tensor.untyped_storage().data_ptr()
        for held in self._held.values():
            if held.buffer is not None and held.buffer.untyped_storage().data_ptr() == ptr:
                return True
            if any(t.untyped_storage().data_ptr() == ptr for t in held.keep):
                return True
        return False

    def release(self, handle: bytes) -> None:
        held = self._held.pop(bytes(handle), None)
        if held is None:
            return
        held.keep.clear()  # torch returns the counts once no view is left
        if held.buffer is not None:
            held.peer.pool.give(held.buffer)
        held.peer.ledger.release(held.slot, held.ticket)

    # -- both -----------------------------------------------------------------------------------

    def open_links(self) -> dict[str, dict[str, dict[str, Any]]]:
        """What this relay holds open toward other processes, a read-only snapshot for leak checks:
        ``{"sending": {"<target>/<device>": {"held": [request ids holding credits], "waiting":
        puts waiting for a credit}},
        "receiving": {link name: {"from": sender}}}``. Credits outlive a link, so a target may be
        listed with no link. Both are empty after :meth:`close`; a refused handle opens nothing."""
        sending = {f"{target}/{device}": Credits.snapshot(self._credits.get((target, device)))
                   for target, device in {*self._links, *self._credits}}
        receiving = {name: {"from": peer.sender} for name, peer in self._peers.items()}
        return {"sending": sending, "receiving": receiving}

    def debug_state(self) -> dict[str, int]:
        for credits in self._credits.values():
            credits.reclaim()
        return {"received": len(self._held), "sent": sum(len(c.held) for c in self._credits.values())}

    def cleanup(self, request_id: int) -> None:
        for key in [k for k, held in self._held.items() if held.request_id == request_id]:
            self.release(key)
        for credits in self._credits.values():
            credits.abandon(request_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for key in list(self._held):
            self.release(key)
        for credits in self._credits.values():
            for credit in list(credits.held.values()):
                credits.free(credit)
        for key in list(self._links):
            self._retire(key)
        for link in self._retired:
            link.ledger.close()
        for peer in self._peers.values():
            peer.ledger.mark_receiver_closed()
            peer.ledger.close()
        self._credits.clear()
        self._retired.clear()
        self._peers.clear()
        self._streams.clear()

    @classmethod
    def sweep(cls, run_id: str | None = None, *, dry_run: bool = False) -> list[str]:
        """Nothing outside the runtime dir: ledgers live there and go with it; CUDA memory goes
        with the process that allocated it."""
        return []


def _local_index(uuid: str) -> int | None:
    """This process's index of the GPU with ``uuid``, if it can see it."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    return None


def _receiver_text(credits: _Credits) -> str:
    return receiver_text((ledger.receiver for ledger in credits.ledgers()),
                         "the receiver has not opened the link yet (no get of it has run)")

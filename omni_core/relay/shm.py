"""The ``shm`` relay: tensors through a pre-allocated, credit-bounded shared-memory pool.

Each sending process owns one pool per target process: a /dev/shm segment of ``slots`` slots of
``slot_bytes`` bytes, created and pre-faulted on the first ``put`` to that target and reused for
the rest of the run. ``put`` copies the tensors into a run of consecutive free slots (one copy in;
a CUDA tensor is copied to host here, since the relay declares only ``cpu``); ``get`` returns
tensors viewing the receiver's mapping of the pool (zero copy), valid until ``release``.

Credits and back-pressure. A put takes ``ceil(bytes / slot_bytes)`` consecutive slots (at least
one per put, so ``slots`` bounds the puts in flight toward one target). When they are not free,
``put`` waits in FIFO order: a short spin of event-loop yields, then sleeps backing off to 5 ms (no
core burnt), until the receiver releases or ``timeout`` seconds pass; then it raises
:class:`~omni_core.relay.base.RelayTimeout` naming the target, the receiver pid (and whether it is
dead) and the requests holding the credits. When the receiver is seen dead the wait ends after
one more second instead, leaving the runtime that time to ``cleanup`` its requests.

No back-channel. Slot state lives in the segment header (see :mod:`.shm_segment`): the sender
writes the span's ticket to ``issued``, the receiver writes it to ``released`` when done; the
sender reclaims released spans before each allocation (lowest slots first, so they stay warm). ``cleanup(request_id)`` on the sender abandons the
spans of that request (a late release of their tickets can never free a reissued span).

Small transfers (fewer bytes than ``inline_below``, 64 KiB by default) skip the pool: their bytes
travel as frames of the control message, exactly as the ``inline`` relay sends them. For a
stream's per-step chunk (a hidden state of a few KiB) one copy into a frame costs less than a
slot's reservation, handle, mapping and release, and holds no credit; the stream's own credits
and the pipeline's admission bound what is in flight. ``get`` tells the two apart by the frames
(a pool transfer has none) and checks an inline transfer's frames against its handle as
``inline`` does.

Oversized transfers (more bytes than the whole pool) go through a one-off segment of their exact
size, at most one in flight per target (the next waits for its release), so nothing deadlocks and
memory stays bounded; they pay for new memory (page faults, roughly 1 to 2.5 GB/s instead of the
pool's memcpy speed), so size ``slots * slot_bytes`` above the largest common payload.

Lifetime. Segment names are ``omni-<run_id>-p<pid>-<tag>``; ``sweep`` unlinks those whose owner
is dead. ``close`` unlinks every segment this process created and unmaps every mapping (a mapping
that tensors still view is unmapped when they are freed). Receivers map lazily and cache pool
mappings. All methods run on one event loop thread.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import os
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import msgspec
import torch

from . import checks
from .base import InvalidHandle, Relay, RelayContext, Transfer
from .dtypes import DTYPES, dtype_from_name, dtype_name
from .inline import inline_tensors, inline_transfer
from .kit import CreditWait, dead_wait_text, receiver_text, relay_options, wait_for_credit
from .shm_segment import (
    ONEOFF,
    Segment,
    ShmRelayError,
    clean,
    parse_name,
    process_alive,
    run_token,
    segment_name,
    sweep,
)
from .specs import SHM_CAPABILITIES, SHM_OPTIONS

__all__ = ["ShmRelay", "ShmRelayError"]

_ALIGN = 64
_MEMMOVE_BELOW = 4 << 20
DEFAULTS = {name: option.default for name, option in SHM_OPTIONS.items()}


class Handle(msgspec.Struct, array_like=True):
    segment: str  # "" when the tensors hold no bytes
    slot: int
    ticket: int
    request_id: int
    base: int  # byte offset of the span in the data region
    offsets: list[int]
    dtypes: list[str]
    shapes: list[list[int]]


_DTYPE_NAMES = {dt: dtype_name(dt) for dt in DTYPES.values()}
# A handle's wire format, public: the tests that forge handles write it with these.
encode_handle = msgspec.msgpack.Encoder().encode
decode_handle = msgspec.msgpack.Decoder(Handle).decode


@attrs.define
class _Span:
    slot: int
    nslots: int
    ticket: int
    request_id: int


class _Pool:
    """The sender's credits toward one target: the slots of one pre-faulted segment."""

    def __init__(self, seg: Segment):
        self.seg = seg
        self.occupied = bytearray(seg.slots)
        self.spans: dict[int, _Span] = {}
        self.waiters: collections.deque = collections.deque()

    def take(self, nslots: int, request_id: int, ticket: int) -> _Span | None:
        # Reclaim first, so the lowest (most recently used, cache-warm) slots are reused.
        self._reclaim()
        slot = self.occupied.find(bytes(nslots))
        if slot < 0:
            return None
        span = self.spans[slot] = _Span(slot, nslots, ticket, request_id)
        self.occupied[slot : slot + nslots] = b"\x01" * nslots
        self.seg.set_issued(slot, ticket)
        return span

    def _reclaim(self) -> None:
        released = self.seg.released
        for span in [s for s in self.spans.values() if released(s.slot) == s.ticket]:
            self.free(span)

    def free(self, span: _Span) -> None:
        if self.spans.get(span.slot) is span:
            del self.spans[span.slot]
            self.occupied[span.slot : span.slot + span.nslots] = bytes(span.nslots)

    def abandon(self, request_id: int) -> None:
        for span in [s for s in self.spans.values() if s.request_id == request_id]:
            self.free(span)

    def abandon_below(self, floor: int) -> None:
        for span in [s for s in self.spans.values() if s.request_id < floor]:
            self.free(span)

    def holders(self) -> list[int]:
        self._reclaim()
        return sorted({s.request_id for s in self.spans.values()})


class _Oneoffs:
    """Transfers larger than the pool toward one target: a segment each, one in flight at a time."""

    def __init__(self) -> None:
        self.live: dict[str, tuple[Segment, _Span]] = {}
        self.waiters: collections.deque = collections.deque()

    def reclaim(self) -> None:
        for name, (seg, span) in list(self.live.items()):
            if seg.released(0) == span.ticket:
                self.drop(name)

    def drop(self, name: str) -> None:
        seg, _ = self.live.pop(name)
        seg.unlink()
        seg.close()

    def abandon(self, request_id: int) -> None:
        for name in [n for n, (_, s) in self.live.items() if s.request_id == request_id]:
            self.drop(name)

    def abandon_below(self, floor: int) -> None:
        for name in [n for n, (_, s) in self.live.items() if s.request_id < floor]:
            self.drop(name)

    def holders(self) -> list[int]:
        self.reclaim()
        return sorted({s.request_id for _, s in self.live.values()})


def _layout(tensors: Sequence[Any]) -> tuple[list[int], int]:
    """Byte offsets (64-aligned) of each tensor in a span, and the span's size."""
    offsets, cursor = [], 0
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise TypeError(f"shm relay: item {i} is a {type(t).__name__} "
                            f"{getattr(t, 'layout', '')}, not a dense torch.Tensor")
        if t.dtype not in _DTYPE_NAMES:
            dtype_from_name(dtype_name(t.dtype))  # raises: unsupported dtype, before any copy
        offset = -(-cursor // _ALIGN) * _ALIGN
        offsets.append(offset)
        cursor = offset + t.numel() * t.element_size()
    return offsets, cursor


def _options(options: dict[str, Any]) -> tuple[int, int, float, int]:
    """``(slot_bytes, slots, timeout, inline_below)`` from ``relay.options`` (other keys belong to
    other relays)."""
    values = relay_options("shm", SHM_OPTIONS, options)
    return (-(-values["slot_bytes"] // _ALIGN) * _ALIGN, values["slots"], float(values["timeout"]),
            values["inline_below"])


def _receiver_dead(segs: Sequence[Segment]) -> bool:
    """Whether a receiver mapped one of ``segs`` and has died since."""
    for seg in segs:
        pid, start = seg.receiver()
        if pid and not process_alive(pid, start):
            return True
    return False


def _receiver_text(segs: Sequence[Segment]) -> str:
    return receiver_text((seg.receiver() for seg in segs), "the receiver has not mapped them yet")


class ShmRelay(Relay):
    """Same-node transfers through per-target shared-memory pools (see the module docstring).

    Options (``relay.options``): ``slot_bytes`` (default 4 MiB), ``slots`` (credits per target,
    default 32), ``timeout`` (seconds a ``put`` waits for credits, default 30), ``inline_below``
    (transfers of fewer bytes go as frames, default 64 KiB; 0: never).
    """

    name = "shm"
    capabilities = SHM_CAPABILITIES

    def __init__(self, ctx: RelayContext):
        super().__init__(ctx)
        self.slot_bytes, self.slots, self.timeout, self.inline_below = _options(dict(ctx.options))
        self._pools: dict[str, _Pool] = {}
        self._oneoffs: dict[str, _Oneoffs] = {}
        self._tickets = itertools.count(1)
        self._serial = itertools.count()
        self._token = secrets.token_hex(3)  # names stay unique across instances and reused pids
        self._maps: dict[str, Segment] = {}  # receiver side: segments of other processes
        self._held: dict[bytes, int] = {}  # receiver side: handle -> request id, until release
        self._closed = False

    # -- sender ---------------------------------------------------------------------------------

    async def put(self, request_id: int, tensors: Sequence[torch.Tensor], target: str) -> Transfer:
        if self._closed:
            raise ShmRelayError("shm relay: put after close")
        offsets, nbytes = _layout(tensors)
        if 0 < nbytes < self.inline_below and all(t.device.type == "cpu" for t in tensors):
            return inline_transfer(tensors)
        dtypes = [_DTYPE_NAMES[t.dtype] for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        if nbytes == 0:
            return Transfer(encode_handle(Handle("", 0, 0, request_id, 0, offsets, dtypes, shapes)))
        seg, span, release = await self._reserve(request_id, nbytes, target)
        base = span.slot * seg.slot_bytes
        try:
            for t, offset in zip(tensors, offsets, strict=True):
                _copy_in(seg, base + offset, t)
        except BaseException:
            release()
            raise
        handle = Handle(seg.name, span.slot, span.ticket, request_id, base, offsets, dtypes, shapes)
        return Transfer(encode_handle(handle))

    async def _reserve(self, request_id: int, nbytes: int, target: str):
        """``(segment, span, undo)`` for ``nbytes`` toward ``target``, waiting for credits."""
        nslots = -(-nbytes // self.slot_bytes)
        if nslots <= self.slots:
            pool = self._pool(target)
            span = None if pool.waiters else pool.take(nslots, request_id, next(self._tickets))
            if span is not None:  # the common case: credits available, nobody queued
                return pool.seg, span, lambda: pool.free(span)
            segs = (pool.seg,)
            wait = self._wait(pool.waiters, target, nbytes, pool.holders, lambda: segs)
            span = await wait_for_credit(wait, lambda: pool.take(nslots, request_id, next(self._tickets)))
            return pool.seg, span, lambda: pool.free(span)
        big = self._oneoffs.setdefault(target, _Oneoffs())
        wait = self._wait(big.waiters, target, nbytes, big.holders,
                          lambda: [seg for seg, _ in big.live.values()])
        seg = await wait_for_credit(wait, lambda: self._take_oneoff(big, target, nbytes, request_id))
        return seg, big.live[seg.name][1], lambda: big.drop(seg.name)

    def _wait(self, waiters, target: str, nbytes: int, holders: Callable[[], list[int]],
              segs: Callable[[], Sequence[Segment]]) -> CreditWait:
        def why(dead: bool) -> str:
            return (
                f"shm relay: put of {nbytes} bytes from process {self.ctx.process!r} to process "
                f"{target!r} waited {dead_wait_text(dead, self.timeout)} for credits ({self.slots} slots of {self.slot_bytes} "
                f"bytes), held by requests {holders()[:10]}; {_receiver_text(segs())}. The runtime "
                "frees a dead receiver's credits with cleanup(request_id); raise relay.options "
                "timeout or slots if the receiver is merely slow"
            )

        return CreditWait(waiters, self.timeout, lambda: _receiver_dead(segs()), why, lambda: self._closed,
                          lambda: ShmRelayError("shm relay: closed while a put waited for credits"))

    def _pool(self, target: str) -> _Pool:
        pool = self._pools.get(target)
        if pool is None:
            name = self._name(target, "pool")
            pool = self._pools[target] = _Pool(Segment.create(name, self.slots, self.slot_bytes))
        return pool

    def _take_oneoff(self, big: _Oneoffs, target: str, nbytes: int, request_id: int):
        big.reclaim()
        if big.live:
            return None
        name = self._name(target, "big")
        seg = Segment.create(name, 1, -(-nbytes // _ALIGN) * _ALIGN, kind=ONEOFF)
        span = _Span(0, 1, next(self._tickets), request_id)
        seg.set_issued(0, span.ticket)
        big.live[name] = (seg, span)
        return seg

    def _name(self, target: str, kind: str) -> str:
        if not isinstance(target, str) or not target:
            raise ValueError(f"shm relay: target must be a process name, got {target!r}")
        tag = f"{clean(self.ctx.process, 30)}.{clean(target, 30)}.{kind}{next(self._serial)}.{self._token}"
        return segment_name(self.ctx.run_id, os.getpid(), tag)

    # -- receiver -------------------------------------------------------------------------------

    async def get(self, handle: bytes, frames: Sequence[Any] = ()) -> list[torch.Tensor]:
        if self._closed:
            raise ShmRelayError("shm relay: get after close")
        key = bytes(handle)
        if frames:  # a small transfer: its bytes came as frames (a pool transfer has none)
            return inline_tensors(key, frames)
        h = checks.decode(decode_handle, key, "shm")
        specs = checks.tensor_specs(h.dtypes, h.shapes, "shm", ("offsets", h.offsets))
        if not h.segment:
            checks.no_bytes(specs, "shm")
            return [torch.empty(shape, dtype=dtype) for dtype, shape, _ in specs]
        seg = self._map(self._check_name(h.segment))
        checks.index(h.slot, seg.slots, "shm", "slot")
        if type(h.base) is not int or h.base != h.slot * seg.slot_bytes:
            raise InvalidHandle(f"shm relay: handle's span starts at byte {h.base!r}, not at its "
                                f"slot {h.slot} of {seg.slot_bytes} bytes")
        checks.spans(specs, h.offsets, seg.slots * seg.slot_bytes - h.base, "shm",
                     f"segment {h.segment} from its slot {h.slot}")
        if type(h.ticket) is not int or h.ticket <= 0 or seg.issued(h.slot) != h.ticket:
            raise ShmRelayError(
                f"shm relay: handle of request {h.request_id} is stale: its sender reclaimed the "
                "slot (the request was cleaned up or aborted)"
            )
        data = seg.data
        assert data is not None, "_map() returns only open segments"
        storage = data.untyped_storage()
        out = []
        for (dtype, shape, _), offset in zip(specs, h.offsets, strict=True):
            # A view of the pool's storage (offsets are 64-aligned, so in whole elements).
            # torch's stubs want a stride with a size; set_() itself makes it contiguous without.
            out.append(torch.empty(0, dtype=dtype).set_(  # type: ignore[call-overload]
                storage, (h.base + offset) // dtype.itemsize, shape))
        self._held[key] = h.request_id
        return out

    def _check_name(self, name: Any) -> str:
        """``name`` if it is a segment of this run (a plain name, this run's prefix, a live
        segment of this relay's format); :class:`InvalidHandle` otherwise: a forged name must not
        open or map any other file."""
        prefix = f"omni-{run_token(self.ctx.run_id)}-p"
        checks.resource_name(name, prefix, "shm", "segment")
        parsed = parse_name(name)
        if parsed is None or parsed[0] != run_token(self.ctx.run_id):
            raise InvalidHandle(f"shm relay: handle names segment {name!r}, which is not one of "
                                "this run's")
        return name

    def owns(self, tensor: Any) -> bool:
        """Tensors viewing a mapped segment: the slot is reused once released."""
        if not self._maps or not tensor.numel() or tensor.device.type != "cpu":
            return False  # no segment mapped: small transfers (frames) only
        return any(seg.contains(tensor) for seg in self._maps.values())

    def _map(self, name: str) -> Segment:
        seg = self._maps.get(name)
        if seg is None:
            for old in [n for n, m in self._maps.items() if not m.owner_alive()]:
                self._maps.pop(old).close()  # a dead sender's pool: it will never be used again
            seg = self._maps[name] = Segment.open(name)
            seg.set_receiver(os.getpid())
        return seg

    def release(self, handle: bytes) -> None:
        key = bytes(handle)
        self._held.pop(key, None)
        try:
            h = decode_handle(key)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # a small transfer's (frames: nothing to release), or never one of ours
        if not h.segment or self._closed:
            return
        seg = self._maps.get(h.segment)
        if seg is None:
            try:
                seg = self._map(self._check_name(h.segment))
            except ShmRelayError:
                return  # the sender already dropped it
            except InvalidHandle:
                return
        if type(h.slot) is not int or not 0 <= h.slot < seg.slots:
            return
        seg.release(h.slot, h.ticket)
        if seg.kind == ONEOFF:
            self._maps.pop(h.segment).close()

    # -- both -----------------------------------------------------------------------------------

    def open_links(self) -> dict[str, dict[str, dict[str, Any]]]:
        """What this relay holds open toward other processes, a read-only snapshot for leak checks:
        ``{"sending": {target: {"held": [request ids], "oneoff": [request ids], "waiting": n}},
        "receiving": {segment: {"oneoff": bool}}}``: per target, the requests holding slots of its
        pool and its one-off segment, and how many puts wait for credits; per segment of another
        process this one has mapped, whether it is a one-off. Both are empty after :meth:`close`;
        a refused handle maps nothing."""
        sending: dict[str, dict[str, Any]] = {}
        for target in {*self._pools, *self._oneoffs}:
            pool, big = self._pools.get(target), self._oneoffs.get(target)
            waiting = (len(pool.waiters) if pool else 0) + (len(big.waiters) if big else 0)
            sending[target] = {"held": pool.holders() if pool else [],
                               "oneoff": big.holders() if big else [], "waiting": waiting}
        receiving = {name: {"oneoff": seg.kind == ONEOFF} for name, seg in self._maps.items()}
        return {"sending": sending, "receiving": receiving}

    def debug_state(self) -> dict[str, int]:
        for pool in self._pools.values():
            pool._reclaim()
        for big in self._oneoffs.values():
            big.reclaim()
        return {"received": len(self._held),
                "sent": sum(len(p.spans) for p in self._pools.values())
                + sum(len(b.live) for b in self._oneoffs.values())}

    def cleanup(self, request_id: int) -> None:
        for key in [k for k, rid in self._held.items() if rid == request_id]:
            self.release(key)
        for pool in self._pools.values():
            pool.abandon(request_id)
        for big in self._oneoffs.values():
            big.abandon(request_id)

    def cleanup_below(self, floor: int) -> None:
        for key in [k for k, rid in self._held.items() if rid < floor]:
            self.release(key)
        for pool in self._pools.values():
            pool.abandon_below(floor)
        for big in self._oneoffs.values():
            big.abandon_below(floor)

    def close(self) -> None:
        self._closed = True
        for pool in self._pools.values():
            pool.seg.unlink()
            pool.seg.close()
        for big in self._oneoffs.values():
            for name in list(big.live):
                big.drop(name)
        for seg in self._maps.values():
            seg.close()
        self._pools.clear()
        self._oneoffs.clear()
        self._maps.clear()
        self._held.clear()

    @classmethod
    def sweep(cls, run_id: str | None = None, *, dry_run: bool = False) -> list[str]:
        return sweep(run_id, dry_run=dry_run)


def _copy_in(seg: Segment, offset: int, t: torch.Tensor) -> None:
    """Copy ``t`` into ``seg``'s data at ``offset``: a plain memmove for small contiguous host
    tensors (torch's per-call overhead dominates there), torch ``copy_`` otherwise (strides,
    conjugate views, device to host; several intra-op threads may share a large copy)."""
    size = t.numel() * t.element_size()
    if not size:
        return
    data = seg.data
    assert data is not None, "a sender writes only into its own open segments"
    if (size < _MEMMOVE_BELOW and t.device.type == "cpu" and t.is_contiguous()
            and not t.is_conj() and not t.is_neg()):
        ctypes.memmove(data.data_ptr() + offset, t.data_ptr(), size)
        return
    dst = data[offset : offset + size].view(t.dtype).view(t.shape)
    dst.copy_(t.detach())

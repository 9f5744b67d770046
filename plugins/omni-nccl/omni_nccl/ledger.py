"""The ledger of one link: a small file in the run's runtime dir that both ends map.

The relay protocol has no back-channel from the receiver to the sender, and a torch.distributed
pair is a poor one (a pending receive in the wrong direction blocks the pair). The ledger is the
back-channel: the sender creates it when it opens a link, the receiver maps it when the first
handle of that link arrives, and each 64-bit word has exactly one writer, so neither a lock nor
an atomic read-modify-write is needed.

Layout (little-endian int64 words)::

    word 0  magic "OMNINCCL"           word 6  credits (slots)
    word 1  layout version             word 7  ring entries
    word 2  sender pid                 word 8  received: last sequence number the receiver took
    word 3  sender start time          word 9  sender closed (1 once the sender dropped the link)
    word 4  receiver pid (receiver)    word 10 receiver closed (1 once the receiver's relay closed)
    word 5  receiver start time        word 11 device kind (1: cpu through gloo, 2: cuda through nccl)
                                       word 12 sender connecting (1 once it builds its end of the group)
    words 16 ..                        issued[slot]: ticket the sender put there (0: abandoned)
    then                               released[slot]: ticket the receiver released
    then, per ring entry               seq, nbytes, slot, ticket, request_id (seq written last)

Credits: a ``put`` takes a free slot and writes its ticket to ``issued``; the receiver writes the
same ticket to ``released`` when it is done; the sender reclaims lazily. Tickets are unique per
sender, so a late release never frees a reissued slot, and an abandoned slot (``issued`` = 0)
tells the receiver to discard that transfer when it arrives.

Ring: the sender describes every transfer it posts (its sequence number, size, slot, ticket and
request) before ``put`` returns. The receiver reads the ring to take transfers in order, including
ones whose ``get`` never comes (an aborted request): that is what keeps the pair in step.
"""

from __future__ import annotations

import contextlib
import mmap
import os

from omni_core.errors import OmniError
from omni_core.relay.liveness import process_alive, process_start_time  # noqa: F401 - re-exported

MAGIC = int.from_bytes(b"OMNINCCL", "little")
VERSION = 1
CPU, CUDA = 1, 2
KINDS = {"cpu": CPU, "cuda": CUDA}
_W_MAGIC, _W_VERSION, _W_SENDER, _W_SENDER_START, _W_RECEIVER, _W_RECEIVER_START = range(6)
_W_CREDITS, _W_RING, _W_RECEIVED, _W_SENDER_CLOSED, _W_RECEIVER_CLOSED, _W_KIND = range(6, 12)
_W_CONNECTING = 12
_W_SLOTS = 16
_ENTRY = 5  # words per ring entry


class LedgerError(OmniError):
    """A link's ledger file is missing or is not one this relay wrote."""


class Ledger:
    """One mapped ledger file (see the module docstring)."""

    def __init__(self, path: str, mm: mmap.mmap):
        self.path = path
        self._mm = mm
        self.words = memoryview(mm).cast("q")
        if (self.words[_W_MAGIC], self.words[_W_VERSION]) != (MAGIC, VERSION):
            self.close()
            raise LedgerError(f"{path} is not a link ledger of this relay version")
        self.credits = self.words[_W_CREDITS]
        self.ring = self.words[_W_RING]
        self._released = _W_SLOTS + self.credits
        self._entries = _W_SLOTS + 2 * self.credits

    @staticmethod
    def size(credits: int, ring: int) -> int:
        return (_W_SLOTS + 2 * credits + _ENTRY * ring) * 8

    @classmethod
    def create(cls, path: str, credits: int, ring: int, kind: str) -> Ledger:
        """Create the ledger of a new link (the sender). The file appears complete or not at
        all: it is written under a temporary name and then linked into place."""
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, cls.size(credits, ring))
            mm = mmap.mmap(fd, cls.size(credits, ring), flags=mmap.MAP_SHARED)
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        words = memoryview(mm).cast("q")
        pid = os.getpid()
        for index, value in ((_W_VERSION, VERSION), (_W_SENDER, pid), (_W_KIND, KINDS[kind]),
                             (_W_SENDER_START, process_start_time(pid)), (_W_CREDITS, credits),
                             (_W_RING, ring), (_W_MAGIC, MAGIC)):
            words[index] = value
        words.release()
        try:
            os.link(tmp, path)  # unlike rename, never replaces an existing link's file
        except BaseException:
            mm.close()
            raise
        finally:
            os.unlink(tmp)
        return cls(path, mm)

    @classmethod
    def open(cls, path: str) -> Ledger:
        """Map an existing ledger (the receiver)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise LedgerError(f"{path} does not exist") from None
        try:
            mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return cls(path, mm)

    # -- both ends ------------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        return "cuda" if self.words[_W_KIND] == CUDA else "cpu"

    @property
    def sender(self) -> tuple[int, int]:
        return self.words[_W_SENDER], self.words[_W_SENDER_START]

    @property
    def receiver(self) -> tuple[int, int]:
        return self.words[_W_RECEIVER], self.words[_W_RECEIVER_START]

    @property
    def receiver_closed(self) -> bool:
        return bool(self.words[_W_RECEIVER_CLOSED])

    def sender_gone(self) -> bool:
        return bool(self.words[_W_SENDER_CLOSED]) or not process_alive(*self.sender)

    def receiver_gone(self) -> bool:
        """Whether a receiver joined and has since closed its relay or died."""
        pid, start = self.receiver
        return bool(pid) and (bool(self.words[_W_RECEIVER_CLOSED]) or not process_alive(pid, start))

    def issued(self, slot: int) -> int:
        return self.words[_W_SLOTS + slot]

    def released(self, slot: int) -> int:
        return self.words[self._released + slot]

    @property
    def received(self) -> int:
        return self.words[_W_RECEIVED]

    # -- the sender's words ---------------------------------------------------------------------

    def issue(self, slot: int, ticket: int) -> None:
        self.words[_W_SLOTS + slot] = ticket

    def abandon(self, slot: int, ticket: int) -> None:
        """The sender gave up the transfer in ``slot`` (its request was cleaned up)."""
        if self.words[_W_SLOTS + slot] == ticket:
            self.words[_W_SLOTS + slot] = 0

    def post(self, seq: int, nbytes: int, slot: int, ticket: int, request_id: int) -> None:
        """Describe transfer ``seq`` in the ring; the caller checked that its entry is free."""
        base = self._entries + (seq % self.ring) * _ENTRY
        for i, value in enumerate((nbytes, slot, ticket, request_id), 1):
            self.words[base + i] = value
        self.words[base] = seq

    def mark_sender_closed(self) -> None:
        self.words[_W_SENDER_CLOSED] = 1

    def mark_connecting(self) -> None:
        """The sender saw its receiver join and now builds its end of the group."""
        self.words[_W_CONNECTING] = 1

    @property
    def connecting(self) -> bool:
        return bool(self.words[_W_CONNECTING])

    # -- the receiver's words -------------------------------------------------------------------

    def join(self) -> None:
        pid = os.getpid()
        self.words[_W_RECEIVER_START] = process_start_time(pid)
        self.words[_W_RECEIVER] = pid

    def entry(self, seq: int) -> tuple[int, int, int, int] | None:
        """``(nbytes, slot, ticket, request_id)`` of transfer ``seq`` once the sender posted it."""
        base = self._entries + (seq % self.ring) * _ENTRY
        if self.words[base] != seq:
            return None
        return tuple(self.words[base + 1 : base + _ENTRY])  # type: ignore[return-value]

    def set_received(self, seq: int) -> None:
        self.words[_W_RECEIVED] = seq

    def release(self, slot: int, ticket: int) -> None:
        self.words[self._released + slot] = ticket

    def mark_receiver_closed(self) -> None:
        self.words[_W_RECEIVER_CLOSED] = 1

    # -- lifetime -------------------------------------------------------------------------------

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        if self._mm.closed:
            return
        self.words.release()
        self._mm.close()

    @property
    def closed(self) -> bool:
        return self._mm.closed


"""The ledger of one link: a small file in the run's runtime dir that both ends map.

The relay protocol has no back-channel from the receiver to the sender; the ledger is one. The
sender creates it on its first ``put`` toward a target, the receiver maps it when the first handle
of that link reaches its ``get``. Every 64-bit word has exactly one writer.

Layout (little-endian int64 words)::

    word 0  magic "OMNICIPC"           word 5  receiver start time
    word 1  layout version             word 6  credits (slots)
    word 2  sender pid                 word 7  sender closed (1 once the sender dropped the link)
    word 3  sender start time          word 8  receiver closed (1 once the receiver's relay closed)
    word 4  receiver pid (receiver)
    words 16 + 4*slot ..               issued, abandoned (sender), taken, released (receiver)

A slot is one credit: the sender keeps the tensors of the transfer in it alive (pinned) from
``put`` until the receiver writes its ticket to ``released``.

Claims. A transfer can be given up by the sender (``cleanup`` of its request) while the
receiver is about to open it. Who wins decides who returns torch's IPC reference count, so the
two steps are made exclusive with a POSIX record lock on the slot (``fcntl.lockf``, a few
microseconds): the receiver *claims* (``taken`` = ticket) only if the slot still holds the
ticket and was not abandoned; the sender *abandons* and learns whether the receiver had claimed.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os

from omni_core.errors import OmniError
from omni_core.relay.liveness import process_alive, process_start_time  # noqa: F401 - re-exported

MAGIC = int.from_bytes(b"OMNICIPC", "little")
VERSION = 1
_W_MAGIC, _W_VERSION, _W_SENDER, _W_SENDER_START, _W_RECEIVER, _W_RECEIVER_START = range(6)
_W_CREDITS, _W_SENDER_CLOSED, _W_RECEIVER_CLOSED = 6, 7, 8
_W_SLOTS = 16
_ISSUED, _ABANDONED, _TAKEN, _RELEASED = range(4)


class LedgerError(OmniError):
    """A link's ledger file is missing or is not one this relay wrote."""


class Ledger:
    """One mapped ledger file (see the module docstring). Keeps its file open for the claim locks."""

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd = fd
        self._mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
        self.words = memoryview(self._mm).cast("q")
        if len(self.words) < _W_SLOTS or (self.words[_W_MAGIC], self.words[_W_VERSION]) != (MAGIC, VERSION):
            self.words.release()
            self._mm.close()  # the caller closes the file
            raise LedgerError(f"{path} is not a cuda_ipc link ledger of this relay version")
        self.credits = self.words[_W_CREDITS]

    @staticmethod
    def size(credits: int) -> int:
        return (_W_SLOTS + 4 * credits) * 8

    @classmethod
    def create(cls, path: str, credits: int) -> Ledger:
        """Create the ledger of a new link (the sender); it appears complete or not at all."""
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, cls.size(credits))
            with mmap.mmap(fd, cls.size(credits), flags=mmap.MAP_SHARED) as mm:
                words = memoryview(mm).cast("q")
                pid = os.getpid()
                for index, value in ((_W_VERSION, VERSION), (_W_SENDER, pid), (_W_CREDITS, credits),
                                     (_W_SENDER_START, process_start_time(pid)), (_W_MAGIC, MAGIC)):
                    words[index] = value
                words.release()
            os.link(tmp, path)  # unlike rename, never replaces an existing link's file
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)
        return cls(path, fd)

    @classmethod
    def open(cls, path: str) -> Ledger:
        """Map an existing ledger (the receiver)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise LedgerError(f"{path} does not exist") from None
        try:
            return cls(path, fd)
        except BaseException:
            os.close(fd)
            raise

    def _word(self, slot: int, field: int) -> int:
        return _W_SLOTS + 4 * slot + field

    @contextlib.contextmanager
    def _locked(self, slot: int):
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, slot)
        try:
            yield
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, slot)

    # -- both ends ------------------------------------------------------------------------------

    @property
    def sender(self) -> tuple[int, int]:
        return self.words[_W_SENDER], self.words[_W_SENDER_START]

    @property
    def receiver(self) -> tuple[int, int]:
        return self.words[_W_RECEIVER], self.words[_W_RECEIVER_START]

    @property
    def sender_closed(self) -> bool:
        return bool(self.words[_W_SENDER_CLOSED])

    @property
    def receiver_closed(self) -> bool:
        return bool(self.words[_W_RECEIVER_CLOSED])

    def sender_gone(self) -> bool:
        return bool(self.words[_W_SENDER_CLOSED]) or not process_alive(*self.sender)

    def receiver_gone(self) -> bool:
        """Whether a receiver joined and has since closed its relay or died."""
        pid, start = self.receiver
        return bool(pid) and (self.receiver_closed or not process_alive(pid, start))

    def issued(self, slot: int) -> int:
        return self.words[self._word(slot, _ISSUED)]

    def taken(self, slot: int) -> int:
        return self.words[self._word(slot, _TAKEN)]

    def released(self, slot: int) -> int:
        return self.words[self._word(slot, _RELEASED)]

    # -- the sender's words ---------------------------------------------------------------------

    def issue(self, slot: int, ticket: int) -> None:
        self.words[self._word(slot, _ISSUED)] = ticket

    def abandon(self, slot: int, ticket: int) -> bool:
        """Give up the transfer ``ticket`` in ``slot``; True when the receiver had claimed it
        (it holds torch's reference and returns it when its tensors die), False when it never
        will (the caller returns the reference)."""
        with self._locked(slot):
            self.words[self._word(slot, _ABANDONED)] = ticket
            return self.words[self._word(slot, _TAKEN)] == ticket

    def mark_sender_closed(self) -> None:
        self.words[_W_SENDER_CLOSED] = 1

    # -- the receiver's words -------------------------------------------------------------------

    def join(self) -> None:
        pid = os.getpid()
        self.words[_W_RECEIVER_START] = process_start_time(pid)
        self.words[_W_RECEIVER] = pid

    def claim(self, slot: int, ticket: int) -> bool:
        """Take the transfer ``ticket`` in ``slot`` unless the sender gave it up or reused the
        slot; once claimed, the sender leaves torch's reference count to the receiver."""
        with self._locked(slot):
            if (self.words[self._word(slot, _ISSUED)] != ticket
                    or self.words[self._word(slot, _ABANDONED)] == ticket):
                return False
            self.words[self._word(slot, _TAKEN)] = ticket
            return True

    def release(self, slot: int, ticket: int) -> None:
        self.words[self._word(slot, _RELEASED)] = ticket

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
        os.close(self._fd)

    @property
    def closed(self) -> bool:
        return self._mm.closed

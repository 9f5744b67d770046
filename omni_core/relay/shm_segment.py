"""Shared-memory segments of the ``shm`` relay: names, header, mapping, owner liveness, sweep.

A segment is a file in ``/dev/shm`` named ``omni-<run_id>-p<owner pid>-<tag>``, opened with
``os.open`` and mapped with ``mmap`` (``multiprocessing.shared_memory`` is avoided: before Python
3.13 its resource tracker unlinks or warns about segments that other processes own). The space is
reserved with ``posix_fallocate`` when the segment is created, so a full ``/dev/shm`` is a clear
error at creation instead of a SIGBUS on first write, and mappings are pre-faulted (``MAP_POPULATE``).

Layout: 64-bit little-endian words, then the data region at a page boundary::

    word 0  magic "OMNISHM1"          word 5  slot_bytes
    word 1  layout version            word 6  data offset (bytes)
    word 2  owner pid                 word 7  receiver pid (written by the receiver when it maps)
    word 3  owner start time          word 8  receiver start time
    word 4  slots                     word 9  kind (1: pool, 2: one-off)
                                      word 10 owner's pid namespace (inode of /proc/self/ns/pid)
    words 16 .. 16+slots-1            issued[slot]: ticket of the span starting there (owner writes)
    words 16+slots .. 16+2*slots-1    released[slot]: ticket the receiver released (receiver writes)

Each word has exactly one writer, so no lock or atomic read-modify-write is needed; tickets are
unique per owner, so a late release of an old ticket can never free a newer span.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re

import numpy as np
import torch

from .base import RelayError
from .liveness import process_alive, process_start_time  # noqa: F401 - re-exported

SHM_DIR = "/dev/shm"
PAGE = 4096
MAGIC = int.from_bytes(b"OMNISHM1", "little")
VERSION = 1
POOL, ONEOFF = 1, 2
_W_MAGIC, _W_VERSION, _W_OWNER, _W_OWNER_START, _W_SLOTS, _W_SLOT_BYTES = range(6)
_W_DATA, _W_RECV, _W_RECV_START, _W_KIND, _W_PIDNS = 6, 7, 8, 9, 10
_W_TICKETS = 16
_NAME_RE = re.compile(r"^omni-(?P<run>.+)-p(?P<pid>\d+)-(?P<tag>[A-Za-z0-9_.]+)$")


class ShmRelayError(RelayError):
    """A shared-memory segment could not be created, opened or used."""


def clean(text: str, limit: int = 40) -> str:
    """``text`` reduced to characters safe in a segment tag (no ``-``, which separates fields)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", text)[:limit] or "_"


def run_token(run_id: str) -> str:
    """The run id as it appears in segment names (``/`` and control characters replaced)."""
    if not run_id:
        raise ValueError("shm relay: the run id is empty")
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", run_id)[:100]


def segment_name(run_id: str, pid: int, tag: str) -> str:
    return f"omni-{run_token(run_id)}-p{pid}-{clean(tag, 120)}"


def parse_name(name: str) -> tuple[str, int] | None:
    """``(run token, owner pid)`` of a segment name, or None for names this relay never makes."""
    match = _NAME_RE.match(name)
    return (match["run"], int(match["pid"])) if match else None


def pid_namespace() -> int:
    """An id of this process's pid namespace: pids from another one say nothing about liveness."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class Segment:
    """One mapped segment: header words, ticket arrays, and ``data`` (a uint8 tensor over the data
    region). ``close`` unmaps it once no tensor views it any more (immediately when none does)."""

    def __init__(self, name: str, mm: mmap.mmap):
        self.name = name
        self._mm = mm
        header = int.from_bytes(mm[:8], "little"), int.from_bytes(mm[8:16], "little")
        if header != (MAGIC, VERSION):
            mm.close()
            raise ShmRelayError(f"shm relay: /dev/shm/{name} is not a segment of this relay version")
        self.slots = int.from_bytes(mm[_W_SLOTS * 8 : _W_SLOTS * 8 + 8], "little")
        self.slot_bytes = int.from_bytes(mm[_W_SLOT_BYTES * 8 : _W_SLOT_BYTES * 8 + 8], "little")
        data_offset = int.from_bytes(mm[_W_DATA * 8 : _W_DATA * 8 + 8], "little")
        if (data_offset < (_W_TICKETS + 2 * self.slots) * 8
                or data_offset + self.slots * self.slot_bytes > len(mm)):
            mm.close()
            raise ShmRelayError(f"shm relay: /dev/shm/{name} has a header that does not fit its size")
        self.words = memoryview(mm)[:data_offset].cast("q")
        # Through numpy: its array holds a buffer export on the mmap for as long as any tensor
        # views it, so close() cannot unmap memory still in use (torch.frombuffer holds none).
        # None once closed.
        self.data: torch.Tensor | None = torch.from_numpy(
            np.frombuffer(mm, dtype=np.uint8, count=self.slots * self.slot_bytes, offset=data_offset)
        )
        self.kind = self.words[_W_KIND]

    @classmethod
    def create(cls, name: str, slots: int, slot_bytes: int, kind: int = POOL) -> Segment:
        """Create, reserve and pre-fault a new segment owned by this process."""
        data_offset = -(-(_W_TICKETS + 2 * slots) * 8 // PAGE) * PAGE
        size = data_offset + slots * slot_bytes
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                free = os.statvfs(SHM_DIR)
                raise ShmRelayError(
                    f"shm relay: cannot reserve {size / 2**20:.1f} MiB in {SHM_DIR} for {name} "
                    f"({exc.strerror}; {free.f_bavail * free.f_frsize / 2**20:.1f} MiB free): lower "
                    "relay.options slots or slot_bytes, or enlarge /dev/shm (docker: --shm-size)"
                ) from None
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        words = memoryview(mm)[:data_offset].cast("q")
        pid = os.getpid()
        for index, value in ((_W_VERSION, VERSION), (_W_OWNER, pid), (_W_SLOTS, slots),
                             (_W_OWNER_START, process_start_time(pid)), (_W_KIND, kind),
                             (_W_PIDNS, pid_namespace()),
                             (_W_SLOT_BYTES, slot_bytes), (_W_DATA, data_offset), (_W_MAGIC, MAGIC)):
            words[index] = value
        words.release()
        return cls(name, mm)

    @classmethod
    def open(cls, name: str) -> Segment:
        """Map an existing segment (a receiver's view of a sender's segment)."""
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            if not isinstance(exc, FileNotFoundError):
                raise ShmRelayError(f"shm relay: cannot open segment {name}: {exc.strerror}") from None
            raise ShmRelayError(
                f"shm relay: segment {name} is gone; its sender closed or was cleaned up "
                "(request aborted, sender restarted or the pipeline stopping)"
            ) from None
        try:
            mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except (OSError, ValueError) as exc:
            raise ShmRelayError(f"shm relay: cannot map segment {name}: {exc}") from None
        finally:
            os.close(fd)
        return cls(name, mm)

    def issued(self, slot: int) -> int:
        return self.words[_W_TICKETS + slot]

    def set_issued(self, slot: int, ticket: int) -> None:
        self.words[_W_TICKETS + slot] = ticket

    def released(self, slot: int) -> int:
        return self.words[_W_TICKETS + self.slots + slot]

    def release(self, slot: int, ticket: int) -> None:
        """Receiver side: give the span of ``ticket`` back, unless the owner already reissued it."""
        if self.issued(slot) == ticket:
            self.words[_W_TICKETS + self.slots + slot] = ticket

    def set_receiver(self, pid: int) -> None:
        self.words[_W_RECV_START] = process_start_time(pid)
        self.words[_W_RECV] = pid

    def owner_alive(self) -> bool:
        return process_alive(self.words[_W_OWNER], self.words[_W_OWNER_START])

    def receiver(self) -> tuple[int, int]:
        return self.words[_W_RECV], self.words[_W_RECV_START]

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s data starts in this segment (never once it is closed)."""
        data = self.data
        if data is None:
            return False
        start = data.data_ptr()
        return start <= tensor.data_ptr() < start + data.numel()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))

    def close(self) -> None:
        """Unmap now if nothing views the data any more, else when the last view is freed.
        Idempotent; the segment is unusable afterwards."""
        self.words.release()
        self.data = None
        with contextlib.suppress(BufferError):  # tensors still view it: unmapped when they go
            self._mm.close()


def sweep(run_id: str | None = None, *, dry_run: bool = False) -> list[str]:
    """Unlink segments whose owner process is dead (only ``run_id``'s when given); their names.
    ``dry_run``: only list them."""
    token = run_token(run_id) if run_id is not None else None
    namespace = pid_namespace()
    removed = []
    for name in sorted(os.listdir(SHM_DIR)):
        parsed = parse_name(name)
        if parsed is None or (token is not None and parsed[0] != token):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            head = os.pread(fd, 8 * (_W_PIDNS + 1), 0)
        finally:
            os.close(fd)
        words = [int.from_bytes(head[i : i + 8], "little") for i in range(0, len(head) - 7, 8)]
        if words and words[_W_MAGIC] not in (MAGIC, 0):
            continue  # not ours (another component using the omni- prefix); 0: creation cut short
        if len(words) > _W_PIDNS and words[_W_PIDNS] not in (0, namespace):
            continue  # a container sharing /dev/shm: its pids are not ours to judge
        owner_start = words[_W_OWNER_START] if len(words) > _W_OWNER_START else 0
        if process_alive(parsed[1], owner_start):
            continue
        if dry_run:
            removed.append(name)
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed

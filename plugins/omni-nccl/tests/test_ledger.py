"""The link ledger: layout, one writer per word, the ring, and what the sender sees of its
receiver."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from omni_nccl.ledger import Ledger, LedgerError, process_alive, process_start_time


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "nccl.run.a.b.cpu.p1.x.g1")


def test_create_writes_header_and_open_reads_it(path):
    sender = Ledger.create(path, credits=4, ring=16, kind="cuda")
    receiver = Ledger.open(path)
    assert (receiver.credits, receiver.ring, receiver.kind) == (4, 16, "cuda")
    assert receiver.sender == (os.getpid(), process_start_time(os.getpid()))
    assert receiver.receiver == (0, 0) and not sender.receiver_gone()
    assert not os.path.exists(path + ".tmp"), "created under a temporary name, then renamed"
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    for ledger in (sender, receiver):
        ledger.close()
        ledger.close()


def test_an_existing_link_name_is_never_reused(path):
    Ledger.create(path, 2, 16, "cpu").close()
    with pytest.raises(FileExistsError):
        Ledger.create(path, 2, 16, "cpu")


def test_open_refuses_missing_and_foreign_files(path, tmp_path):
    with pytest.raises(LedgerError, match="does not exist"):
        Ledger.open(path)
    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"x" * 4096)
    with pytest.raises(LedgerError, match="not a link ledger"):
        Ledger.open(str(foreign))


def test_credits_issue_release_and_abandon(path):
    sender = Ledger.create(path, 4, 16, "cpu")
    receiver = Ledger.open(path)
    sender.issue(2, 17)
    assert receiver.issued(2) == 17 and sender.released(2) == 0
    receiver.release(2, 17)
    assert sender.released(2) == 17
    sender.issue(2, 18)
    sender.abandon(2, 17)  # an old ticket: the reissued slot is untouched
    assert receiver.issued(2) == 18
    sender.abandon(2, 18)
    assert receiver.issued(2) == 0, "the receiver sees the abandoned transfer"
    sender.close()
    receiver.close()


def test_ring_entries_appear_once_posted_and_wrap(path):
    sender = Ledger.create(path, 2, 4, "cpu")
    receiver = Ledger.open(path)
    assert receiver.entry(1) is None
    sender.post(1, 100, 0, 7, 42)
    assert receiver.entry(1) == (100, 0, 7, 42)
    assert receiver.entry(5) is None, "entry 5 shares entry 1's place but was not posted"
    receiver.set_received(1)
    assert sender.received == 1
    sender.post(5, 3, 1, 8, -1)
    assert receiver.entry(5) == (3, 1, 8, -1) and receiver.entry(1) is None
    sender.close()
    receiver.close()


def test_receiver_join_close_and_death_are_visible_to_the_sender(path):
    sender = Ledger.create(path, 2, 16, "cpu")
    joined = multiprocessing.get_context("spawn").Process(target=_join_and_exit, args=(path,))
    joined.start()
    joined.join(60)
    assert joined.exitcode == 0
    pid, start = sender.receiver
    assert pid == joined.pid and start > 0
    assert not process_alive(pid, start) and sender.receiver_gone()
    mine = Ledger.open(path)
    mine.join()
    assert not sender.receiver_gone()
    mine.mark_receiver_closed()
    assert sender.receiver_gone() and sender.receiver_closed
    mine.close()
    sender.close()


def test_sender_close_and_death_are_visible_to_the_receiver(path):
    sender = Ledger.create(path, 2, 16, "cpu")
    receiver = Ledger.open(path)
    assert not receiver.sender_gone()
    sender.mark_sender_closed()
    assert receiver.sender_gone()
    sender.close()
    receiver.close()


def test_process_alive_tells_a_reused_pid_from_the_original():
    me = os.getpid()
    assert process_alive(me) and process_alive(me, process_start_time(me))
    assert not process_alive(me, process_start_time(me) + 1)
    assert not process_alive(0) and not process_alive(-1)


def _join_and_exit(path: str) -> None:
    ledger = Ledger.open(path)
    ledger.join()
    ledger.close()

"""Whether a process is alive, robust to pid reuse: for relays that keep the pids of their peers
(shm segment owners, ledger files of plugin relays) and must tell a dead peer from a slow one."""

from __future__ import annotations


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, start time in clock ticks)`` of a process, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19])


def process_start_time(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot); 0 when it does not exist."""
    stat = _proc_stat(pid)
    return stat[1] if stat else 0


def process_alive(pid: int, start_time: int = 0) -> bool:
    """Whether ``pid`` runs (not a zombie) and, when ``start_time`` is known, is the same process
    (not a later one that reused the pid)."""
    if pid <= 0:
        return False
    stat = _proc_stat(pid)
    if stat is None:
        return False
    state, started = stat
    if state in ("Z", "X"):
        return False
    return not (start_time and started != start_time)

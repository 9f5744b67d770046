"""CPU time per process over a measured window, and per message handled.

A scenario names the processes of what it measures (``role → pid``: the caller, each stage
process, each baseline worker), opens a :class:`CpuWindow` around the measured block, and adds
the window to a :class:`CpuAccount` with the number of messages each role handled in it (a
request through a stage is one message for that stage; a stream chunk is one for the stage that
emits it and one for the stage that reads it). The account reports, per role, CPU seconds,
messages and **CPU µs per message**.

What is read, for every process (all its threads, including threads that ended in the window):

- ``cpu_s``: the process's CPU clock (``clock_gettime`` of ``clock_getcpuclockid(pid)``: the
  kernel's user + system run time of the whole thread group, in nanoseconds), before and after
  the window. This is the number the per-message figures use.
- ``user_s`` and ``sys_s``: ``utime`` and ``stime`` of ``/proc/<pid>/stat`` (clock ticks, 10 ms
  on most kernels), the same quantity split into user and kernel time; coarse over a short
  window, kept as a cross-check. Where the CPU clock cannot be read, ``cpu_s`` falls back to
  their sum.

Beside our processes the window reads the whole machine's busy time from ``/proc/stat``, so a
result shows how many cores our processes used and how many everything else on the machine used
at the same time (on a 2-core machine shared with other work, the contention is in the numbers).

Nothing here imports torch or omni.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from . import common

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_CPUCLOCK_SCHED = 2  # linux/posix-timers.h: a process CPU clock id is ((~pid) << 3) | CPUCLOCK_SCHED


def _clock_ns(pid: int) -> int | None:
    """User + system CPU time of process ``pid`` (every thread), in ns; None if not readable."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | _CPUCLOCK_SCHED)
    except (OSError, OverflowError, AttributeError):
        return None


def _stat_ticks(pid: int) -> tuple[int, int] | None:
    """``(utime, stime)`` of ``/proc/<pid>/stat`` in clock ticks; None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5), after pid and comm


def _machine_ticks() -> tuple[int, int] | None:
    """``(busy, total)`` clock ticks of every CPU from ``/proc/stat`` (busy = not idle/iowait)."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])  # guest time is already counted in user
    return total - idle, total


def snapshot(pid: int) -> dict[str, Any] | None:
    """CPU counters of one process now (None if it does not exist)."""
    ticks = _stat_ticks(pid)
    if ticks is None:
        return None
    return {"clock_ns": _clock_ns(pid), "utime": ticks[0], "stime": ticks[1]}


def _delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    if before is None or after is None:
        return None
    user = (after["utime"] - before["utime"]) / _TICK
    system = (after["stime"] - before["stime"]) / _TICK
    if before["clock_ns"] is not None and after["clock_ns"] is not None:
        cpu, source = (after["clock_ns"] - before["clock_ns"]) / 1e9, "clock"
    else:
        cpu, source = user + system, "stat"
    return {"cpu_s": cpu, "user_s": user, "sys_s": system, "source": source}


class CpuWindow:
    """``with CpuWindow({"caller": os.getpid(), "s0": pid, ...}) as w: <measured block>``; then
    ``w.cpu[role]`` is ``{"cpu_s", "user_s", "sys_s", "source"}`` (None for a process that
    vanished), ``w.wall_s`` the window's length and ``w.machine_busy_s`` the CPU seconds the
    whole machine was busy in it (every process, ours included)."""

    def __init__(self, pids: Mapping[str, int | None]):
        self.pids = {role: pid for role, pid in pids.items() if pid}
        self.cpu: dict[str, dict[str, Any] | None] = {}
        self.wall_s = 0.0
        self.machine_busy_s: float | None = None

    def __enter__(self) -> CpuWindow:
        self._machine = _machine_ticks()
        self._before = {role: snapshot(pid) for role, pid in self.pids.items()}
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall_s = time.perf_counter() - self._t0
        after = {role: snapshot(pid) for role, pid in self.pids.items()}
        machine = _machine_ticks()
        self.cpu = {role: _delta(self._before[role], after[role]) for role in self.pids}
        if self._machine is not None and machine is not None:
            self.machine_busy_s = (machine[0] - self._machine[0]) / _TICK


class CpuAccount:
    """CPU and messages per role, summed over every window added (the rounds of one point)."""

    def __init__(self) -> None:
        self.roles: dict[str, dict[str, Any]] = {}
        self.wall_s = 0.0
        self.machine_busy_s: float | None = 0.0
        self.windows = 0

    def add(self, window: CpuWindow, messages: Mapping[str, int] | int) -> None:
        """Add ``window``; ``messages`` is the count each role handled in it (one int: all roles)."""
        self.windows += 1
        self.wall_s += window.wall_s
        if window.machine_busy_s is None or self.machine_busy_s is None:
            self.machine_busy_s = None
        else:
            self.machine_busy_s += window.machine_busy_s
        for role, pid in window.pids.items():
            entry = self.roles.setdefault(role, {"pid": pid, "cpu_s": 0.0, "user_s": 0.0, "sys_s": 0.0, "messages": 0,
                                                  "source": "clock", "missing_windows": 0})
            got = window.cpu.get(role)
            if got is None:
                entry["missing_windows"] += 1
                continue
            for key in ("cpu_s", "user_s", "sys_s"):
                entry[key] += got[key]
            if got["source"] != "clock":
                entry["source"] = "stat"
            entry["messages"] += messages if isinstance(messages, int) else messages.get(role, 0)

    def report(self, stage_roles: list[str] | None = None) -> dict[str, Any]:
        """Per role: pid, cpu_s, user_s, sys_s, messages, ``us_per_message``; and for the
        whole point: wall_s, ``cores`` (our processes' CPU / wall), ``machine_cores`` (the
        whole machine's busy CPU / wall), ``stage_us_per_message`` (the mean over
        ``stage_roles``, default every role but ``caller``) and ``total_cpu_s``."""
        roles = {}
        for role, entry in self.roles.items():
            per = entry["cpu_s"] / entry["messages"] * 1e6 if entry["messages"] else None
            roles[role] = {**entry, "us_per_message": per}
        stages = [r for r in (stage_roles if stage_roles is not None else [r for r in roles if r != "caller"]) if r in roles]
        per_stage = [roles[r]["us_per_message"] for r in stages if roles[r]["us_per_message"] is not None]
        total = sum(e["cpu_s"] for e in roles.values())
        return {
            "roles": roles,
            "stage_roles": stages,
            "stage_us_per_message": sum(per_stage) / len(per_stage) if per_stage else None,
            "stage_us_per_message_max": max(per_stage) if per_stage else None,
            "total_cpu_s": total,
            "wall_s": self.wall_s,
            "windows": self.windows,
            "cores": total / self.wall_s if self.wall_s else None,
            "machine_cores": self.machine_busy_s / self.wall_s if self.wall_s and self.machine_busy_s is not None else None,
        }


def per_message(report: dict[str, Any] | None, role: str) -> float | None:
    """CPU µs per message of ``role`` in a :meth:`CpuAccount.report` (None if absent)."""
    if not report:
        return None
    return (report.get("roles", {}).get(role) or {}).get("us_per_message")


def cpu_table(key: str, keys: list[Any], get: Callable[[Any, str], dict[str, Any] | None]) -> str:
    """A table of CPU µs per message per stage process (mean over the stages) of omni, the raw
    pyzmq chain and the mp.Queue chain, of the caller per request, and the cores busy during
    omni's rounds: its processes', and the whole machine's (shared with others). ``get(k, impl)``
    is the result row (with its ``cpu`` report) of point ``k``."""
    headers = [key, "omni CPU µs/msg/stage", "pyzmq", "mp.Queue", "omni/pyzmq", "omni/mp.Queue",
               "omni caller µs/req", "pyzmq caller", "omni cores", "machine cores"]
    rows = []
    for k in keys:
        cpu = {impl: (get(k, impl) or {}).get("cpu") for impl in ("omni", "zmq", "mpq")}
        stage = {impl: (c or {}).get("stage_us_per_message") for impl, c in cpu.items()}
        rows.append([k, stage["omni"], stage["zmq"], stage["mpq"], common.ratio(stage["omni"], stage["zmq"]),
                     common.ratio(stage["omni"], stage["mpq"]), per_message(cpu["omni"], "caller"), per_message(cpu["zmq"], "caller"),
                     (cpu["omni"] or {}).get("cores"), (cpu["omni"] or {}).get("machine_cores")])
    return ("CPU per message (user + system, every thread, from /proc; ratio < 1 means omni uses less)\n"
            + common.table(headers, rows))

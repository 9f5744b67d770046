"""Profile omni's hot path under the hop or throughput load with py-spy (every process at once).

``python -m bench.profile hop|throughput [--seconds S] [--rate HZ] [--top N]`` starts the omni
side of the scenario in a child process (a 3-stage chain; one request at a time for ``hop``, 64
in flight for ``throughput``), samples it and its stage processes with ``py-spy record
--subprocesses``, and prints, per process role (the caller's process, each stage process), the
functions with the most samples on their own (self) and including their callees (inclusive).
Idle time (a process waiting in epoll) is not sampled, so the shares are of CPU time. The raw
stacks and the tables land in ``bench/results/profile-<load>.*``.

Needs ``py-spy`` (in the ``bench`` extra) and the right to ptrace the children (root, or
``kernel.yama.ptrace_scope=0``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import common

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _load(load: str, seconds: float) -> None:
    """The child: start the omni chain, report pids, run the load for ``seconds``."""
    import asyncio

    from omni_core import Pipeline

    from .hop import PAYLOAD
    from .stages import chain

    async def go() -> None:
        async with Pipeline(chain(3, name=f"bench-profile-{load}")) as p:
            for _ in range(200):
                await p.submit(PAYLOAD)
            print("READY " + json.dumps({"caller": os.getpid(), **p.pids()}), flush=True)
            end = time.perf_counter() + seconds
            done = 0

            async def worker() -> None:
                nonlocal done
                while time.perf_counter() < end:
                    await p.submit(PAYLOAD)
                    done += 1

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(1 if load == "hop" else 64)))
            print("DONE " + json.dumps({"requests": done, "seconds": time.perf_counter() - t0}), flush=True)

    asyncio.run(go())


def parse(raw: str, roles: dict[int, str]) -> dict[str, dict[str, Any]]:
    """Self and inclusive sample counts per function, per process role."""
    per: dict[str, dict[str, Any]] = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        pid = None
        funcs = []
        for f in frames:
            if f.startswith("process "):
                m = re.match(r"process (\d+)", f)
                pid = int(m.group(1)) if m else pid
                continue
            if f.startswith("thread "):
                continue
            m = _FRAME.match(f)
            name = f"{m.group('func')} ({_short(m.group('file'))})" if m else f
            funcs.append(name if len(name) <= 90 else name[:87] + "...")
        role = roles.get(pid, f"pid {pid}")
        entry = per.setdefault(role, {"samples": 0, "self": collections.Counter(), "inclusive": collections.Counter()})
        n = int(count)
        entry["samples"] += n
        if funcs:
            entry["self"][funcs[-1]] += n
            for func in set(funcs):
                entry["inclusive"][func] += n
    return per


def _short(path: str) -> str:
    for marker in ("site-packages/", "lib/python3", "omni_core/", "bench/"):
        i = path.find(marker)
        if i >= 0:
            return path[i:] if marker in ("omni_core/", "bench/") else path[i + len(marker):]
    return os.path.basename(path)


def report(per: dict[str, dict[str, Any]], top: int) -> str:
    out = []
    for role in sorted(per, key=lambda r: (not r.startswith("caller"), r)):
        entry = per[role]
        total = entry["samples"] or 1
        out.append(f"\n### {role}: {entry['samples']} samples")
        rows = [[f, c / total * 100] for f, c in entry["self"].most_common(top)]
        out.append("self (% of this process's samples)\n" + common.table(["function", "self %"], rows))
        rows = [[f, c / total * 100] for f, c in entry["inclusive"].most_common(top + 8)]
        out.append("inclusive\n" + common.table(["function", "incl %"], rows))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("load", choices=["hop", "throughput"])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rate", type=int, default=200, help="samples per second per process")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    args = parser.parse_args(argv)
    spy = shutil.which("py-spy")
    if spy is None:
        print("py-spy is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    raw_path = args.out / f"profile-{args.load}.raw"
    child = subprocess.Popen([sys.executable, "-m", "bench.profile", "--child", args.load, str(args.seconds + 4)],
                             cwd=common.ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        if not line.startswith("READY "):
            raise SystemExit(f"the load did not start: {line!r}")
        pids = json.loads(line[6:])
        roles = {pid: ("caller (coordinator)" if name == "caller" else f"stage process {name}") for name, pid in pids.items()}
        time.sleep(1.0)
        subprocess.run([spy, "record", "--pid", str(pids["caller"]), "--subprocesses", "--format", "raw", "--nonblocking",
                        "--rate", str(args.rate), "--duration", str(int(args.seconds)), "-o", str(raw_path)],
                       check=True, capture_output=True)
        done = json.loads(child.stdout.readline()[5:])
    finally:
        child.wait(120)
    per = parse(raw_path.read_text(), roles)
    text = f"# profile of the {args.load} load ({done['requests'] / done['seconds']:.0f} requests/s while sampled)" + report(per, args.top)
    (args.out / f"profile-{args.load}.md").write_text(text + "\n")
    summary = {role: {"samples": e["samples"], "self": e["self"].most_common(args.top), "inclusive": e["inclusive"].most_common(args.top + 8)}
               for role, e in per.items()}
    (args.out / f"profile-{args.load}.json").write_text(json.dumps({"load": args.load, "rate": done, "processes": summary}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _load(sys.argv[2], float(sys.argv[3]))
    else:
        sys.exit(main())

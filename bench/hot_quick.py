"""A quick, repeatable CPU-per-message check of the runtime's hot path (not a scenario).

``python -m bench.hot_quick [--stages N] [--inflight K] [--requests R] [--stream]`` runs an
``Echo`` chain (or the stream scenario's ``head`` → ``src`` → ``sink``) in this process, warms it
up, then reports the CPU µs per message of every stage process and of the caller (this process),
read from each process's CPU clock around the measured block, and the requests per second.
CPU per message is what contention on a shared machine disturbs least: use it to compare two
versions of the runtime on the same machine.

``--targets`` measures issue 35's two hot-path targets instead, each side by side with its
baselines in one run: the per-hop latency of a 4-stage ``Echo`` chain against the raw pyzmq and
``multiprocessing.Queue`` chains (``bench.hop``), and the requests/s of the 3-stage chain at
``--inflight`` requests in flight against the same two (``bench.throughput``).

``--against TREE`` compares this checkout with another one (``git worktree add /tmp/old HEAD~1``,
or ``git archive REV | tar -x -C DIR``): the same measurement runs ``--ab-rounds`` times in each,
in ABBA order, each run in a process of its own that imports omni from its tree (this checkout's
bench drives it; the stage processes and the baselines' workers load the tree's ``bench``), and the
medians per tree and their ratio are printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .cpu import _clock_ns


async def _closed_loop(p, payload: dict, *, warmup: int, requests: int, concurrency: int,
                       check=None) -> tuple[float, int, dict[str, int]]:
    """Warm ``p`` up, then run ``requests`` requests ``concurrency`` at a time; ``(wall seconds,
    this process's CPU ns, each stage process's CPU ns)`` over the measured block."""
    pids = dict(p.pids())
    for _ in range(warmup):
        await p.submit(payload)
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            out = await p.submit(payload)
            if check is not None:
                check(out)

    before = {role: _clock_ns(pid) for role, pid in pids.items()}
    me0 = time.process_time_ns()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    me = time.process_time_ns() - me0
    return wall, me, {role: _clock_ns(pid) - before[role] for role, pid in pids.items()}


async def _chain(stages: int, inflight: int, requests: int) -> dict:
    from omni_core import Pipeline

    from .hop import PAYLOAD
    from .stages import chain

    async with Pipeline(chain(stages, name="bench-hot-quick")) as p:
        wall, me, cpu = await _closed_loop(p, PAYLOAD, warmup=300, requests=requests, concurrency=inflight)
    per = {role: round(ns / 1e3 / requests, 1) for role, ns in cpu.items()}
    return {
        "req/s": round(requests / wall),
        "caller_us": round(me / 1e3 / requests, 1),
        "stages_us": per,
        "stage_mean_us": round(sum(per.values()) / len(per), 1),
    }


async def _stream(relay: str, streams: int, chunks: int, requests: int) -> dict:
    from omni_core import Pipeline

    from .stages import stream_pair

    def check(out: dict) -> None:
        assert out["sink"]["n"] == chunks and not out["sink"]["bad"], out["sink"]

    async with Pipeline(stream_pair(relay=relay, name="bench-hot-stream")) as p:
        wall, _, cpu = await _closed_loop(p, {"chunks": chunks}, warmup=20, requests=requests,
                                          concurrency=streams, check=check)
    total = requests * chunks
    per = {role: round(ns / 1e3 / total, 1) for role, ns in cpu.items()}
    return {"chunks/s": round(total / wall), "us_per_chunk": per}


def _targets(inflight: int) -> dict:
    """Issue 35's targets, each against its baselines in one run: the 4-stage hop (median µs per
    hop) and the 3-stage chain's requests/s at ``inflight`` in flight (median of the rounds)."""
    from . import common, hop, throughput

    with common.Loop() as loop:
        rows = hop.measure({"ns": [4], "warmup": 100, "requests": 300, "rounds": 3}, loop)
        hop_us = {r["impl"]: r["hop_us"]["median"] for r in rows}
        rows = throughput.measure({"stages": 3, "concurrency": [inflight], "warmup_s": 0.5, "duration_s": 1.5,
                                   "rounds": 2}, loop)
        rps = {r["impl"]: r["rps"]["median"] for r in rows}
    return {
        "hop_us": round(hop_us["omni"], 1), "hop_pyzmq_us": round(hop_us["zmq"], 1),
        "hop/pyzmq": round(hop_us["omni"] / hop_us["zmq"], 3),
        "req/s": round(rps["omni"]), "mpq_req/s": round(rps["mpq"]),
        f"{inflight}/mp.Queue": round(rps["omni"] / rps["mpq"], 3),
    }


#: Run in each tree by ``--against``: this checkout's bench package, then omni from the tree.
_CHILD = ("import sys; sys.path.insert(0, {bench!r}); import bench.hot_quick as hq; "
          "sys.path[0] = {tree!r}; sys.argv = ['bench.hot_quick', *{args!r}]; hq.main()")


def _against(tree: str, rounds: int, args: list[str]) -> None:
    """Run ``bench.hot_quick args`` in this checkout and in ``tree``, ABBA, ``rounds`` times
    each; print every run's line, then the medians per tree and this checkout's ratio."""
    here = str(Path(__file__).resolve().parent.parent)
    there = str(Path(tree).resolve())
    if not (Path(there) / "omni_core").is_dir():
        raise SystemExit(f"--against {tree}: no omni_core package there (give the root of a checkout)")
    runs: dict[str, list[dict]] = {"this": [], "against": []}
    env = {**os.environ, "OMNI_LOG_LEVEL": os.environ.get("OMNI_LOG_LEVEL", "warning")}
    for i in range(rounds):
        for name in ("this", "against") if i % 2 == 0 else ("against", "this"):  # ABBA over two rounds
            root = here if name == "this" else there
            code = _CHILD.format(bench=here, tree=root, args=args)
            out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode != 0 or not lines:
                raise SystemExit(f"the run in {root} failed (exit code {out.returncode}):\n{out.stderr[-2000:]}")
            result = json.loads(lines[-1])
            runs[name].append(result)
            print(json.dumps({"tree": name, **result}), flush=True)
    medians = {name: {k: statistics.median(r[k] for r in results) for k, v in results[0].items()
                      if isinstance(v, (int, float))} for name, results in runs.items()}
    ratio = {k: round(v / medians["against"][k], 3) for k, v in medians["this"].items() if medians["against"].get(k)}
    print(json.dumps({"median this": medians["this"], "median against": medians["against"],
                      "this/against": ratio}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--stream", metavar="RELAY", help="the stream scenario's pipeline over RELAY instead"
    )
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument(
        "--profile", metavar="DIR", help="cProfile every stage process into DIR/<process>.prof"
    )
    ap.add_argument("--targets", action="store_true",
                    help="issue 35's targets instead: the 4-stage hop and --inflight requests/s, each against "
                         "raw pyzmq and mp.Queue in one run")
    ap.add_argument("--against", metavar="TREE",
                    help="compare with the checkout at TREE: the same runs, ABBA, medians and ratio last")
    ap.add_argument("--ab-rounds", type=int, default=3, help="runs per tree with --against (default 3)")
    args = ap.parse_args()
    if args.against:
        argv = sys.argv[1:]
        for flag in ("--against", "--ab-rounds"):
            while flag in argv:
                i = argv.index(flag)
                del argv[i:i + 2]
        argv = [a for a in argv if not a.startswith(("--against=", "--ab-rounds="))]
        _against(args.against, args.ab_rounds, argv)
        return
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        os.environ["OMNI_PROFILE_DIR"] = os.path.abspath(args.profile)
    for _ in range(args.repeat):
        if args.targets:
            result = _targets(args.inflight)
        elif args.stream:
            result = asyncio.run(_stream(args.stream, args.inflight, args.chunks, args.requests))
        else:
            result = asyncio.run(_chain(args.stages, args.inflight, args.requests))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMNI_LOG_LEVEL", "warning")
    main()

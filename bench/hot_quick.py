"""A quick, repeatable CPU-per-message check of the runtime's hot path (not a scenario).

``python -m bench.hot_quick [--stages N] [--inflight K] [--requests R] [--stream]`` runs an
``Echo`` chain (or the stream scenario's ``head`` → ``src`` → ``sink``) in this process, warms it
up, then reports the CPU µs per message of every stage process and of the caller (this process),
read from each process's CPU clock around the measured block, and the requests per second.
CPU per message is what contention on a shared machine disturbs least: use it to compare two
versions of the runtime on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

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
    args = ap.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        os.environ["OMNI_PROFILE_DIR"] = os.path.abspath(args.profile)
    for _ in range(args.repeat):
        if args.stream:
            result = asyncio.run(_stream(args.stream, args.inflight, args.chunks, args.requests))
        else:
            result = asyncio.run(_chain(args.stages, args.inflight, args.requests))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMNI_LOG_LEVEL", "warning")
    main()

"""Chaos, bounded and seeded: random SIGKILLs and SIGSTOPs of stage processes under a mixed
load of submits and streams whose tensors travel through the relay's slots (above the inline
threshold), with the shm and the inline relay. A retryable pipeline: every submit succeeds with
its own result; a stream either succeeds whole (chunks once, in order) or, hit after its first
chunk, fails with a named error. Nothing hangs, nothing leaks (request tables and relay slots
back to zero in every process; processes, sockets and /dev/shm by the no_leaks fixture)."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest
import torch
from runtime_helpers import arun, no_leaks, pipeline, settle, stage, until  # noqa: F401

from omni_core import Pipeline, ProcessDied, ProcessHung

pytestmark = [pytest.mark.timeout(150), pytest.mark.usefixtures("no_leaks")]

SEED = int(os.environ.get("OMNI_CHAOS_SEED", "36"))
FAULT_SECONDS = 12.0
ELEMENTS = 32768  # 128 KiB of float32: above the shm relay's 64 KiB inline threshold


def chaos_pipeline(relay: str) -> dict:
    return pipeline(
        stage("a", "Echo", next="b"),
        stage("b", "Echo", next="c"),
        stage("c", "StreamThenReturn", terminal=True),
        relay={"backend": relay, **({"options": {"slots": 8}} if relay == "shm" else {})},
        restart={"policy": "on-failure", "max_restarts": 100},
        retry={"attempts": 6},
        limits={"heartbeat_interval": 0.25, "heartbeat_timeout": 2.5, "request_timeout": 60,
                "max_in_flight": 64},
    )


@pytest.mark.parametrize("relay", ["shm", "inline"])
def test_random_kills_and_stops_under_load_lose_no_request_and_leak_nothing(relay):
    rng = random.Random(f"{SEED}-{relay}")

    async def body():
        async with Pipeline(chaos_pipeline(relay)) as p:
            outcomes: list[tuple[str, int, object]] = []
            faulting = True

            async def one(i: int, streamed: bool):
                inputs = {"t": torch.full((ELEMENTS,), float(i)), "n": 3, "i": i}
                try:
                    if not streamed:
                        out = await p.submit(inputs)
                        outcomes.append(("submit", i, out))
                        return
                    chunks, result = [], None
                    async for event in p.stream(inputs):
                        if event.is_result:
                            result = event.data
                        else:
                            chunks.append(event.data["i"])
                    outcomes.append(("stream", i, (chunks, result)))
                except Exception as exc:  # judged below
                    outcomes.append(("stream" if streamed else "submit", i, exc))

            async def load():
                tasks, i = set(), 0
                while faulting:
                    while len(tasks) >= 24:
                        _, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    i += 1
                    tasks.add(asyncio.ensure_future(one(i, rng.random() < 0.5)))
                    await asyncio.sleep(rng.uniform(0, 0.01))  # the load's random arrivals
                if tasks:
                    await asyncio.wait(tasks)
                return i

            loader = asyncio.ensure_future(load())
            faults = []
            loop = asyncio.get_running_loop()
            end = loop.time() + FAULT_SECONDS
            while loop.time() < end:
                await asyncio.sleep(rng.uniform(0.3, 1.2))  # the scenario: a fault at a random moment
                victim = rng.choice(["a", "b", "c"])
                how = rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGSTOP])
                old = p.pids()[victim]
                os.kill(old, how)
                faults.append((victim, how.name))
                await until(lambda v=victim, o=old: p.running and p.pids()[v] not in (None, o),
                            f"{victim} back after {how.name}", 30)
            faulting = False
            sent = await asyncio.wait_for(loader, 90)

            assert len(outcomes) == sent and faults
            failed = []
            for kind, i, out in outcomes:
                if isinstance(out, Exception):
                    assert kind == "stream" and isinstance(out, (ProcessDied, ProcessHung)), \
                        f"{kind} {i} failed with {out!r}"
                    failed.append(i)
                    continue
                result = out if kind == "submit" else out[1]
                assert torch.equal(result["t"], torch.full((ELEMENTS,), float(i))) and result["i"] == i
                if kind == "stream":
                    assert out[0] == [0, 1, 2], f"stream {i}: chunks {out[0]}"
            assert sum(p.retries.values()) > 0, f"faults {faults} retried nothing"
            assert len(failed) < len(outcomes) / 4, f"{len(failed)} of {len(outcomes)} streams failed"

            left = await settle(p, ignore=("ended",))
            assert not left, f"state not back to zero: {left}"

    arun(body(), timeout=140)

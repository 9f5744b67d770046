"""Per-request isolation: any ``BaseException`` a stage raises fails that request only; a forged
relay handle fails that request only; and after many requests no process keeps state for them."""

from __future__ import annotations

import asyncio

import pytest
import torch
from runtime_helpers import arun, fn, no_leaks, pipeline, settle, stage  # noqa: F401

from omni_core import Pipeline, StageError
from omni_core.relay.shm_segment import MAGIC, VERSION

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_leaks")]

CASES = [("async", "SystemExit"), ("async", "KeyboardInterrupt"), ("async", "CancelledError"),
         ("async", "GeneratorExit"), ("sync", "SystemExit"), ("sync", "KeyboardInterrupt")]


def value(result: dict) -> dict:
    """The answer of the one terminal stage a routed request reached."""
    (answer,) = result.values()
    return answer


def test_base_exceptions_raised_by_stages_fail_their_request_only(tmp_path):
    """``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit`` (async and sync stages) and
    ``CancelledError`` raised by stage code each fail their request with a ``StageError`` naming
    it; requests in flight in the same process meanwhile, and later ones, are served by the same
    process."""
    gate = tmp_path / "gate"
    cfg = pipeline(
        stage("src", "Echo", next=["async", "sync"], route_fn=fn("route_by_field")),
        stage("async", "Raise", terminal=True, process="p"),
        stage("sync", "RaiseSync", terminal=True, process="p"),
    )

    async def body():
        async with Pipeline(cfg) as p:
            pid = p.pids()["p"]
            bystanders = [asyncio.ensure_future(p.submit({"route": r, "n": i, "gate": str(gate)}))
                          for i, r in enumerate(["async", "sync"])]
            for route, name in CASES:
                with pytest.raises(StageError) as info:
                    await asyncio.wait_for(p.submit({"route": route, "raise": name}), 30)
                error = info.value
                assert error.stage == route and (name in error.error_type or name in error.reason), str(error)
            gate.touch()
            answers = [value(r) for r in await asyncio.wait_for(asyncio.gather(*bystanders), 30)]
            assert answers == [{"ok": 0, "pid": pid}, {"ok": 1, "pid": pid}]
            assert value(await p.submit({"route": "sync", "n": 2})) == {"ok": 2, "pid": pid}
            assert p.running and p.pids()["p"] == pid

    arun(body(), timeout=150)


def segment_lookalike(path) -> bytes:
    """A file with a valid shm segment header: a receiver that opened it would accept it."""
    words = [0] * 16 + [0, 0]
    words[0], words[1], words[4], words[5], words[6] = MAGIC, VERSION, 1, 4096, 4096
    data = b"".join(w.to_bytes(8, "little") for w in words)
    path.write_bytes(data.ljust(8192, b"\0"))
    return path.read_bytes()


@pytest.mark.parametrize(("relay", "kinds"), [("shm", ["path", "huge", "bounds", "other-run"]),
                                              ("inline", ["frames"])])
def test_forged_relay_handles_fail_their_request_only(relay, kinds, tmp_path):
    """The forger's relay sends forged handles for some results (a segment path outside
    /dev/shm, a 512 MiB tensor without a buffer, a span beyond its segment, another run's
    segment, a frame too short): each of those requests fails with ``InvalidHandle`` in the
    receiving stage, which maps and writes no file and allocates nothing; the others are
    served by the same processes."""
    victim = tmp_path / "victim"
    before = segment_lookalike(victim)
    # shm: every transfer through the pool (inline_below 0), so the forged handles are pool handles
    edge_relay = {"backend": "shm", "options": {"inline_below": 0}} if relay == "shm" else relay
    cfg = pipeline(stage("forger", "Forger", args={"victim": str(victim)}, next="echo", relay=edge_relay),
                   stage("echo", "Echo", terminal=True))

    async def body():
        async with Pipeline(cfg) as p:
            pids = p.pids()
            forged = [p.submit({"n": 100 + i, "forge": kind}) for i, kind in enumerate(kinds)]
            honest = [p.submit({"n": n}) for n in range(6)]
            results = await asyncio.wait_for(asyncio.gather(*forged, *honest, return_exceptions=True), 60)
            assert p.running and p.pids() == pids
            return results

    results = arun(body(), timeout=150)
    for kind, error in zip(kinds, results, strict=False):
        assert isinstance(error, StageError), f"{kind}: {error!r}"
        assert error.stage == "echo" and error.error_type == "InvalidHandle", f"{kind}: {error}"
    for n, result in enumerate(results[len(kinds):]):
        assert torch.equal(result["x"], torch.full((8,), float(n)))
    assert victim.read_bytes() == before, "a forged handle made a stage write into another file"


def test_no_process_keeps_per_request_state_after_1000_requests():
    """Fan-in (in a tensor-parallel stage, so its follower too), streams, relay tables and the
    memory of ended requests, in every process and in the coordinator, are back to zero once
    1,000 requests (some failing after their first chunk) have ended.

    ``Pipeline.debug_state()`` answers ``{"coordinator": {table: entries}, process: {table:
    entries}, ...}`` for every process."""
    cfg = pipeline(
        stage("src", "Echo", next=["tok", "collect"]),
        stage("tok", "TensorChunks", stream_to=["collect"], next="tp"),
        stage("collect", "CollectTensors", args={"source": "tok"}, next="tp",
              can_accept_stream_before_payload=True),
        stage("tp", "AllReduce", tp_size=2, wait_for=["tok", "collect"], merge_fn=fn("merge_tp_input"),
              terminal=True),
    )

    async def one(p, i):
        try:
            return await p.submit({"n": 2, "x": torch.full((4,), 1.0), "fail": i % 10 == 9})
        except StageError:
            return None

    async def body():
        async with Pipeline(cfg) as p:
            results = []
            for start in range(0, 1000, 100):
                results += await asyncio.gather(*(one(p, i) for i in range(start, start + 100)))
            assert sum(r is None for r in results) == 100
            assert all(torch.equal(r["x"], torch.full((4,), 3.0)) for r in results if r is not None)
            left = await settle(p)
            state = await p.debug_state()
            assert set(state) == {"coordinator", *p.pids()}, "every process reports its state"
            assert all(state.values()), "every process reports its tables"
            assert left == {}, f"per-request state left after 1,000 requests: {left}"

    arun(body(), timeout=170)

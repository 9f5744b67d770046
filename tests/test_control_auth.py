"""An authenticated control plane: every message between the processes of a run carries a MAC
made with the run's secret, so another process of the same user that can reach the sockets but
does not hold the secret cannot forge a result, an abort or a Shutdown: its messages are refused
and logged, and the pipeline serves on."""

from __future__ import annotations

import asyncio

import pytest
import zmq
from runtime_helpers import arun, no_leaks, pipeline, stage, until, until_state  # noqa: F401

from omni_core import Pipeline
from omni_core.relay.payload import pack
from omni_core.runtime import wire

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_leaks")]


def _forger(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def test_forged_result_abort_and_shutdown_are_refused_and_the_pipeline_serves_on(tmp_path):
    cfg = pipeline(stage("a", "Sleep", next="b"), stage("b", "Echo", terminal=True))
    gate = tmp_path / "go"
    real = {"gate": str(gate), "x": "real"}  # held in a until every forged message was refused

    async def body():
        async with Pipeline(cfg) as p:
            pids = p.pids()
            task = asyncio.ensure_future(p.submit(real, request_id="victim"))
            await until(lambda: p.requests, "the request admitted")
            rid = next(iter(p.requests))
            skeleton, _ = pack({"x": "forged"})
            to_caller, to_a, to_b = (_forger(p.addresses[n]) for n in ("", "a", "b"))
            try:
                forged = [
                    (to_caller, wire.Data("result", rid, "victim", "b", "b", skeleton)),
                    (to_a, wire.Abort(rid, rid + 1)),
                    (to_b, wire.Shutdown()),
                    (to_a, wire.Shutdown()),
                ]
                for sock, msg in forged:
                    sock.send(wire.encode(msg))  # no MAC
                    sock.send(wire.seal(b"a guessed secret", wire.encode(msg)))  # a wrong one
                transport = p.coordinator.endpoint.transport
                await until(lambda: transport.refused >= 2, "the forged results refused")
                await until_state(p, lambda s: (s["a"].get("inbox.refused", 0), s["b"].get("inbox.refused", 0)) == (4, 2),
                                  "the forged aborts and shutdowns refused")
                gate.touch()
                assert await asyncio.wait_for(task, 30) == real
                assert p.running and p.pids() == pids, "a forged Shutdown stopped a process"
                assert await p.submit({"sleep": 0, "x": 2}) == {"sleep": 0, "x": 2}
                # The same message sealed with the run's secret is taken: the checks above can fail.
                late = asyncio.ensure_future(p.submit({"sleep": 30}, request_id="late"))
                await until(lambda: len(p.requests) == 1, "admitted")
                rid = next(iter(p.requests))
                to_caller.send(wire.seal(p.launch.secret, wire.encode(
                    wire.Data("result", rid, "late", "b", "b", skeleton))))
                assert await asyncio.wait_for(late, 30) == {"x": "forged"}
            finally:
                for sock in (to_caller, to_a, to_b):
                    sock.close(0)

    arun(body(), timeout=80)


def test_a_sealed_message_round_trips_and_any_change_is_refused():
    secret = b"s" * 32
    body = wire.encode(wire.Abort(3, 2))
    sealed = wire.seal(secret, body)
    assert len(sealed) == len(body) + wire.MAC_BYTES
    assert bytes(wire.unseal(secret, memoryview(sealed))) == body
    for bad in (sealed[:-1] + bytes([sealed[-1] ^ 1]), sealed[:wire.MAC_BYTES], b"", sealed[1:]):
        assert wire.unseal(secret, memoryview(bad)) is None
    assert wire.unseal(b"t" * 32, memoryview(sealed)) is None

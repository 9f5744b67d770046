"""realtime: time to first audio and cancel latency of ``/v1/realtime`` (the ``realtime`` API of
omni-contrib-stages) on a real ``omni serve demo --api realtime``, through the official ``openai``
SDK.

``python -m bench.realtime [--pipeline demo | qwen2_5_omni] [--sessions 1,8] [--turns 5] [--out FILE]``
(``qwen2_5_omni`` runs on a tiny random checkpoint written for the run, as its tests do.)

- ttfa (create): each of N sessions sends typed turns back to back (``conversation.item.create``
  then ``response.create``, server VAD off); the time from sending ``response.create`` to the first
  ``response.output_audio.delta``.
- ttfa (vad): each session streams a spoken turn (the tests' espeak-ng WAV, then 0.6 s of silence)
  with server VAD on; the time from ``input_audio_buffer.speech_stopped`` (the end of the turn)
  to the first audio delta.
- cancel: at 1 session, ``response.cancel`` sent on the first audio delta of a 60-token answer, to
  ``response.done``.

Every measured response has ``max_output_tokens`` ``--max-tokens`` (13: one sentence of the demo).

Prints a table and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import tempfile
import time
import wave
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEECH = ROOT / "contrib_stages" / "tests" / "data" / "hello_24k.wav"


def _speech() -> bytes:
    with wave.open(str(SPEECH)) as w:
        return w.readframes(w.getnframes())


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else float("nan")


async def _first_audio(conn) -> tuple[float, list]:
    events = []
    async for event in conn:
        events.append(event)
        if event.type == "response.output_audio.delta":
            return time.perf_counter(), events
        if event.type in ("response.done", "error"):
            raise RuntimeError(f"no audio: {event}")
    raise RuntimeError("closed")


async def _until(conn, kind: str):
    async for event in conn:
        if event.type == kind:
            return event
        if event.type == "error":
            raise RuntimeError(event.error.message)
    raise RuntimeError("closed")


async def _typed(client, model: str, turns: int, max_tokens: int = 13) -> list[float]:
    out = []
    async with client.realtime.connect(model=model, max_retries=0) as conn:
        await _until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "max_output_tokens": max_tokens,
                                           "audio": {"input": {"turn_detection": None}}})
        await _until(conn, "session.updated")
        for i in range(turns):
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": f"hello omni {i}"}]})
            t0 = time.perf_counter()
            await conn.response.create()
            first, _ = await _first_audio(conn)
            out.append(first - t0)
            await _until(conn, "response.done")
    return out


async def _spoken(client, model: str, turns: int, speech: bytes, max_tokens: int = 13) -> list[float]:
    out = []
    audio = speech + bytes(int(24000 * 0.6) * 2)
    async with client.realtime.connect(model=model, max_retries=0) as conn:
        await _until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "max_output_tokens": max_tokens,
                                           "audio": {"input": {"turn_detection": {
            "type": "server_vad", "silence_duration_ms": 400}}}})
        await _until(conn, "session.updated")
        for _ in range(turns):
            for i in range(0, len(audio), 4800):
                await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i:i + 4800]).decode())
            await _until(conn, "input_audio_buffer.speech_stopped")
            t0 = time.perf_counter()
            first, _ = await _first_audio(conn)
            out.append(first - t0)
            await _until(conn, "response.done")
    return out


async def _cancel(client, model: str, turns: int) -> list[float]:
    out = []
    async with client.realtime.connect(model=model, max_retries=0) as conn:
        await _until(conn, "session.created")
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await _until(conn, "session.updated")
        for _ in range(turns):
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "hello"}]})
            await conn.response.create(response={"max_output_tokens": 60})
            await _first_audio(conn)
            t0 = time.perf_counter()
            await conn.response.cancel()
            done = await _until(conn, "response.done")
            out.append(time.perf_counter() - t0)
            assert done.response.status == "cancelled", done.response.status
    return out


async def measure(url: str, model: str, sessions: list[int], turns: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    speech = _speech()
    await _typed(client, model, 1)  # warm up (VAD models, first requests)
    await _spoken(client, model, 1, speech)
    rows = []
    for n in sessions:
        typed = [x for part in await asyncio.gather(*(_typed(client, model, turns, max_tokens) for _ in range(n))) for x in part]
        spoken = [x for part in await asyncio.gather(*(_spoken(client, model, turns, speech, max_tokens) for _ in range(n))) for x in part]
        rows.append({"sessions": n, "ttfa_create_p50_ms": _p(typed, 0.5), "ttfa_create_p90_ms": _p(typed, 0.9),
                     "ttfa_vad_p50_ms": _p(spoken, 0.5), "ttfa_vad_p90_ms": _p(spoken, 0.9),
                     "samples": len(typed)})
    cancels = await _cancel(client, model, max(turns, 10))
    return {"rows": rows, "cancel_p50_ms": _p(cancels, 0.5), "cancel_max_ms": max(cancels) * 1000,
            "cancel_samples": len(cancels)}


def main(argv: list[str] | None = None) -> int:
    from omni_core.testing.serve import ServerProcess

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default="demo", choices=["demo", "qwen2_5_omni"])
    parser.add_argument("--sessions", default="1,8")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=13, help="max_output_tokens of each measured response")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    sessions = [int(s) for s in args.sessions.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        env = {}
        if args.pipeline == "qwen2_5_omni":
            from omni_transformers.tiny import write_tiny_checkpoint

            env["OMNI_TRANSFORMERS_MODEL"] = str(write_tiny_checkpoint(Path(tmp) / "ckpt"))
        with ServerProcess(args.pipeline, "--api", "realtime", cwd=tmp, env=env, ready_timeout=300) as server:
            result = asyncio.run(measure(server.url, args.pipeline, sessions, args.turns, args.max_tokens))
    result["pipeline"] = args.pipeline
    print("| sessions | ttfa p50 ms (response.create) | p90 | ttfa p50 ms (VAD end of turn) | p90 |")
    print("|---:|---:|---:|---:|---:|")
    for row in result["rows"]:
        print(f"| {row['sessions']} | {row['ttfa_create_p50_ms']:.1f} | {row['ttfa_create_p90_ms']:.1f} | "
              f"{row['ttfa_vad_p50_ms']:.1f} | {row['ttfa_vad_p90_ms']:.1f} |")
    print(f"response.cancel -> response.done: p50 {result['cancel_p50_ms']:.1f} ms, max {result['cancel_max_ms']:.1f} ms "
          f"({result['cancel_samples']} cancels)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

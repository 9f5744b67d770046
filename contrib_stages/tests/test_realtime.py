"""The ``realtime`` API (OpenAI Realtime protocol on ``/v1/realtime``) against a real ``omni serve``,
driven by the official ``openai`` SDK: turns of audio and text, the conversation each response
sees, cancel, server VAD on real speech with barge-in, every malformed input, concurrent sessions,
the session limit, idle sessions and clients that go away.

The pipeline is one stage (:mod:`realtime_stages`) that records each request's inputs, so a test
asserts on exactly what the pipeline got."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
import wave
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soxr
from omni_contrib_stages.api_common import Resampler, pcm16
from omni_contrib_stages.realtime import resample

from omni_core.testing.serve import ServerProcess
from omni_core.testing.waiting import events_until

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent
SPEECH_WAV = HERE / "data" / "hello_24k.wav"  # espeak-ng: "Hello omni. What is the weather like today?"
RATE = 24000
HOP = 1600  # the test stage's audio chunk: 1600 samples at 16 kHz = 2400 at 24 kHz


def speech() -> bytes:
    with wave.open(str(SPEECH_WAV)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)
        return w.readframes(w.getnframes())


def silence(seconds: float) -> bytes:
    return bytes(int(RATE * seconds) * 2)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


CONFIG = """\
name: voice
stages:
  - name: talk
    factory: realtime_stages:Voice
    args: {{record: {record}, delay: {delay}, hop: {hop}}}
    terminal: true
serve:
  apis: [realtime]
  options:
    realtime:
      messages_key: messages
      text_stage: talk
      audio_stage: talk
      audio_field: pcm
      sample_rate: 16000        # the chunks say their rate too (sample_rate_field)
      max_tokens_key: max_tokens
      voices: [alloy, Chelsie]
      max_sessions: {max_sessions}
      idle_timeout: {idle_timeout}
      max_event_bytes: 1048576
"""


def start_server(tmp: Path, *, delay: float = 0.03, max_sessions: int = 8, idle_timeout: float = 300) -> ServerProcess:
    record = tmp / "record"
    config = CONFIG.format(record=record, delay=delay, hop=HOP, max_sessions=max_sessions, idle_timeout=idle_timeout)
    srv = ServerProcess.of_config(config, tmp, name="voice", pythonpath=[HERE])
    srv.record = record
    return srv.start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("realtime"))
    try:
        yield srv
    finally:
        srv.stop_cleanly()


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def connect(srv: ServerProcess, model: str = "voice"):
    client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    return client.realtime.connect(model=model, max_retries=0)


def types(events) -> list[str]:
    return [e.type for e in events]


def recorded(srv: ServerProcess, response_id: str) -> dict:
    return json.loads((srv.record / f"rt-{response_id}.json").read_text())


def metric(srv: ServerProcess, name: str, **labels: str) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def wait_metric(srv: ServerProcess, name: str, value: float, timeout: float = 20, **labels: str) -> None:
    deadline = time.monotonic() + timeout
    while (got := metric(srv, name, **labels)) != value:
        assert time.monotonic() < deadline, f"{name}{labels} stayed {got}, expected {value}"
        time.sleep(0.1)


async def manual_session(conn, **session) -> None:
    await events_until(conn, "session.created")
    await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}, **session})
    await events_until(conn, "session.updated")


# -- turns ------------------------------------------------------------------------------------------------


def test_a_spoken_turn_streams_audio_and_transcript_then_done(server):
    async def main():
        async with connect(server) as conn:
            await manual_session(conn, instructions="Answer briefly.")
            audio = speech()
            for i in range(0, len(audio), 9600):
                await conn.input_audio_buffer.append(audio=b64(audio[i:i + 9600]))
            await conn.input_audio_buffer.commit()
            committed = await events_until(conn, "conversation.item.done")
            await conn.response.create()
            return committed, await events_until(conn, "response.done")

    committed, events = run(main())
    assert types(committed) == ["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
    user_item = committed[-1].item
    assert user_item.role == "user" and user_item.content[0].type == "input_audio"
    assert types(events)[:4] == ["response.created", "response.output_item.added", "conversation.item.added",
                                 "response.content_part.added"]
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    assert transcript == "w0 w1 w2 w3 w4"
    deltas = [base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"]
    pcm = b"".join(deltas)
    assert len(pcm) == 5 * HOP * 3 // 2 * 2  # five chunks at 16 kHz, resampled to 24 kHz PCM16
    # One resampling stream (soxr's): the deltas joined are the stage's audio resampled whole, within two PCM16
    # steps (no click at chunk edges); the first delta is the first chunk less what soxr's filter still holds.
    stage_pcm = np.concatenate([np.frombuffer(pcm16(stage_chunk()), "<i2")] * 5)
    whole = soxr.resample(stage_pcm, 16000, RATE)
    assert np.abs(np.frombuffer(pcm, "<i2").astype(int) - whole).max() <= 2
    assert len(deltas[0]) // 2 == len(Resampler(RATE).push(pcm16(stage_chunk()), 16000)) // 2 == 2202
    tone = np.frombuffer(pcm, "<i2").astype(np.float32) / 32767
    spectrum = np.abs(np.fft.rfft(tone[:2400]))
    assert abs(np.argmax(spectrum) * RATE / 2400 - 440) <= 10  # the stage's 440 Hz, at the right speed
    done = events[-1].response
    assert done.status == "completed" and done.usage.input_tokens == 7 and done.usage.output_tokens == 5
    assert done.output[0].content[0].transcript == transcript
    inputs = recorded(server, done.id)
    assert inputs["messages"][0] == {"role": "system", "content": "Answer briefly."}
    part = inputs["messages"][1]["content"][0]
    assert part["type"] == "audio" and part["sample_rate"] == 16000
    assert abs(part["audio"]["tensor"][0] - len(speech()) // 2 * 2 // 3) <= 2  # 24 kHz -> 16 kHz
    assert part["audio"]["rms"] > 0.02


def test_text_in_text_out_with_the_voice_and_max_tokens(server):
    async def main():
        async with connect(server) as conn:
            await manual_session(conn, output_modalities=["text"], audio={"output": {"voice": "Chelsie"}})
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "hi there"}]})
            await events_until(conn, "conversation.item.done")
            await conn.response.create(response={"max_output_tokens": 3})
            return await events_until(conn, "response.done")

    events = run(main())
    assert "response.output_audio.delta" not in types(events)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "w0 w1 w2"
    done = events[-1].response
    assert done.status == "completed" and done.output_modalities == ["text"]
    assert recorded(server, done.id) == {
        "max_tokens": 3, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}]}


def test_the_second_turn_sees_the_first(server):
    async def main():
        async with connect(server) as conn:
            await manual_session(conn)
            await conn.input_audio_buffer.append(audio=b64(speech()))
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            first = await events_until(conn, "response.done")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "and then?"}]})
            await conn.response.create(response={"max_output_tokens": 2})
            second = await events_until(conn, "response.done")
            return first[-1].response, second[-1].response

    first, second = run(main())
    assert first.status == second.status == "completed"
    messages = recorded(server, second.id)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[0]["content"][0]["type"] == "audio"
    assert messages[1]["content"] == "w0 w1 w2 w3 w4"  # the first answer, as text
    assert messages[2]["content"] == [{"type": "text", "text": "and then?"}]


def test_cancel_mid_response_aborts_it_and_keeps_what_was_sent(server):
    async def main():
        async with connect(server) as conn:
            await manual_session(conn)
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "talk"}]})
            await conn.response.create(response={"max_output_tokens": 60})  # about 2 s of words
            events = await events_until(conn, "response.output_audio.delta")
            await conn.response.cancel()
            sent = time.perf_counter()
            events = await events_until(conn, "response.done", events)
            cancel_ms = (time.perf_counter() - sent) * 1000
            await conn.response.create(response={"max_output_tokens": 1})
            after = await events_until(conn, "response.done")
            return events, after[-1].response, cancel_ms

    events, after, cancel_ms = run(main())
    print(f"response.cancel -> response.done: {cancel_ms:.1f} ms")
    done = events[-1].response
    assert done.status == "cancelled" and done.status_details.reason == "client_cancelled"
    sent = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    assert 0 < len(sent.split()) < 60
    assert done.output[0].status == "incomplete" and done.output[0].content[0].transcript == sent
    assert recorded(server, after.id)["messages"][1] == {"role": "assistant", "content": sent}
    wait_metric(server, "omni_requests_in_flight", 0)
    assert metric(server, "omni_requests_total", status="aborted") >= 1


def test_the_history_is_bounded_oldest_first(server):
    async def main():
        async with connect(server) as conn:
            await manual_session(conn)
            for i in range(40):
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": f"t{i}"}]})
            await conn.response.create(response={"max_output_tokens": 1})
            return await events_until(conn, "response.done")

    done = run(main())[-1].response
    messages = recorded(server, done.id)["messages"]
    # max_items: the 32 newest turns reach the pipeline
    assert [m["content"][0]["text"] for m in messages] == [f"t{i}" for i in range(8, 40)]


# -- server VAD -------------------------------------------------------------------------------------------


def test_server_vad_on_silence_speech_silence_then_barge_in(server):
    async def main():
        async with connect(server) as conn:
            await events_until(conn, "session.created")  # server_vad is the default
            # Long answers (60 words, 1.8 s at least): the barge-in comes while one plays.
            await conn.session.update(session={"type": "realtime", "max_output_tokens": 60, "audio": {"input": {
                "turn_detection": {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 200,
                                   "silence_duration_ms": 400}}}})
            await events_until(conn, "session.updated")
            # Silence alone is no turn: the buffer is cleared without any speech event.
            await conn.input_audio_buffer.append(audio=b64(silence(1.5)))
            await conn.input_audio_buffer.clear()
            quiet = await events_until(conn, "input_audio_buffer.cleared")
            audio = silence(1.0) + speech() + silence(1.0)
            for i in range(0, len(audio), 4800):  # 100 ms per event
                await conn.input_audio_buffer.append(audio=b64(audio[i:i + 4800]))
            turn = await events_until(conn, "response.output_audio.delta")
            # Barge-in: the user speaks again while the answer plays.
            for i in range(0, len(speech()), 4800):
                await conn.input_audio_buffer.append(audio=b64(speech()[i:i + 4800]))
            barge = await events_until(conn, "response.done")
            await conn.input_audio_buffer.append(audio=b64(silence(1.0)))
            second = await events_until(conn, "response.done")
            return quiet, turn, barge, second

    quiet, turn, barge, second = run(main())
    assert types(quiet) == ["input_audio_buffer.cleared"]
    kinds = types(turn)
    assert kinds[:5] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                         "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
    assert "response.created" in kinds
    started, stopped = turn[0], turn[1]
    speech_ms = len(speech()) * 1000 // (2 * RATE)
    # session audio time: 1.5 s of silence (cleared), then 1 s of silence before the speech
    assert 2500 - 200 - 150 <= started.audio_start_ms <= 2500 + 300
    assert 2500 + speech_ms - 700 <= stopped.audio_end_ms <= 2500 + speech_ms + 500
    assert started.item_id == stopped.item_id == turn[2].item_id
    cancelled = barge[-1].response
    assert "input_audio_buffer.speech_started" in types(barge)
    assert types(barge).index("input_audio_buffer.speech_started") < len(barge) - 1
    assert cancelled.status == "cancelled" and cancelled.status_details.reason == "turn_detected"
    sent = "".join(e.delta for e in turn + barge if e.type == "response.output_audio_transcript.delta")
    assert cancelled.output[0].content[0].transcript == sent
    assert second[-1].response.status == "completed"
    messages = recorded(server, second[-1].response.id)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == sent  # the interrupted answer, truncated to what was sent


# -- robustness -----------------------------------------------------------------------------------------


def test_every_malformed_input_is_an_error_event_and_the_session_goes_on(server):
    cases = [
        ("not json", "invalid_json"),
        ("[" * 50_000 + "]" * 50_000, "invalid_json"),  # nested past the reader's limit: refused, not a crash
        ("[1, 2]", "invalid_event"),
        ({"type": "no.such.event"}, "unknown_event"),
        ({"type": "input_audio_buffer.append", "audio": "%%%not base64"}, "invalid_value"),
        ({"type": "input_audio_buffer.append", "audio": b64(b"\x00\x01\x02")}, "invalid_audio_format"),
        ({"type": "input_audio_buffer.append", "audio": b64(bytes(800_000))}, "event_too_large"),
        ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
            "format": {"type": "audio/pcmu"}}}}}, "unsupported_audio_format"),
        ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 16000}}}}}, "unsupported_audio_format"),
        ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
            "turn_detection": {"type": "server_vad", "threshold": 2}}}}}, "invalid_value"),
        ({"type": "session.update", "session": {"type": "realtime", "audio": {"output": {"voice": "nobody"}}}},
         "invalid_value"),
        ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty"),
        ({"type": "response.cancel"}, "response_cancel_not_active"),
        ({"type": "conversation.item.truncate", "item_id": "item_nope", "content_index": 0, "audio_end_ms": 0},
         "item_not_found"),
        ({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                        "content": [{"type": "input_image"}]}}, "invalid_value"),
    ]

    async def main():
        async with connect(server) as conn:
            await manual_session(conn)
            errors = []
            for i, (event, _) in enumerate(cases):
                if isinstance(event, dict):
                    event = json.dumps({**event, "event_id": f"bad-{i}"})
                await conn.send_raw(event)
                errors.append(await events_until(conn, "error"))
            await conn.send_raw(b"\x00binary")  # a binary frame
            errors.append(await events_until(conn, "error"))
            # A response.create while one runs.
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "x"}]})
            await conn.response.create(response={"max_output_tokens": 20})
            await events_until(conn, "response.created")
            await conn.send_raw(json.dumps({"type": "response.create", "event_id": "again"}))
            busy = await events_until(conn, "error")
            done = await events_until(conn, "response.done")
            return errors, busy, done

    errors, busy, done = run(main())
    for i, ((_, code), seen) in enumerate(zip(cases, errors, strict=False)):
        assert types(seen) == ["error"], (code, types(seen))  # nothing else happened
        error = seen[-1].error
        assert error.code == code and error.message, (code, error)
        assert error.event_id == (f"bad-{i}" if isinstance(cases[i][0], dict) else None)
    assert errors[-1][-1].error.code == "invalid_event"
    assert busy[-1].error.code == "conversation_already_has_active_response" and busy[-1].error.event_id == "again"
    assert done[-1].response.status == "completed"  # the session went on


def test_eight_concurrent_sessions_then_the_limit(server):
    async def turn(i: int, opened: asyncio.Event, hold: asyncio.Event, counter: list):
        async with connect(server) as conn:
            await manual_session(conn)
            counter.append(i)
            if len(counter) == 8:
                opened.set()
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": f"session {i}"}]})
            await conn.response.create()
            events = await events_until(conn, "response.done")
            await hold.wait()
            return events

    async def main():
        opened, hold, counter = asyncio.Event(), asyncio.Event(), []
        tasks = [asyncio.create_task(turn(i, opened, hold, counter)) for i in range(8)]
        await opened.wait()
        sessions_open = await asyncio.to_thread(metric, server, "omni_realtime_sessions")
        async with connect(server) as ninth:
            refused = await events_until(ninth, "error")
        hold.set()
        return await asyncio.gather(*tasks), refused, sessions_open

    results, refused, sessions_open = run(main())
    assert sessions_open == 8
    assert refused[-1].error.code == "session_limit_reached" and "max_sessions" in refused[-1].error.message
    for i, events in enumerate(results):
        done = events[-1].response
        assert done.status == "completed"
        assert recorded(server, done.id)["messages"][0]["content"][0]["text"] == f"session {i}"
    wait_metric(server, "omni_realtime_sessions", 0)
    assert metric(server, "omni_realtime_sessions_total", status="refused") >= 1
    assert metric(server, "omni_realtime_time_to_first_audio_seconds_count") >= 8


def test_a_client_that_disconnects_mid_response_frees_everything(server):
    before = metric(server, "omni_requests_total", status="aborted")

    async def main():
        async with connect(server) as conn:
            await manual_session(conn)
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "go"}]})
            await conn.response.create(response={"max_output_tokens": 60})
            await events_until(conn, "response.output_audio.delta")
            assert await asyncio.to_thread(metric, server, "omni_requests_in_flight") == 1
        # leaving the block closes the socket mid-response

    run(main())
    wait_metric(server, "omni_requests_in_flight", 0)
    wait_metric(server, "omni_stage_in_flight", 0)
    wait_metric(server, "omni_realtime_sessions", 0)
    assert metric(server, "omni_requests_total", status="aborted") == before + 1


def test_a_model_the_server_does_not_serve_is_refused(server):
    async def main():
        async with connect(server, model="other") as conn:
            return await events_until(conn, "error")

    error = run(main())[-1].error
    assert error.code == "model_not_found" and "'voice'" in error.message


def test_the_session_limit_and_idle_sessions_on_a_small_server(tmp_path):
    srv = start_server(tmp_path, max_sessions=1, idle_timeout=1)
    try:
        async def main():
            async with connect(srv) as conn:
                await events_until(conn, "session.created")
                async with connect(srv) as other:
                    refused = await events_until(other, "error")
                started = time.monotonic()
                idle = await events_until(conn, "error")
                waited = time.monotonic() - started
                closed = [e async for e in conn]  # the server closes the session
            async with connect(srv) as again:  # the slot is free again
                created = await events_until(again, "session.created")
            return refused, idle, waited, closed, created

        refused, idle, waited, closed, created = run(main())
        assert refused[-1].error.code == "session_limit_reached"
        assert idle[-1].error.code == "session_expired" and "idle_timeout" in idle[-1].error.message
        assert waited < 30 and closed == []
        assert types(created) == ["session.created"]
        wait_metric(srv, "omni_realtime_sessions_total", 1, status="idle_timeout")
    finally:
        srv.stop_cleanly()


def stage_chunk() -> np.ndarray:
    """One audio chunk of the test stage (realtime_stages.Voice): 0.5 * a 440 Hz tone, HOP samples at 16 kHz."""
    import math

    import torch

    t = torch.arange(HOP, dtype=torch.float32) / 16000
    return (0.5 * torch.sin(2 * math.pi * 440 * t)).numpy()  # as the stage computes it


def test_resample_keeps_a_tone_at_its_pitch():
    t = np.arange(16000) / 16000
    tone = np.sin(2 * np.pi * 1000 * t).astype(np.float32)
    up = resample(tone, 16000, 24000)
    assert up.size == 24000
    assert abs(np.argmax(np.abs(np.fft.rfft(up))) - 1000) <= 1
    down = resample(up, 24000, 16000)
    assert down.size == 16000 and np.abs(down[100:-100] - tone[100:-100]).max() < 0.05

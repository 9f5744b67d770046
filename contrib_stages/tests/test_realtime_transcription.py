"""Input audio transcription in realtime sessions, against ``omni serve demo asr.yaml --api
realtime`` (the demo and a toy ASR pipeline in one server) with the official ``openai`` SDK: each
committed user turn gets ``conversation.item.input_audio_transcription.delta`` events and a
``.completed`` whose transcript equals the ASR pipeline's own transcription of the same audio
(``POST /v1/audio/transcriptions``); a model that is not an ASR pipeline of the server is refused
naming those that are."""

from __future__ import annotations

import asyncio
import base64
import wave
from pathlib import Path

import openai
import pytest
from omni_contrib_stages.api_common import wav_bytes
from speech_configs import asr_config

from omni_core.testing.serve import ServerProcess
from omni_core.testing.waiting import events_until

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent
SPEECH_WAV = HERE / "data" / "hello_24k.wav"

# The toy ends its text with a digest of the samples it got (at 16 kHz: both paths resample), so equal
# transcripts mean equal samples; no timestamps_key: it is never asked for segments.
ASR = asr_config(args={"digest": True},
                 audio={"max_audio_seconds": 30, "input_sample_rate": 16000, "timestamps_key": None})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rt-asr")
    (tmp / "asr.yaml").write_text(ASR)
    srv = ServerProcess("demo", str(tmp / "asr.yaml"), "--api", "realtime", env={"PYTHONPATH": str(HERE)},
                        cwd=str(tmp), ready_timeout=300)
    with srv.serving():
        yield srv


def speech() -> bytes:
    with wave.open(str(SPEECH_WAV)) as w:
        return w.readframes(w.getnframes())


def uploaded(server, pcm: bytes, **fields):
    """``POST /v1/audio/transcriptions`` of ``pcm`` as a WAV file to the ASR pipeline, with the SDK."""
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as sdk:
        return sdk.audio.transcriptions.create(model="asr", file=("turn.wav", wav_bytes(pcm, 24000), "audio/wav"), **fields)


async def transcribed_turn(conn, pcm: bytes) -> list:
    """Append ``pcm`` in 100 ms events, commit it, and read the events up to its transcript's ``.completed``."""
    for i in range(0, len(pcm), 4800):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + 4800]).decode())
    await conn.input_audio_buffer.commit()
    return await events_until(conn, "conversation.item.input_audio_transcription.completed")


def test_each_committed_turn_is_transcribed_by_the_asr_pipeline(server):
    pcm = speech()
    turns = [pcm, pcm[: len(pcm) // 4 * 2]]  # the whole speech, then its first half
    answers = [uploaded(server, t) for t in turns]
    expected = [a.text for a in answers]
    assert all(expected) and expected[0] != expected[1]

    async def main() -> list[list]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client.realtime.connect(model="demo", max_retries=0) as conn:
            await conn.session.update(session={"type": "realtime", "audio": {"input": {
                "turn_detection": None, "transcription": {"model": "asr"}}}})
            updated = await events_until(conn, "session.updated")
            assert updated[-1].session.audio.input.transcription.model == "asr"
            seen = []
            for turn in turns:
                seen.append(await transcribed_turn(conn, turn))
            return seen

    seen = asyncio.run(asyncio.wait_for(main(), 180))
    for events, want, answer in zip(seen, expected, answers, strict=True):
        assert "error" not in [e.type for e in events], [e for e in events if e.type == "error"]
        item_id = next(e.item_id for e in events if e.type == "input_audio_buffer.committed")
        deltas = [e for e in events if e.type == "conversation.item.input_audio_transcription.delta"]
        done = events[-1]
        assert deltas and all(d.item_id == item_id and d.content_index == 0 for d in deltas)
        assert done.item_id == item_id and done.content_index == 0
        assert done.transcript == want == "".join(d.delta for d in deltas)
        assert done.usage.model_dump() == answer.usage.model_dump()  # the same usage as the route's


def test_the_same_audio_reaches_the_stage_as_the_same_samples_by_either_path(server):
    """An ASR pipeline with ``input_sample_rate`` (16 kHz here): the route resamples the upload and the
    session its committed turn with one resampler, so the stage gets equal samples (the toy's digest of
    them ends its text), equal to the audio resampled with soxr here."""
    import numpy as np
    import soxr
    from audio_stages import digest

    pcm = speech()
    routed = uploaded(server, pcm).text

    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client.realtime.connect(model="demo", max_retries=0) as conn:
            await conn.session.update(session={"type": "realtime", "audio": {"input": {
                "turn_detection": None, "transcription": {"model": "asr"}}}})
            await events_until(conn, "session.updated")
            return await transcribed_turn(conn, pcm)

    spoken = asyncio.run(asyncio.wait_for(main(), 120))[-1].transcript
    samples = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768
    want = digest(soxr.resample(samples, 24000, 16000).astype(np.float32), 16000)
    assert routed.split()[-1] == spoken.split()[-1] == want


def test_without_timestamps_key_verbose_json_has_one_segment_of_the_whole_file(server):
    """A pipeline that makes no segments (this one is never asked: ``timestamps_key: null``) keeps one segment,
    the whole file, in verbose_json, srt and vtt."""
    pcm = speech()
    seconds = len(pcm) / 2 / 24000
    verbose = uploaded(server, pcm, response_format="verbose_json")
    srt = uploaded(server, pcm, response_format="srt")
    assert verbose.duration == pytest.approx(seconds, abs=1e-3)  # of the samples at 16 kHz
    assert [(s.start, s.end, s.text) for s in verbose.segments] == [(0.0, verbose.duration, verbose.text)]
    assert srt.startswith("1\n00:00:00,000 --> ") and srt.count(" --> ") == 1


def test_a_model_that_is_not_an_asr_pipeline_is_refused_naming_those_that_are(server):
    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client.realtime.connect(model="demo", max_retries=0) as conn:
            await conn.session.update(session={"type": "realtime", "audio": {"input": {
                "transcription": {"model": "demo"}}}})
            return await events_until(conn, "error")

    events = asyncio.run(asyncio.wait_for(main(), 120))
    error = events[-1].error
    assert error.param == "session.audio.input.transcription.model"
    assert "'demo'" in error.message and "'asr'" in error.message


def test_a_session_of_the_asr_pipeline_transcribes_with_itself(server):
    """``?model=asr`` opens a session of the ASR pipeline (the server serves several); the beta
    protocol's ``input_audio_transcription`` names the session's own pipeline."""
    pcm = speech()
    want = uploaded(server, pcm).text

    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client.realtime.connect(model="asr", max_retries=0) as conn:
            created = await events_until(conn, "session.created")
            assert created[-1].session.model == "asr"
            await conn.session.update(session={"type": "realtime", "input_audio_transcription": {"model": "asr"},
                                               "audio": {"input": {"turn_detection": None}}})
            await events_until(conn, "session.updated")
            return await transcribed_turn(conn, pcm)

    events = asyncio.run(asyncio.wait_for(main(), 120))
    assert "error" not in [e.type for e in events], [e for e in events if e.type == "error"]
    assert events[-1].transcript == want


def test_an_unknown_model_is_refused_naming_the_served_ones(server):
    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client.realtime.connect(model="nope", max_retries=0) as conn:
            return await events_until(conn, "error")

    error = asyncio.run(asyncio.wait_for(main(), 60))[-1].error
    assert error.code == "model_not_found"
    assert "'demo'" in error.message and "'asr'" in error.message

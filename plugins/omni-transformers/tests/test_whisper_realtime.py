"""Whisper beside other pipelines in one ``omni serve``: ``omni serve demo WHISPER_DIR CSM_DIR --api realtime`` (the
contrib demo, a tiny Whisper and a tiny CSM checkpoint folder). ``/v1/models`` lists the three; each audio route
answers for its own model; a realtime session of the demo with ``input_audio_transcription`` on the whisper
pipeline gets, for each committed turn, deltas and a ``.completed`` transcript equal to the whisper pipeline's own
transcription of the same audio (``POST /v1/audio/transcriptions``), with the official ``openai`` SDK."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest
from omni_contrib_stages.api_common import wav_bytes
from omni_core.testing.waiting import events_until
from speech_serving import sdk, serving

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from omni_transformers.csm.tiny import write_tiny_checkpoint as write_csm
    from omni_transformers.whisper.tiny import write_tiny_checkpoint as write_whisper

    tmp = tmp_path_factory.mktemp("speech-multi")
    whisper, csm = write_whisper(tmp / "whisper"), write_csm(tmp / "csm")
    with serving("demo", str(whisper), str(csm), args=("--api", "realtime"), cwd=tmp) as srv:
        yield srv


def pcm24k(seconds: float, seed: int) -> bytes:
    """PCM16 at 24 kHz (the realtime API's format): a tone and noise, seeded."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 24000)) / 24000
    samples = 0.3 * np.sin(2 * np.pi * (220 + 50 * seed) * t) + 0.05 * rng.standard_normal(t.size)
    return (samples * 32767).astype("<i2").tobytes()


def test_one_server_answers_each_model_on_its_own_route(server):
    with sdk(server) as client:
        assert [m.id for m in client.models.list().data] == ["demo", "whisper", "csm"]
        text = client.audio.transcriptions.create(model="whisper", file=("a.wav", wav_bytes(pcm24k(1.0, 1), 24000))).text
        assert text
        speech = client.audio.speech.create(model="csm", voice="1", input="hello", response_format="pcm")
        assert len(speech.content) % (1920 * 2) == 0 and speech.content
        with pytest.raises(openai.BadRequestError, match="does not serve"):
            client.audio.speech.create(model="whisper", voice="0", input="hello")


def test_each_committed_turn_is_transcribed_by_the_whisper_pipeline(server):
    turns = [pcm24k(1.5, 2), pcm24k(0.8, 3)]
    with sdk(server) as client:
        answers = [client.audio.transcriptions.create(model="whisper", file=("turn.wav", wav_bytes(t, 24000), "audio/wav"))
                   for t in turns]
    expected = [a.text for a in answers]
    assert all(expected) and expected[0] != expected[1]

    async def main() -> list[list]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        async with client.realtime.connect(model="demo", max_retries=0) as conn:
            await conn.session.update(session={"type": "realtime", "audio": {"input": {
                "turn_detection": None, "transcription": {"model": "whisper", "language": "en"}}}})
            updated = await events_until(conn, "session.updated", timeout=120)
            assert updated[-1].session.audio.input.transcription.model == "whisper"
            seen = []
            for turn in turns:
                for i in range(0, len(turn), 4800):
                    await conn.input_audio_buffer.append(audio=base64.b64encode(turn[i:i + 4800]).decode())
                await conn.input_audio_buffer.commit()
                seen.append(await events_until(conn, "conversation.item.input_audio_transcription.completed", timeout=120))
            return seen

    seen = asyncio.run(asyncio.wait_for(main(), 300))
    with sdk(server) as client:
        in_english = [client.audio.transcriptions.create(model="whisper", file=("turn.wav", wav_bytes(t, 24000)), language="en").text
                      for t in turns]
    for events, want in zip(seen, in_english, strict=True):
        assert "error" not in [e.type for e in events], [e for e in events if e.type == "error"]
        item_id = next(e.item_id for e in events if e.type == "input_audio_buffer.committed")
        deltas = [e for e in events if e.type == "conversation.item.input_audio_transcription.delta"]
        done = events[-1]
        assert deltas and all(d.item_id == item_id for d in deltas)
        assert done.item_id == item_id
        assert done.transcript == want == "".join(d.delta for d in deltas)

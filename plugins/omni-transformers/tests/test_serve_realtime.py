"""``omni serve qwen2_5_omni`` (its config mounts ``realtime``) on the tiny checkpoint, with the official ``openai``
SDK: a spoken turn (the espeak-ng WAV of omni-contrib-stages' tests) answered with streamed speech
and transcript equal to the pipeline's own answer for the same conversation, and a text-only second
turn that sees the first. The realtime API takes the pipeline's ``openai`` adapter options
(``messages_key: messages``, ``voice_key: speaker`` ...) as they are."""

from __future__ import annotations

import asyncio
import base64
import wave
from pathlib import Path

import httpx
import openai
import pytest
import torch
from omni_core.encoding import from_jsonable, to_jsonable
from omni_core.testing.serve import ServerProcess

pytestmark = pytest.mark.timeout(900)

SPEECH_WAV = Path(__file__).resolve().parents[3] / "contrib_stages" / "tests" / "data" / "hello_24k.wav"
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    # No --api: the pipeline's config mounts realtime beside openai.
    srv = ServerProcess("qwen2_5_omni", env={"OMNI_TRANSFORMERS_MODEL": str(tiny_model)},
                        cwd=str(tmp_path_factory.mktemp("serve")), ready_timeout=300)
    with srv.serving(stop_timeout=120):
        yield srv


def native(server, inputs: dict) -> dict:
    """The pipeline's own answer for ``inputs``."""
    r = httpx.post(f"{server.url}/v1/pipelines/qwen2_5_omni/requests",
                   json={"input": to_jsonable({"wav_path": None, **inputs})}, timeout=600)
    assert r.status_code == 200, r.text
    return from_jsonable(r.json()["result"], "result")


def quantised(audio: torch.Tensor) -> bytes:
    return (audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().astype("<i2").tobytes()


async def until_done(conn) -> list:
    events = []
    async for event in conn:
        events.append(event)
        assert event.type != "error", event.error
        if event.type == "response.done":
            return events
    raise AssertionError("closed before response.done")


async def spoken_then_typed(url: str, model: str, voice: str, speech: bytes, max_tokens: int) -> tuple[list, list]:
    """Over the realtime API with the official SDK: a spoken turn (``speech``, PCM16 at 24 kHz, through the input
    audio buffer) answered in ``voice``, then a typed turn "again" answered with text only; each turn's events."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    async with client.realtime.connect(model=model, max_retries=0) as conn:
        await conn.session.update(session={"type": "realtime", "audio": {
            "input": {"turn_detection": None}, "output": {"voice": voice}}})
        for i in range(0, len(speech), 9600):
            await conn.input_audio_buffer.append(audio=base64.b64encode(speech[i:i + 9600]).decode())
        await conn.input_audio_buffer.commit()
        await conn.response.create(response={"max_output_tokens": max_tokens})
        spoken = await until_done(conn)
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "again"}]})
        await conn.response.create(response={"output_modalities": ["text"], "max_output_tokens": max_tokens})
        return spoken, await until_done(conn)


def test_a_spoken_turn_then_a_text_turn_equal_the_pipelines_answers(server):
    from omni_contrib_stages.realtime import resample, to_float

    with wave.open(str(SPEECH_WAV)) as w:
        speech = w.readframes(w.getnframes())
    spoken, typed = asyncio.run(asyncio.wait_for(spoken_then_typed(server.url, "qwen2_5_omni", "Ethan", speech,
                                                                   MAX_TOKENS), 600))
    audio = torch.from_numpy(resample(to_float(speech), 24000, 16000))
    user = {"role": "user", "content": [{"type": "audio", "audio": audio, "sample_rate": 16000}]}

    want = native(server, {"messages": [user], "max_new_tokens": MAX_TOKENS, "speaker": "Ethan"})
    done = spoken[-1].response
    assert done.status == "completed"
    transcript = "".join(e.delta for e in spoken if e.type == "response.output_audio_transcript.delta")
    assert transcript == want["text"]
    pcm = b"".join(base64.b64decode(e.delta) for e in spoken if e.type == "response.output_audio.delta")
    assert want["sample_rate"] == 24000 and pcm == quantised(want["audio"]) and pcm
    assert (done.usage.input_tokens, done.usage.output_tokens) == (want["prompt_tokens"], MAX_TOKENS)

    second = native(server, {"messages": [user, {"role": "assistant", "content": want["text"]},
                                          {"role": "user", "content": [{"type": "text", "text": "again"}]}],
                             "max_new_tokens": MAX_TOKENS, "return_audio": False})
    done = typed[-1].response
    assert done.status == "completed" and "response.output_audio.delta" not in [e.type for e in typed]
    assert "".join(e.delta for e in typed if e.type == "response.output_text.delta") == second["text"]
    assert (done.usage.input_tokens, done.usage.output_tokens) == (second["prompt_tokens"], MAX_TOKENS)
    assert second["prompt_tokens"] > want["prompt_tokens"]  # it read the first turn too

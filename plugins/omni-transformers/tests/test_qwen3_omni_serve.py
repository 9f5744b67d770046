"""``omni serve`` on a tiny Qwen3-Omni checkpoint folder speaks: the official ``openai`` SDK's chat with audio
out (WAV, and streamed PCM16) equals the pipeline's own answer for the same inputs (``POST
/v1/pipelines/qwen3_omni/requests``), each voice (chelsie, ethan, aiden) is its own, an unknown voice is a 400
naming the voices, and nothing is left behind."""

from __future__ import annotations

import asyncio
import base64
import io
import wave
from pathlib import Path

import httpx
import openai
import pytest
import torch
from omni_core.encoding import from_jsonable
from omni_core.testing.leaks import assert_nothing_left, runtime_dirs, shm_segments
from omni_core.testing.serve import ServerProcess
from test_serve_realtime import SPEECH_WAV, spoken_then_typed

from omni_transformers.qwen3_omni import tiny

pytestmark = pytest.mark.timeout(900)

PROMPT = "Hello there, say something."
MAX_TOKENS = 8
SEED = 5
NAME = "qwen3_omni"


def pcm16(audio: torch.Tensor) -> bytes:
    return (audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().astype("<i2").tobytes()


def assert_same_pcm(got: bytes, audio: torch.Tensor) -> None:
    """``got`` is ``audio`` as PCM16, each sample within one step (code2wav batches concurrent requests'
    chunks: a batched row may differ from a lone one in the last float bits)."""
    want = pcm16(audio)
    assert len(got) == len(want) > 0
    a = torch.frombuffer(bytearray(got), dtype=torch.int16).int()
    b = torch.frombuffer(bytearray(want), dtype=torch.int16).int()
    assert int((a - b).abs().max()) <= 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_omni_tiny") / "ckpt")
    cwd = tmp_path_factory.mktemp("serve")
    before_dirs, before_shm = runtime_dirs(), shm_segments()
    srv = ServerProcess(str(ckpt), env={"OMNI_TRANSFORMERS_MODEL": ""}, cwd=str(cwd), ready_timeout=300)
    with srv.serving(stop_timeout=120):
        yield srv
        assert not list(cwd.iterdir()), "a request wrote a file in the server's working directory"
    assert_nothing_left(before_dirs, before_shm, wait=30)  # no stage process, runtime dir or segment is left


@pytest.fixture(scope="module")
def native(server):
    """``native(speaker)``: the pipeline's own result for what the adapter sends for PROMPT."""
    cache: dict = {}

    def get(speaker: str) -> dict:
        if speaker not in cache:
            inputs = {"wav_path": None, "messages": [{"role": "user", "content": PROMPT}],
                      "max_new_tokens": MAX_TOKENS, "speaker": speaker, "seed": SEED, "temperature": 0}
            r = httpx.post(f"{server.url}/v1/pipelines/{NAME}/requests", json={"input": inputs}, timeout=600)
            assert r.status_code == 200, r.text
            result = from_jsonable(r.json()["result"], "result")
            assert result["sample_rate"] == 24000 and result["audio"].dtype == torch.float32
            assert len(result["codes"]) > 0 and all(len(frame) == 16 for frame in result["codes"])
            assert result["audio"].numel() == len(result["codes"]) * 1920 - 555
            assert result["completion_tokens"] == len(result["token_ids"]) <= MAX_TOKENS
            cache[speaker] = result
        return cache[speaker]

    return get


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600) as c:
        yield c


def ask(client, voice: str, fmt: str, stream: bool = False):
    return client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS, seed=SEED,
        temperature=0, modalities=["text", "audio"], audio={"voice": voice, "format": fmt}, stream=stream)


def test_a_completion_with_wav_audio_equals_the_pipeline_for_each_voice(client, native):
    for voice in ("chelsie", "Ethan", "aiden"):
        message = ask(client, voice, "wav").choices[0].message
        want = native(voice.lower())
        assert message.content == want["text"] and message.audio.transcript == want["text"]
        with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as wav:
            assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (24000, 1, 2)
            assert_same_pcm(wav.readframes(wav.getnframes()), want["audio"])
    assert native("chelsie")["codes"] != native("aiden")["codes"]  # the voice reaches the talker


def test_a_streamed_completion_sends_text_deltas_then_pcm16_equal_to_the_pipeline(client, native):
    text, pcm, order = [], bytearray(), []
    for chunk in ask(client, "ethan", "pcm16", stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            text.append(delta.content)
            order.append("text")
        if delta.audio is not None and delta.audio.data:
            pcm.extend(base64.b64decode(delta.audio.data))
            order.append("audio")
    want = native("ethan")
    assert "".join(text) == want["text"] and order[0] == "text" and "audio" in order
    assert_same_pcm(bytes(pcm), want["audio"])


def test_an_unknown_voice_is_a_400_naming_the_voices_and_text_only_still_answers(client, native):
    with pytest.raises(openai.BadRequestError, match="chelsie, ethan, aiden"):
        ask(client, "alloy", "wav")
    reply = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].message.content == native("ethan")["text"]
    assert reply.choices[0].message.audio is None


def test_the_realtime_api_answers_a_spoken_turn_with_speech_then_a_text_turn(server):
    """The realtime API (mounted by the pipeline's serve block) takes the openai adapter options as they are."""
    from omni_contrib_stages.realtime import resample, to_float
    from omni_core.encoding import to_jsonable

    with wave.open(str(SPEECH_WAV)) as w:
        speech = w.readframes(w.getnframes())

    spoken, typed = asyncio.run(asyncio.wait_for(spoken_then_typed(server.url, NAME, "aiden", speech, MAX_TOKENS),
                                                 600))
    audio = torch.from_numpy(resample(to_float(speech), 24000, 16000))
    user = {"role": "user", "content": [{"type": "audio", "audio": audio, "sample_rate": 16000}]}
    r = httpx.post(f"{server.url}/v1/pipelines/{NAME}/requests", timeout=600, json={"input": to_jsonable({
        "wav_path": None, "messages": [user], "max_new_tokens": MAX_TOKENS, "speaker": "aiden"})})
    assert r.status_code == 200, r.text
    want = from_jsonable(r.json()["result"], "result")
    done = spoken[-1].response
    assert done.status == "completed"
    assert "".join(e.delta for e in spoken if e.type == "response.output_audio_transcript.delta") == want["text"]
    pcm = b"".join(base64.b64decode(e.delta) for e in spoken if e.type == "response.output_audio.delta")
    assert_same_pcm(pcm, want["audio"])
    assert (done.usage.input_tokens, done.usage.output_tokens) == (want["prompt_tokens"], want["completion_tokens"])
    assert want["prompt_tokens"] > 20  # the audio's placeholders count
    done = typed[-1].response
    assert done.status == "completed" and "response.output_audio.delta" not in [e.type for e in typed]
    assert "".join(e.delta for e in typed if e.type == "response.output_text.delta")
    assert done.usage.input_tokens > want["prompt_tokens"]  # it read the first turn too


def test_input_audio_is_heard_and_answered_with_speech_equal_to_the_pipeline(client, server):
    import soundfile
    from omni_core.encoding import to_jsonable

    wav = Path(__file__).parent / "data" / "hello.wav"
    speech, rate = soundfile.read(str(wav), dtype="float32")
    question = {"type": "text", "text": "what is it?"}
    r = httpx.post(f"{server.url}/v1/pipelines/{NAME}/requests", timeout=600, json={"input": to_jsonable({
        "wav_path": None, "max_new_tokens": MAX_TOKENS, "speaker": "ethan", "seed": SEED, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "audio", "audio": torch.from_numpy(speech), "sample_rate": rate}, question]}]})})
    assert r.status_code == 200, r.text
    want = from_jsonable(r.json()["result"], "result")
    data = base64.b64encode(wav.read_bytes()).decode()
    done = client.chat.completions.create(
        model=NAME, max_tokens=MAX_TOKENS, seed=SEED, temperature=0, modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"},
        messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
                                               question]}])
    assert done.choices[0].message.content == want["text"]
    assert done.usage.prompt_tokens == want["prompt_tokens"] > 20  # the audio's placeholders count
    with wave.open(io.BytesIO(base64.b64decode(done.choices[0].message.audio.data))) as out:
        assert_same_pcm(out.readframes(out.getnframes()), want["audio"])


def test_an_image_url_is_seen_and_answered_with_speech_equal_to_the_pipeline(client, server):
    import numpy as np
    from omni_core.encoding import to_jsonable
    from PIL import Image

    pixels = (np.random.RandomState(3).rand(64, 96, 3) * 255).astype(np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(png, format="PNG")
    question = {"type": "text", "text": "what is it?"}
    r = httpx.post(f"{server.url}/v1/pipelines/{NAME}/requests", timeout=600, json={"input": to_jsonable({
        "wav_path": None, "max_new_tokens": MAX_TOKENS, "speaker": "chelsie", "seed": SEED, "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "image", "image": torch.from_numpy(pixels)}, question]}]})})
    assert r.status_code == 200, r.text
    want = from_jsonable(r.json()["result"], "result")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    done = client.chat.completions.create(
        model=NAME, max_tokens=MAX_TOKENS, seed=SEED, temperature=0, modalities=["text", "audio"],
        audio={"voice": "chelsie", "format": "wav"},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, question]}])
    assert done.choices[0].message.content == want["text"]
    assert done.usage.prompt_tokens == want["prompt_tokens"]
    with wave.open(io.BytesIO(base64.b64decode(done.choices[0].message.audio.data))) as out:
        assert_same_pcm(out.readframes(out.getnframes()), want["audio"])

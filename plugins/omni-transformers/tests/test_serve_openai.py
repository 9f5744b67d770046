"""``omni serve qwen2_5_omni`` (and ``.split``) through the real console script, with no adapter
options of the user's: the pipelines' own ``serve`` block mounts the ``openai`` API. The official
``openai`` SDK and httpx, streamed and not, against the pipeline's own answer for the same inputs
(``POST /v1/pipelines/{name}/requests``): the text equal, the PCM equal to the float waveform
quantised to int16, exactly, and WAV headers at 24000 Hz."""

from __future__ import annotations

import base64
import io
import json
import shutil
import wave

import httpx
import openai
import pytest
import torch
from omni_core.encoding import from_jsonable
from omni_core.testing.serve import ServerProcess

pytestmark = pytest.mark.timeout(900)

PROMPT = "hello omni"
MAX_TOKENS = 5
SAMPLE_RATE = 24000


class ConsoleServer(ServerProcess):
    """:class:`ServerProcess` started through the installed ``omni`` console script (a start
    that fails or times out stops the server: nothing of it outlives the test)."""

    def command(self) -> list[str]:
        omni = shutil.which("omni")
        assert omni, "the omni console script is not installed"
        return [omni, *self.serve_args()]


def quantised(audio: torch.Tensor) -> bytes:
    """The float waveform as PCM16, as omni-transformers writes its WAV files."""
    return (audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().astype("<i2").tobytes()


def assert_same_pcm(got: bytes, audio: torch.Tensor) -> None:
    """``got`` is ``audio`` as PCM16, each sample within one step: token2wav batches concurrent
    requests' chunks, and a batched row may differ from a lone one in the last float bits
    (token2wav.BATCHED_MAX_RELATIVE_ERROR), which can move a sample across a rounding edge."""
    want = quantised(audio)
    assert len(got) == len(want)
    a = torch.frombuffer(bytearray(got), dtype=torch.int16).int()
    b = torch.frombuffer(bytearray(want), dtype=torch.int16).int()
    if len(a):
        assert int((a - b).abs().max()) <= 1


@pytest.fixture(scope="module", params=["qwen2_5_omni", "qwen2_5_omni.split"])
def server(request, tiny_model, tmp_path_factory):
    from omni_core.plugins import load_plugins

    assert "openai" in load_plugins().registry.names("api"), (
        "the openai API is not installed: pip install ./contrib_stages (omni-contrib-stages)"
    )
    cwd = tmp_path_factory.mktemp("serve")
    # The config's serve block mounts the API; an --api naming it again mounts it once.
    args = ("--api", "openai") if request.param.endswith(".split") else ()
    srv = ConsoleServer(
        request.param,
        *args,
        env={"OMNI_TRANSFORMERS_MODEL": str(tiny_model)},
        cwd=str(cwd),
        ready_timeout=300,
    )
    with srv.serving(stop_timeout=120):
        yield srv
        assert not list(cwd.iterdir()), "a request wrote a file in the server's working directory"


@pytest.fixture(scope="module")
def native(server):
    """``native(speaker)``: the pipeline's own result for what the adapter sends for PROMPT."""
    cache: dict = {}

    def get(speaker: str | None) -> dict:
        if speaker not in cache:
            inputs = {"wav_path": None, "text": PROMPT, "max_new_tokens": MAX_TOKENS}
            if speaker is not None:
                inputs["speaker"] = speaker
            r = httpx.post(
                f"{server.url}/v1/pipelines/{server.config}/requests",
                json={"input": inputs},
                timeout=600,
            )
            assert r.status_code == 200, r.text
            result = from_jsonable(r.json()["result"], "result")
            assert result["sample_rate"] == SAMPLE_RATE and result["audio"].dtype == torch.float32
            assert result["audio"].numel() > 0 and len(result["token_ids"]) == MAX_TOKENS
            # The thinker's counts, passed on to token2wav's result: max_tokens cut the answer.
            assert result["completion_tokens"] == MAX_TOKENS and result["finish_reason"] == "length"
            assert result["prompt_tokens"] > len(PROMPT.split())
            # The tiny model's waveform is quiet (peaks near 2e-4: a few LSB), but not silence;
            # the scale itself is checked exactly in contrib_stages/tests/test_openai_audio.py.
            assert any(quantised(result["audio"])), "the waveform quantises to silence"
            cache[speaker] = result
        return cache[speaker]

    return get


@pytest.fixture
def client(server):
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600
    ) as c:
        yield c


def messages():
    return [{"role": "system", "content": "ignored"}, {"role": "user", "content": PROMPT}]


def test_the_pipeline_is_the_model(client, server):
    assert [m.id for m in client.models.list()] == [server.config]


def test_a_completion_with_wav_audio_equals_the_pipeline(client, server, native):
    done = client.chat.completions.create(
        model=server.config,
        messages=messages(),
        max_tokens=MAX_TOKENS,
        modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "wav"},
    )
    want = native("Chelsie")
    message = done.choices[0].message
    assert message.content == want["text"] and message.audio.transcript == want["text"]
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (
        want["prompt_tokens"], MAX_TOKENS, want["prompt_tokens"] + MAX_TOKENS)
    with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, SAMPLE_RATE)
        assert_same_pcm(wav.readframes(wav.getnframes()), want["audio"])


def test_a_streamed_completion_sends_text_deltas_then_pcm16_equal_to_the_pipeline(
    client, server, native
):
    stream = client.chat.completions.create(
        model=server.config,
        messages=messages(),
        max_tokens=MAX_TOKENS,
        stream=True,
        modalities=["text", "audio"],
        audio={"voice": "Ethan", "format": "pcm16"},
    )
    order, text, transcript, pcm, finish = [], [], [], bytearray(), []
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk" and chunk.model == server.config
        delta = chunk.choices[0].delta
        if delta.content:
            text.append(delta.content)
            order.append("text")
        if delta.audio is not None and delta.audio.transcript:
            transcript.append(delta.audio.transcript)
        if delta.audio is not None and delta.audio.data:
            pcm.extend(base64.b64decode(delta.audio.data))
            order.append("audio")
            assert delta.audio.model_extra["sample_rate"] == SAMPLE_RATE
        if chunk.choices[0].finish_reason:
            finish.append(chunk.choices[0].finish_reason)
    want = native("Ethan")
    # the voice reached the pipeline
    assert not torch.equal(want["audio"], native("Chelsie")["audio"])
    assert "".join(text) == want["text"] and "".join(transcript) == want["text"]
    assert len(text) > 1, "the text came in one piece, not as deltas"
    # speech is streamed: text and audio deltas may interleave; both kinds came, the text first
    assert order[0] == "text" and "audio" in order, order
    assert_same_pcm(bytes(pcm), want["audio"])
    assert finish == ["length"]  # max_tokens cut the answer


def test_plain_http_pcm16_and_a_streamed_text_only_completion(server, native):
    body = {
        "model": server.config,
        "messages": messages(),
        "max_tokens": MAX_TOKENS,
        "modalities": ["text", "audio"],
        "audio": {"voice": "Chelsie", "format": "pcm16"},
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    audio = r.json()["choices"][0]["message"]["audio"]
    assert_same_pcm(base64.b64decode(audio["data"]), native("Chelsie")["audio"])
    assert audio["sample_rate"] == SAMPLE_RATE

    body = {
        "model": server.config,
        "messages": messages(),
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=600) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    deltas = [json.loads(d)["choices"][0]["delta"] for d in data[:-1]]
    assert all("audio" not in d for d in deltas)
    assert (
        "".join(d.get("content", "") for d in deltas)
        == native(None)["text"]
        == native("Chelsie")["text"]
    )


def test_voices_are_the_speakers(client, server):
    with pytest.raises(openai.BadRequestError, match="Chelsie, Ethan") as info:
        client.chat.completions.create(
            model=server.config,
            messages=messages(),
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
        )
    assert info.value.body["param"] == "audio.voice"

"""The ``openai`` API against a real ``omni serve demo``, with the official ``openai`` SDK and with
httpx: models, chat completions with text and audio, streamed and not, and OpenAI-shaped errors."""

from __future__ import annotations

import base64
import io
import json
import wave
from importlib.resources import files

import attrs
import httpx
import openai
import pytest
import yaml
from omni_contrib_stages.openai_api import BadRequest, adapter_options, parse_request

from omni_core import load_config
from omni_core.errors import ConfigError
from omni_core.testing.serve import ServerProcess

pytestmark = pytest.mark.timeout(300)

SAMPLE_RATE = 24000


def samples_for(words: int) -> int:
    """The demo vocoder's output length: one hop (1200 samples) per codec frame, 4 frames per
    word, plus the fade-out."""
    return (words * 4 + 1) * 1200


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # No --api: the demo config's `serve: {apis: [openai]}` mounts it.
    # A loaded CI machine can take over a minute to start the demo's processes.
    with ServerProcess("demo", cwd=str(tmp_path_factory.mktemp("serve")), ready_timeout=300).serving() as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as c:
        yield c


def test_the_served_pipeline_is_the_one_model(client):
    assert [m.id for m in client.models.list()] == ["demo"]


def test_a_text_completion(client):
    done = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hello omni"}], max_tokens=5
    )
    message = done.choices[0].message
    assert done.object == "chat.completion" and done.model == "demo"
    assert message.role == "assistant" and done.choices[0].finish_reason == "length"  # 5 of a 13-word sentence
    assert len(message.content.rstrip(".").split()) == 5 and message.audio is None


def test_a_completion_with_wav_audio_and_its_transcript(client):
    done = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "hello omni"}],
        max_tokens=3,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
    )
    message = done.choices[0].message
    assert (
        message.audio.transcript == message.content
        and len(message.content.rstrip(".").split()) == 3
    )
    with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, SAMPLE_RATE)
        assert wav.getnframes() == samples_for(3)


def test_a_streamed_completion_with_pcm16_audio(client):
    stream = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "hello omni"}],
        max_tokens=4,
        stream=True,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
    )
    text, transcript, pcm, finish = [], [], bytearray(), []
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk" and chunk.model == "demo"
        delta = chunk.choices[0].delta
        if delta.content:
            text.append(delta.content)
        audio = delta.audio  # the SDK's own ChoiceDeltaAudio type
        if audio is not None and audio.data:
            pcm.extend(base64.b64decode(audio.data))
        if audio is not None and audio.transcript:
            transcript.append(audio.transcript)
        if chunk.choices[0].finish_reason:
            finish.append(chunk.choices[0].finish_reason)
    assert len("".join(text).split()) == 4 and "".join(transcript) == "".join(text)
    assert len(pcm) == 2 * samples_for(4)
    assert finish == ["length"]  # max_tokens cut the sentence


def test_a_streamed_text_completion_over_plain_http_ends_with_done(server):
    body = {
        "model": "demo",
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks).count(" ") == 2
    assert all("audio" not in c["choices"][0]["delta"] for c in chunks)


def test_errors_have_the_openai_shape_and_status(client, server):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    assert "this server serves 'demo'" in info.value.message
    with pytest.raises(openai.BadRequestError, match="pcm16"):
        client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "x"}],
            stream=True,
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
        )
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json={"model": "demo", "messages": []}, timeout=30
    )
    assert r.status_code == 400
    assert (
        r.json()["error"]["type"] == "invalid_request_error"
        and r.json()["error"]["param"] == "messages"
    )


# -- the adapter, without a server --------------------------------------------------------------------


def test_the_adapter_maps_a_request_to_the_demo_inputs():
    cfg = load_config("demo")
    opts = adapter_options(cfg.serve.options["openai"], cfg)
    req = parse_request(
        {
            "model": "demo",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
            "max_completion_tokens": 7,
            "modalities": ["text", "audio"],
            "audio": {"voice": "v", "format": "wav"},
        },
        "demo",
        opts,
    )
    assert req["inputs"] == {"text": "hi", "max_tokens": 7, "stream_audio": True, "wav_path": None}
    assert (req["audio"], req["format"], req["stream"]) == (True, "wav", False)
    text_only = parse_request(
        {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}, "demo", opts
    )
    assert text_only["inputs"] == {"text": "hi", "speak": False}


def test_the_apis_own_allow_local_files_is_refused_naming_serve_allow_local_files():
    cfg = load_config("demo")
    for value in (True, False):
        with pytest.raises(ConfigError, match=r"serve\.options\.openai\.allow_local_files: this option was removed: "
                                              r"set serve\.allow_local_files to the directory"):
            adapter_options({**cfg.serve.options["openai"], "allow_local_files": value}, cfg)
    raw = yaml.safe_load((files("omni_contrib_stages") / "pipelines/demo.yaml").read_text())
    raw["serve"]["options"]["openai"]["allow_local_files"] = True
    with pytest.raises(ConfigError, match=r"serve\.options\.openai\.allow_local_files: this option was removed"):
        load_config(raw)  # omni validate and omni serve refuse it before anything starts


def test_an_image_url_naming_a_server_file_follows_serve_allow_local_files():
    cfg = load_config("demo")
    options = {**cfg.serve.options["openai"], "messages_key": "messages"}
    body = {"model": "demo", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///srv/files/a.png"}}]}]}
    with pytest.raises(BadRequest, match=r"reads no local files \(its pipeline sets no serve\.allow_local_files\)"):
        parse_request(body, "demo", adapter_options(options, cfg))
    allowing = attrs.evolve(cfg, serve=attrs.evolve(cfg.serve, allow_local_files="/srv/files"))
    req = parse_request(body, "demo", adapter_options(options, allowing))
    # passed on as a path: the stage reads it only inside serve.allow_local_files (omni_core.files.local_path)
    assert req["inputs"]["messages"][0]["content"] == [
        {"type": "image", "image": "/srv/files/a.png", "where": "messages[0].content[0] (image_url)"}]


def test_adapter_options_are_checked_against_the_pipeline():
    cfg = load_config("demo")
    with pytest.raises(ValueError, match="unknown option"):
        adapter_options({"txt_stage": "thinker"}, cfg)
    with pytest.raises(ValueError, match="no stage 'speaker'"):
        adapter_options({"audio_stage": "speaker"}, cfg)
    with pytest.raises(BadRequest, match="no audio output"):
        parse_request(
            {
                "model": "demo",
                "messages": [{"role": "user", "content": "x"}],
                "modalities": ["text", "audio"],
                "audio": {"voice": "v"},
            },
            "demo",
            adapter_options({}, cfg),
        )


def test_omni_validate_checks_the_adapter_options_against_the_schema_the_api_registered(tmp_path):
    """Wrong adapter options are config errors with their path before anything starts, not a
    server that fails at start-up (the schema is registration metadata: nothing is imported)."""
    import subprocess
    import sys
    from pathlib import Path

    config = tmp_path / "served.yaml"
    config.write_text(
        "name: served\n"
        "stages:\n"
        "  - {name: talk, factory: contrib.tee, terminal: true}\n"
        "serve:\n"
        "  apis: [openai]\n"
        "  options:\n"
        "    openai: {sample_rate: '24000', txt_stage: talk, voice_key: null}\n"
    )
    omni = str(Path(sys.executable).parent / "omni")
    done = subprocess.run([omni, "validate", str(config)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert "serve.options.openai.sample_rate: expected a positive integer, got '24000'" in out
    assert "serve.options.openai.txt_stage: unknown option 'txt_stage' for API 'openai' (did you mean 'text_stage'?)" in out
    assert "voice_key" not in out and "Traceback" not in out
    with pytest.raises(ValueError, match="serve.options.openai.sample_rate"):
        adapter_options({"sample_rate": "24000"}, load_config("demo"))


# -- usage and finish_reason: the pipeline's own numbers -----------------------------------------------


def demo_prompt_tokens(client, content: str) -> int:
    return client.chat.completions.create(model="demo", messages=[{"role": "user", "content": content}],
                                          max_tokens=1).usage.prompt_tokens


def test_usage_counts_the_prompt_as_the_model_saw_it_and_the_generated_tokens(client):
    done = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hello omni"}])
    words = done.choices[0].message.content.rstrip(".").split()
    # No max_tokens: the demo writes its one 13-word sentence and stops.
    assert done.choices[0].finish_reason == "stop" and len(words) == 13
    usage = done.usage
    assert usage.completion_tokens == 13 and usage.total_tokens == usage.prompt_tokens + 13
    # The thinker reads the encoders' prefix rows plus the prompt's bytes: 7 more bytes, 7 more tokens.
    assert usage.prompt_tokens > len(b"hello omni")
    assert demo_prompt_tokens(client, "hello omni, again") == usage.prompt_tokens + 7
    cut = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hello omni"}],
                                         max_tokens=20)
    assert cut.choices[0].finish_reason == "length"  # 13 + 7 of the second sentence
    assert (cut.usage.prompt_tokens, cut.usage.completion_tokens) == (usage.prompt_tokens, 20)


def test_a_stream_ends_with_its_finish_reason_then_the_usage_chunk_when_asked(client, server):
    stream = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hello omni"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}, modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"})
    chunks = list(stream)
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 4
    assert last.usage.prompt_tokens == demo_prompt_tokens(client, "hello omni")
    assert all(c.usage is None for c in body)
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == ["length"]
    assert body[-1].choices[0].finish_reason == "length"
    # Without stream_options: no usage member at all (the SDK reads it as None), no usage chunk.
    plain = {"model": "demo", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=plain, timeout=60) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("usage" not in c for c in data) and data[-1]["choices"][0]["finish_reason"] == "stop"
    bad = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                     json={**plain, "stream": False, "stream_options": {"include_usage": True}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_options"


def test_the_usage_fields_are_adapter_options():
    from omni_contrib_stages.api_common import usage_of

    opts = adapter_options({"prompt_tokens_field": "n_in", "completion_tokens_field": "n_out",
                            "finish_reason_field": "why"}, load_config("demo"))
    result = {"thinker": {"n_in": 7, "n_out": 3, "why": "length"}, "vocoder": {}}
    assert usage_of(result, opts, "thinker") == ({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
                                                 "length")
    # No counts (or not counts): usage null rather than made-up numbers; finish_reason stop.
    assert usage_of({"thinker": {"text": "x"}}, opts, "thinker") == (None, "stop")
    assert usage_of({"thinker": {"n_in": -1, "n_out": True}}, opts, "thinker") == (None, "stop")


def test_a_one_stage_result_with_a_field_named_like_its_stage_is_that_stages_part():
    """Qwen's text-only stage is named ``text`` and its result has a ``text`` field: that string
    is not the stage's part of the result (a result keyed by stage holds mappings)."""
    from omni_contrib_stages.api_common import final_text, usage_of

    opts = adapter_options({}, load_config("demo"))
    result = {"text": "hello", "prompt_tokens": 5, "completion_tokens": 2, "finish_reason": "length"}
    assert usage_of(result, opts, "text") == ({"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
                                              "length")
    assert final_text(result, {**opts, "result_text_field": "text"}, ["he", "llo!"], "text") == "hello"
    keyed = {"text": {"text": "hi", "prompt_tokens": 1, "completion_tokens": 1}, "token2wav": {}}
    assert usage_of(keyed, opts, "text")[0] == {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}


def test_the_openai_and_realtime_apis_read_a_pipeline_through_one_module():
    """The chunk readers, usage and audio helpers both APIs use are api_common's (the names the
    openai module exported stay importable from it)."""
    from omni_contrib_stages import api_common, openai_api, realtime
    from omni_contrib_stages.realtime import protocol

    assert openai_api.pcm16 is realtime.pcm16 is api_common.pcm16
    assert openai_api.usage_of is realtime.usage_of is api_common.usage_of
    assert openai_api.stage_part is api_common.stage_part and openai_api.wav_bytes is api_common.wav_bytes
    cfg = load_config("demo")
    chat, live = adapter_options(cfg.serve.options["openai"], cfg), protocol.realtime_options({}, cfg)
    for key in api_common.SHARED_OPTIONS:  # realtime defaults the shared keys to the openai API's
        assert live[key] == chat[key], key
    chunk = {chat["text_field"]: "hi", chat["audio_field"]: [0.5, -0.5], chat["sample_rate_field"]: 16000}
    assert api_common.text_of(chunk, chat) == "hi" and api_common.text_of("hi", chat) == "hi"
    assert api_common.text_of({"other": 1}, chat) is None
    assert api_common.audio_of(chunk, chat) == b"\x00\x40\x00\xc0" and api_common.audio_of({}, chat) is None
    assert api_common.rate_of(chunk, chat) == 16000 and api_common.rate_of({}, chat) == chat["sample_rate"]
    assert api_common.rate_of({chat["sample_rate_field"]: True}, chat) == chat["sample_rate"]
    assert api_common.text_stage_for({**chat, "text_only_stage": "thinker"}, want_audio=False) == "thinker"

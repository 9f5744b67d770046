"""``omni serve qwen2_5_omni`` with the official ``openai`` SDK and omni inputs: a user message
with ``input_audio`` (base64 WAV) and ``image_url`` (a data URL) parts, streamed and not, against
the pipeline's own answer for the same media; a server file outside serve.allow_local_files is
refused, and the streamed audio comes in several deltas."""

from __future__ import annotations

import base64
import io
import shutil
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile
from omni_core.encoding import from_jsonable
from test_serve_openai import ConsoleServer, assert_same_pcm

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 6
TALKER_CODES = 48


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from PIL import Image

    folder = tmp_path_factory.mktemp("media")
    shutil.copy(Path(__file__).parent / "data" / "hello.wav", folder / "speech.wav")  # espeak-ng speech
    pixels = (np.random.RandomState(3).rand(64, 96, 3) * 255).astype(np.uint8)
    Image.fromarray(pixels, "RGB").save(folder / "photo.png")
    return folder


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory, files):
    """The shipped qwen2_5_omni config, its adapter's inputs capping the talker at 48 codes (the
    tiny talker may otherwise speak for hundreds); network requests may name the files of ``files``
    (serve.allow_local_files), so the core route can give the pipeline the same media as paths."""
    from importlib.resources import files as package_files

    import yaml

    config = yaml.safe_load((package_files("omni_transformers") / "pipelines/qwen2_5_omni.yaml").read_text())
    config["serve"]["options"]["openai"]["inputs"]["talker_max_new_tokens"] = TALKER_CODES
    config["serve"]["allow_local_files"] = str(files)
    cwd = tmp_path_factory.mktemp("serve")
    srv = ConsoleServer.of_config(config, tmp_path_factory.mktemp("config"), name="qwen2_5_omni", cwd=cwd,
                                  env={"OMNI_TRANSFORMERS_MODEL": str(tiny_model)})
    with srv.serving(stop_timeout=120):
        yield srv
        assert not list(cwd.iterdir()), "a request wrote a file in the server's working directory"


def openai_parts(files) -> list[dict]:
    audio = base64.b64encode((files / "speech.wav").read_bytes()).decode()
    image = base64.b64encode((files / "photo.png").read_bytes()).decode()
    return [{"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
            {"type": "text", "text": "what is this?"}]


@pytest.fixture(scope="module")
def native(server, files):
    """The pipeline's own result for the same conversation, the media given as file paths."""
    inputs = {"wav_path": None, "max_new_tokens": MAX_TOKENS, "speaker": "Chelsie", "talker_max_new_tokens": TALKER_CODES,
              "messages": [{"role": "user", "content": [
                  {"type": "audio", "audio": str(files / "speech.wav")},
                  {"type": "image", "image": str(files / "photo.png")},
                  {"type": "text", "text": "what is this?"}]}]}
    r = httpx.post(f"{server.url}/v1/pipelines/qwen2_5_omni/requests", json={"input": inputs}, timeout=300)
    assert r.status_code == 200, r.text
    return from_jsonable(r.json()["result"], "result")


def test_openai_sdk_with_input_audio_and_image_url(server, files, native):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300)
    messages = [{"role": "user", "content": openai_parts(files)}]
    done = client.chat.completions.create(model="qwen2_5_omni", messages=messages, max_tokens=MAX_TOKENS,
                                          modalities=["text", "audio"],
                                          audio={"voice": "Chelsie", "format": "wav"})
    assert done.choices[0].message.content == native["text"]
    wav = base64.b64decode(done.choices[0].message.audio.data)
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="int16")
    assert rate == 24000
    assert_same_pcm(samples.tobytes(), native["audio"])
    assert done.usage.prompt_tokens > 100  # the audio and image placeholders count

    deltas, pcm, text = [], bytearray(), []
    stream = client.chat.completions.create(model="qwen2_5_omni", messages=messages, max_tokens=MAX_TOKENS,
                                            modalities=["text", "audio"], stream=True,
                                            audio={"voice": "Chelsie", "format": "pcm16"})
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            text.append(delta.content)
        audio = getattr(delta, "audio", None)
        data = (audio.get("data") if isinstance(audio, dict) else getattr(audio, "data", None)) if audio else None
        if data:
            deltas.append(data)
            pcm.extend(base64.b64decode(data))
    assert "".join(text) == native["text"]
    assert_same_pcm(bytes(pcm), native["audio"])
    if len(native["codes"]) >= 13:  # the first chunk needs 13 codes: then the audio comes in several deltas
        assert len(deltas) >= 2


def test_local_files_and_bad_parts_are_refused(server, files):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300)
    for part, words in [
        # serve.allow_local_files names `files`: a server file outside it is the stage's 400
        ({"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}, "not a file inside the directory"),
        ({"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}, "does not fetch"),
        ({"type": "input_audio", "input_audio": {"data": "!!!", "format": "wav"}}, "not valid base64"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aiff"}}, "format must be"),
        ({"type": "video_url", "video_url": {"url": "x"}}, "must be text, input_audio or image_url"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="qwen2_5_omni", max_tokens=2,
                                           messages=[{"role": "user", "content": [part]}])
        assert words in str(info.value), str(info.value)
    # audio that is not audio: the processor fails that request, the server goes on
    bad = base64.b64encode(b"not a wav file").decode()
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="qwen2_5_omni", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": bad, "format": "wav"}}]}])
    assert "cannot read audio" in str(info.value)
    ok = client.chat.completions.create(model="qwen2_5_omni", max_tokens=2,
                                        messages=[{"role": "user", "content": "hello"}])
    assert ok.choices[0].message.content is not None

"""``omni serve qwen2_5_omni`` (tiny checkpoint) with ``serve.allow_local_files`` set to a root:
the paths a request names (``audio``, ``image``, their parts in ``messages``, ``wav_path``) are
read or written inside the root and refused outside it — absolute, ``..``, symlinks out, existing
or missing or unreadable, one answer for all — and nothing outside is created. Each client mistake
(a corrupt WAV, a non-image data URL, 30 s of audio, a local file on the OpenAI route, a huge
``max_tokens``, ``{"input": "hi"}``, ``{"input": {"text": 5}}``) is a 400 that the official SDK
raises as ``BadRequestError`` after one POST."""

from __future__ import annotations

import base64
import io
import os
from importlib.resources import files as package_files

import httpx
import numpy as np
import openai
import pytest
import soundfile
import yaml
from omni_core.testing.serve import openai_client
from test_serve_openai import ConsoleServer

pytestmark = pytest.mark.timeout(900)

MODEL = "qwen2_5_omni"
REQUESTS = f"/v1/pipelines/{MODEL}/requests"


def wav(seconds: float, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    soundfile.write(buf, (0.1 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def snapshot(*folders) -> dict[str, list[str]]:
    return {str(f): sorted(str(p) for p in f.rglob("*")) for f in folders}


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    base = tmp_path_factory.mktemp("files")
    cwd, root, outside = base / "cwd", base / "root", base / "outside"
    for folder in (cwd, root, outside):
        folder.mkdir()
    (root / "in.wav").write_bytes(wav(0.5))
    (root / "in.png").write_bytes(png())
    (outside / "real.wav").write_bytes(wav(0.5))
    (outside / "real.png").write_bytes(png())
    (outside / "locked.wav").write_bytes(wav(0.5))
    os.chmod(outside / "locked.wav", 0)
    (root / "out").symlink_to(outside)
    yield {"cwd": cwd, "root": root, "outside": outside}
    os.chmod(outside / "locked.wav", 0o600)


@pytest.fixture(scope="module")
def server(tiny_model, places, tmp_path_factory):
    config = yaml.safe_load((package_files("omni_transformers") / f"pipelines/{MODEL}.yaml").read_text())
    config["serve"]["allow_local_files"] = str(places["root"])
    config["serve"]["options"]["openai"]["inputs"]["talker_max_new_tokens"] = 8
    srv = ConsoleServer.of_config(config, tmp_path_factory.mktemp("config"), name=MODEL, cwd=places["cwd"],
                                  env={"OMNI_TRANSFORMERS_MODEL": str(tiny_model)})
    with srv.serving(stop_timeout=120):
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=600) as c:
        yield c


def post(http, inputs: dict) -> httpx.Response:
    return http.post(REQUESTS, json={"input": {"max_new_tokens": 2, "talker_max_new_tokens": 4, **inputs}})


def outside_values(places, name: str) -> list[str]:
    outside = places["outside"]
    suffix = name.rsplit(".", 1)[1]
    return [str(outside / name), str(outside / f"missing.{suffix}"), str(outside / "locked.wav"), "/etc/hostname",
            f"../outside/{name}", f"../outside/missing.{suffix}", f"out/{name}", f"out/missing.{suffix}",
            "/proc/self/environ", str(places["root"] / ".." / "outside" / name)]


@pytest.mark.parametrize(("key", "name"), [("audio", "real.wav"), ("image", "real.png")])
def test_a_media_path_outside_the_root_is_one_400_whatever_is_there(http, places, key, name):
    before = snapshot(places["cwd"], places["outside"])
    messages = set()
    for value in outside_values(places, name):
        for inputs, field in (({"text": "hi", key: value}, key),
                              ({"messages": [{"role": "user", "content": [{"type": key, key: value}]}]},
                               "messages[0].content[0]")):
            r = post(http, inputs)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["type"], error["stage"], error["field"]) == ("InvalidInput", "processor", field)
            messages.add(error["message"].replace(repr(value), "VALUE").replace(f" ({key})", ""))
    assert len({m.partition(":")[2] for m in messages}) == 1, messages
    assert snapshot(places["cwd"], places["outside"]) == before


@pytest.mark.parametrize(("inputs", "what"), [({"text": "what is this?", "image": "in.png"}, "image"),
                                              ({"text": "what is this?", "audio": "in.wav"}, "audio")])
def test_a_media_path_inside_the_root_is_read(http, places, inputs, what):
    r = post(http, {**inputs, "return_audio": False})
    assert r.status_code == 200, r.text
    r = post(http, {**inputs, what: str(places["root"] / inputs[what]), "return_audio": False})
    assert r.status_code == 200, r.text


def test_wav_path_is_written_inside_the_root_and_refused_outside(http, places):
    root, outside = places["root"], places["outside"]
    r = post(http, {"text": "hi", "wav_path": "made/a.wav"})
    assert r.status_code == 200, r.text
    assert (root / "made" / "a.wav").read_bytes()[:4] == b"RIFF"
    before = snapshot(places["cwd"], outside)
    for value in (str(outside / "w.wav"), "../outside/w.wav", "out/w.wav", "/tmp/omni-w.wav"):
        r = post(http, {"text": "hi", "wav_path": value})
        assert r.status_code == 400 and r.json()["error"]["field"] == "wav_path", r.text
    assert snapshot(places["cwd"], outside) == before and not os.path.exists("/tmp/omni-w.wav")


# -- client mistakes: one POST, a BadRequestError -------------------------------------------------


@pytest.fixture
def sdk(server):
    posts: list[str] = []
    with openai_client(server, posts, timeout=600) as c:
        assert c.max_retries >= 1
        yield c, posts


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "what is this?"}]}]


def audio_part(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(("messages", "extra", "words"), [
    (user(audio_part(b"RIFF not a wav at all")), {}, "cannot read audio"),
    (user(audio_part(wav(30))), {}, "s long"),
    (user(image_part("data:image/png;base64," + base64.b64encode(b"no image here").decode())), {}, "image"),
    (user(image_part("file:///etc/hostname")), {}, "not a file inside the directory"),
    ([{"role": "user", "content": "hi"}], {"max_tokens": 1000000000}, "max"),
])
def test_each_chat_mistake_is_a_bad_request_after_one_post(sdk, messages, extra, words):
    client, posts = sdk
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, **extra)
    assert posts == ["/v1/chat/completions"]
    assert words in str(caught.value)


@pytest.mark.parametrize(("body", "field"), [
    ({"input": "hi"}, None),
    ({"input": {"text": 5}}, "text"),
    ({"input": {"text": "hi", "max_new_tokens": 1000000000}}, "max_new_tokens"),
    ({"input": {"text": "hi", "audio": base64.b64encode(b"x").decode()}}, "audio"),
    ({"input": {"text": "hi", "speaker": []}}, "speaker"),
    ({"input": {"text": "hi", "system_prompt": 5}}, "system_prompt"),
    ({"input": {"input_ids": [-1, 10**9]}}, "input_ids"),
])
def test_each_core_route_mistake_is_a_bad_request_after_one_post(sdk, body, field):
    client, posts = sdk
    with pytest.raises(openai.BadRequestError) as caught:
        client.post(f"/pipelines/{MODEL}/requests", body=body, cast_to=httpx.Response)
    assert posts == [REQUESTS]
    error = caught.value.body.get("error", caught.value.body)
    assert error["type"] == "InvalidInput" and error.get("field") == field, error

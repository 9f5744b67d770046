"""``omni serve qwen2_5_omni`` on the tiny checkpoint: the OpenAI parameters it honours (``seed``,
``temperature``, ``top_p``, ``top_k``, ``n``, ``max_tokens``) and refuses, through the official ``openai`` SDK with its default retries, counting
POSTs; ``models.retrieve``; streamed text equal to the non-streamed text; a media error naming the
client's own message index; ``realtime`` mounted by the config.

The tiny checkpoint's thinker is greedy (its generation config), its talker samples: a seed shows
in the audio, which is reproducible per seed and differs between two seeds."""

from __future__ import annotations

import base64

import openai
import pytest
from omni_core.testing.serve import openai_client
from test_serve_openai import ConsoleServer

pytestmark = pytest.mark.timeout(900)

MODEL = "qwen2_5_omni"
HELLO = [{"role": "user", "content": "hello omni"}]
TALKER_CODES = 32


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """The shipped config, its adapter's inputs capping the talker (the tiny talker may otherwise
    speak for hundreds of codes)."""
    from importlib.resources import files as package_files

    import yaml

    config = yaml.safe_load((package_files("omni_transformers") / "pipelines/qwen2_5_omni.yaml").read_text())
    assert config["serve"]["apis"] == ["openai", "realtime"]
    config["serve"]["options"]["openai"]["inputs"]["talker_max_new_tokens"] = TALKER_CODES
    config["serve"]["options"]["openai"]["inputs"]["max_new_tokens"] = 8  # when a client sets no limit
    srv = ConsoleServer.of_config(config, tmp_path_factory.mktemp("config"), name=MODEL,
                                  cwd=tmp_path_factory.mktemp("serve"), env={"OMNI_TRANSFORMERS_MODEL": str(tiny_model)})
    with srv.serving(stop_timeout=120):
        yield srv


@pytest.fixture
def posts():
    return []


@pytest.fixture
def client(server, posts):
    with openai_client(server, posts, timeout=600) as c:
        yield c


def spoken(client, **kwargs) -> list[tuple[str, bytes]]:
    """Each choice's (text, PCM16) of a non-streamed request with audio."""
    done = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, modalities=["text", "audio"],
                                          audio={"voice": "Chelsie", "format": "pcm16"}, **kwargs)
    return [(c.message.content, base64.b64decode(c.message.audio.data)) for c in done.choices]


def test_a_seeded_request_is_reproducible_and_two_seeds_differ(client, posts):
    first = spoken(client, seed=11)
    assert first == spoken(client, seed=11)
    other = spoken(client, seed=12)
    assert other[0][0] == first[0][0]  # the greedy thinker's text
    assert other[0][1] != first[0][1]  # the sampling talker's speech
    assert posts == ["/v1/chat/completions"] * 3


def test_n_choices_run_with_seed_plus_their_index(client):
    choices = spoken(client, seed=11, n=2)
    assert choices == spoken(client, seed=11) + spoken(client, seed=12)


def written(client, **kwargs) -> str:
    return client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, **kwargs).choices[0].message.content


def test_the_thinker_samples_per_request_at_the_temperature_it_is_given(client, posts):
    greedy = written(client, seed=3)
    assert written(client, seed=3, temperature=0) == greedy  # temperature 0: greedy, whatever the seed
    hot = written(client, seed=3, temperature=2)
    assert hot == written(client, seed=3, temperature=2)  # reproducible per seed
    assert len({hot, written(client, seed=4, temperature=2), written(client, seed=5, temperature=2)}) > 1
    assert written(client, seed=3, top_p=0.5, extra_body={"top_k": 1}) == greedy  # top_k 1 keeps the argmax only
    assert posts == ["/v1/chat/completions"] * 7


@pytest.mark.parametrize(("param", "kwargs"), [
    ("temperature", {"temperature": 3}),
    ("top_p", {"top_p": 0}),
    ("top_k", {"extra_body": {"top_k": -1}}),
])
def test_bad_sampling_values_are_refused_with_one_post(client, posts, param, kwargs):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, **kwargs)
    assert caught.value.body["param"] == param
    assert posts == ["/v1/chat/completions"]


@pytest.mark.parametrize(("param", "kwargs"), [
    ("stop", {"stop": ".", "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "wav"}}),
    ("frequency_penalty", {"frequency_penalty": 1}),
    ("logprobs", {"logprobs": True}),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
    ("seed", {"seed": "1"}),
    ("unknown_thing", {"extra_body": {"unknown_thing": True}}),
])
def test_what_the_thinker_does_not_take_per_request_is_refused_with_one_post(client, posts, param, kwargs):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, **kwargs)
    assert caught.value.body["param"] == param and caught.value.body["type"] == "invalid_request_error"
    assert posts == ["/v1/chat/completions"]


def test_streamed_text_equals_the_non_streamed_text(client):
    for prompt, max_tokens in [("hello omni", 5), ("what is this?", 9), ("hi", 1)]:
        messages = [{"role": "user", "content": prompt}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens)
        deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, stream=True) if c.choices]
        assert "".join(deltas) == whole.choices[0].message.content


def test_stop_cuts_the_text(client):
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8).choices[0].message.content
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    want = whole[:whole.index(stop)]
    done = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, stop=[stop])
    assert (done.choices[0].message.content, done.choices[0].finish_reason) == (want, "stop")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=8, stop=[stop], stream=True) if c.choices)
    assert streamed == want


def test_models_retrieve(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("demo")


def test_a_media_error_names_the_clients_message_index(client, posts):
    bad = base64.b64encode(b"not a wav file").decode()
    for messages, where in [
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": bad, "format": "wav"}}]}],
         "messages[0].content[0]"),
        ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "hello"},
          {"role": "user", "content": [{"type": "text", "text": "and this?"},
                                       {"type": "input_audio", "input_audio": {"data": bad, "format": "wav"}}]}],
         "messages[3].content[1]"),
    ]:
        posts.clear()
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert posts == ["/v1/chat/completions"]
        assert caught.value.body["param"] == where, caught.value.body
        assert where in caught.value.body["message"] and "wav_path" not in caught.value.body["message"]


def test_the_config_mounts_realtime_and_the_docs_script_gets_speech(server, tmp_path):
    """docs/serving.md's realtime quickstart with ``model="qwen2_5_omni"``, as the docs say."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[3] / "docs" / "serving.md").read_text()
    section = docs[docs.index("\n## Realtime\n"):]
    quickstart = re.findall(r"```python\n(.*?)```", section[: section.index("\n## ", 1)], re.S)[0]
    assert 'model="demo"' in quickstart
    (tmp_path / "quickstart.py").write_text(quickstart.replace('model="demo"', f'model="{MODEL}"'))
    out = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, env={**os.environ, "OMNI_URL": server.url},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    summary = out.stdout.strip().splitlines()[-1]
    seconds, tokens = re.fullmatch(r"completed: (\d+\.\d\d) s of audio, (\d+) tokens", summary).groups()
    assert float(seconds) > 0 and 0 < int(tokens) <= 8, summary

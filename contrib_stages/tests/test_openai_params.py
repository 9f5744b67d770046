"""The ``openai`` API's request parameters against a real ``omni serve demo``, through the official
``openai`` SDK with its default retries: every parameter is honoured or refused by name, a refusal
is a ``BadRequestError`` after ONE POST (the SDK retries 5xx, 408, 409 and 429, so a second POST
would show a wrong status), ``n`` choices, ``models.retrieve``, streamed deltas that join to the
non-streamed answer, the 413 in OpenAI's shape."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from omni_core.testing.serve import ServerProcess, openai_client

pytestmark = pytest.mark.timeout(300)

HELLO = [{"role": "user", "content": "hello omni"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess("demo", cwd=str(tmp_path_factory.mktemp("serve")), ready_timeout=300).serving() as srv:
        yield srv


@pytest.fixture
def posts(server):
    """The POSTs the client below sends, by path."""
    return []


@pytest.fixture
def client(server, posts):
    """The SDK with its default retries; every POST it sends is counted."""
    with openai_client(server, posts) as c:
        assert c.max_retries >= 1  # a status the SDK retries would show as a second POST
        yield c


def refused(client, posts, param: str, **kwargs) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=HELLO, max_tokens=3, **kwargs)
    err = caught.value
    assert posts == ["/v1/chat/completions"], posts  # one POST: no retry
    assert err.status_code == 400
    body = err.body
    assert body["type"] == "invalid_request_error" and body["param"] == param, body
    assert param.split(".")[0] in body["message"]
    return err


@pytest.mark.parametrize(("param", "kwargs"), [
    ("temperature", {"temperature": 0.5}),
    ("top_p", {"top_p": 0.5}),
    ("top_k", {"extra_body": {"top_k": 5}}),
    ("seed", {"seed": 7}),
    ("stop", {"stop": ["river"], "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}),
    ("stop", {"stop": ["a", "b", "c", "d", "e"]}),
    ("presence_penalty", {"presence_penalty": 0.5}),
    ("frequency_penalty", {"frequency_penalty": -1}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("logprobs", {"logprobs": True}),
    ("top_logprobs", {"top_logprobs": 2}),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
    ("tool_choice", {"tool_choice": "required"}),
    ("store", {"store": True}),
    ("n", {"n": 99}),
    ("n", {"n": 0}),
    ("temperature", {"temperature": 3}),
    ("max_tokens", {"extra_body": {"max_tokens": 1_000_000_000}}),
    ("max_completion_tokens", {"max_completion_tokens": 0}),
    ("user", {"user": 5}),
])
def test_a_parameter_the_demo_does_not_honour_is_refused_by_name_with_one_post(client, posts, param, kwargs):
    refused(client, posts, param, **kwargs)


def test_an_unknown_field_is_refused_listing_the_allowed_ones(client, posts):
    err = refused(client, posts, "frobnicate", extra_body={"frobnicate": 1})
    assert "temperature" in err.body["message"] and "max_completion_tokens" in err.body["message"]


def test_a_sampling_parameter_at_openais_default_and_ignored_fields_are_accepted(client, posts):
    plain = client.chat.completions.create(model="demo", messages=HELLO, max_tokens=4)
    done = client.chat.completions.create(
        model="demo", messages=HELLO, max_tokens=4, temperature=1, top_p=1, presence_penalty=0, frequency_penalty=0,
        user="someone", metadata={"k": "v"}, response_format={"type": "text"}, logprobs=False, tools=[],
        tool_choice="none", store=False, n=1, seed=None)
    assert done.choices[0].message.content == plain.choices[0].message.content
    assert posts == ["/v1/chat/completions"] * 2


def test_n_choices_each_with_its_index(client):
    one = client.chat.completions.create(model="demo", messages=HELLO, max_tokens=5)
    done = client.chat.completions.create(model="demo", messages=HELLO, max_tokens=5, n=3)
    assert [c.index for c in done.choices] == [0, 1, 2]
    # The demo's thinker is greedy: every choice is its one answer.
    assert {c.message.content for c in done.choices} == {one.choices[0].message.content}
    assert done.usage.prompt_tokens == one.usage.prompt_tokens
    assert done.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_n_streamed_choices_join_to_the_answer(client):
    one = client.chat.completions.create(model="demo", messages=HELLO, max_tokens=6).choices[0].message.content
    texts = ["", ""]
    finishes = [None, None]
    for chunk in client.chat.completions.create(model="demo", messages=HELLO, max_tokens=6, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [one, one] and finishes == ["length", "length"]


@pytest.mark.parametrize(("prompt", "max_tokens"), [("hello omni", 13), ("hello omni", 5), ("a river", 26),
                                                    ("why?", 1)])
def test_streamed_deltas_join_to_the_non_streamed_text(client, prompt, max_tokens):
    messages = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(model="demo", messages=messages, max_tokens=max_tokens)
    text = whole.choices[0].message.content
    deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="demo", messages=messages, max_tokens=max_tokens, stream=True) if c.choices]
    assert "".join(deltas) == text and text.endswith(".")


def test_streamed_transcript_with_audio_joins_to_the_text(client):
    whole = client.chat.completions.create(model="demo", messages=HELLO, max_tokens=3).choices[0].message.content
    text = transcript = ""
    for chunk in client.chat.completions.create(model="demo", messages=HELLO, max_tokens=3, stream=True,
                                                modalities=["text", "audio"],
                                                audio={"voice": "alloy", "format": "pcm16"}):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.delta.audio is not None:
                transcript += choice.delta.audio.transcript or ""
    assert text == transcript == whole


@pytest.mark.parametrize("n", [1, 2])
def test_stop_sequences_cut_the_text_streamed_or_not(client, n):
    whole = client.chat.completions.create(model="demo", messages=HELLO, max_tokens=13).choices[0].message.content
    words = whole.split()
    stop = words[5][:3]  # the start of the 6th word; a stop sequence may end inside a word
    want = whole[:whole.index(stop)]
    done = client.chat.completions.create(model="demo", messages=HELLO, max_tokens=13, stop=["zzz", stop], n=n)
    assert [(c.message.content, c.finish_reason) for c in done.choices] == [(want, "stop")] * n
    texts, finishes = [""] * n, [None] * n
    for chunk in client.chat.completions.create(model="demo", messages=HELLO, max_tokens=13, stop=stop, n=n,
                                                stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [want] * n and finishes == ["stop"] * n
    # A stop sequence in what the result adds to the streamed words (the final "."), and one never met.
    for stop, text, finish in [(".", whole[:-1], "stop"), ("zzz", whole, "stop")]:
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="demo", messages=HELLO, max_tokens=13, stop=stop, stream=True) if c.choices)
        done = client.chat.completions.create(model="demo", messages=HELLO, max_tokens=13, stop=stop)
        assert streamed == done.choices[0].message.content == text and done.choices[0].finish_reason == finish


def test_models_retrieve(client):
    model = client.models.retrieve("demo")
    assert model.id == "demo" and model.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


def test_a_body_over_the_limit_is_a_413_in_openais_shape(server):
    too_big = b"[" + b" " * (16 * 1024 * 1024) + b"]"
    r = httpx.post(f"{server.url}/v1/chat/completions", content=too_big,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "RequestTooLarge"
    assert "serve.max_request_bytes" in error["message"] and set(error) == {"message", "type", "param", "code"}
    # The core route keeps its own shape.
    r = httpx.post(f"{server.url}/v1/pipelines/demo/requests", content=too_big,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLarge"


def test_a_deeply_nested_body_is_a_400_in_openais_shape(server):
    depth = 100_000
    body = '{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "metadata": ' + "[" * depth + \
        "]" * depth + "}"
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def logged(server, **fields) -> dict:
    """The server's first JSON log record with ``fields``, once it is written."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in server.output().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and all(record.get(k) == v for k, v in fields.items()):
                return record
        time.sleep(0.05)
    raise AssertionError(f"no log record with {fields}:\n{server.output()[-3000:]}")


def test_a_refused_request_is_logged_at_warning(server, client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=HELLO, max_tokens=3, top_p=0.25)
    record = logged(server, param="top_p", event="chat request refused")
    assert record["level"] == "warning" and record["status"] == 400


ECHO = """
name: echo
stages:
  - name: echo
    factory: openai_stages:Echo
    terminal: true
serve:
  apis: [openai]
  options:
    openai:
      max_tokens_key: max_tokens
      text_joiner: ""
      max_tokens_limit: 100
      sampling: {temperature: temp, top_p: top_p, top_k: top_k, seed: seed, stop: stop, presence_penalty: presence,
                 frequency_penalty: frequency}
"""


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    """A pipeline that maps every sampling parameter and answers with the inputs it got."""
    from pathlib import Path

    with ServerProcess.of_config(ECHO, tmp_path_factory.mktemp("echo"), name="echo",
                                 pythonpath=[Path(__file__).parent]).serving() as srv:
        yield srv


@pytest.fixture
def echo_client(echo, posts):
    with openai_client(echo, posts) as c:
        yield c


def test_mapped_sampling_parameters_reach_the_pipeline_under_its_keys(echo_client):
    done = echo_client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "hi"}], max_tokens=9, temperature=0.25, top_p=0.5,
        seed=42, stop="never", presence_penalty=0.5, frequency_penalty=-0.5, extra_body={"top_k": 3})
    assert json.loads(done.choices[0].message.content) == {
        "text": "hi", "max_tokens": 9, "temp": 0.25, "top_p": 0.5, "top_k": 3, "seed": 42, "stop": ["never"],
        "presence": 0.5, "frequency": -0.5}
    streamed = "".join(c.choices[0].delta.content or "" for c in echo_client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "hi"}], temperature=0.25, stream=True) if c.choices)
    assert json.loads(streamed) == {"text": "hi", "temp": 0.25}


def test_each_of_n_choices_gets_seed_plus_its_index(echo_client):
    for seed, want in [(7, [7, 8, 9]), (None, [None, 1, 2]), (2**63 - 1, [2**63 - 1, -(2**63), -(2**63) + 1])]:
        done = echo_client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}],
                                                   n=3, seed=seed)
        assert [json.loads(c.message.content).get("seed") for c in done.choices] == want


def test_a_stage_refusing_an_input_is_a_400_naming_the_clients_parameter(echo, echo_client, posts):
    with pytest.raises(openai.BadRequestError) as caught:
        echo_client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "invalid"}],
                                            temperature=1.9)
    assert caught.value.body["param"] == "temperature" and "below 1.5" in caught.value.body["message"]
    assert posts == ["/v1/chat/completions"]
    record = logged(echo, event="chat request refused", param="temperature")
    assert record["level"] == "warning"


def test_a_stage_bug_is_a_500_logged_at_error_with_its_traceback(echo, echo_client):
    with pytest.raises(openai.InternalServerError) as caught:
        echo_client.with_options(max_retries=0).chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "crash"}])
    assert caught.value.body["type"] == "server_error" and "crashed on purpose" in caught.value.body["message"]
    record = logged(echo, event="chat request failed")
    assert record["level"] == "error" and "crashed on purpose" in record["traceback"]
    # The server goes on.
    assert echo_client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "ok"}]).choices


def test_n_choices_usage_counts_the_prompt_once_streamed_or_not(echo_client):
    messages = [{"role": "user", "content": "hi"}]
    done = echo_client.chat.completions.create(model="echo", messages=messages, n=2, seed=1)
    completion = [len(c.message.content) // 7 + 1 for c in done.choices]  # the echo stage's count
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (
        3, sum(completion), 3 + sum(completion))
    chunks = list(echo_client.chat.completions.create(model="echo", messages=messages, n=2, seed=1, stream=True,
                                                      stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == done.usage
    texts = ["", ""]
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in done.choices]

"""``omni serve demo`` behind an API key: the official ``openai`` SDK chats with it (and gets
AuthenticationError without it, in OpenAI's error shape), opens the Realtime WebSocket with it, and a
browser's ``openai-insecure-api-key.`` subprotocol gets ``realtime`` back, never the key."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from omni_core.testing.serve import ServerProcess

pytestmark = pytest.mark.timeout(300)

ENV = {"OMNI_LOAD_PLUGINS": "contrib"}
KEY = "sk-omni-test-0123456789"


# -- the OpenAI routes and the Realtime WebSocket of the demo, with the official SDK ----------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    srv = ServerProcess("demo", "--api", "realtime", "--api-key", KEY, env=ENV,
                        cwd=str(tmp_path_factory.mktemp("demo")), ready_timeout=300)
    with srv.serving():
        yield srv


def test_the_sdk_chats_with_the_key_and_gets_authentication_error_without(demo):
    client = openai.OpenAI(base_url=f"{demo.url}/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert reply.choices[0].message.content
    assert [m.id for m in client.models.list()] == ["demo"]
    wrong = openai.OpenAI(base_url=f"{demo.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 401
    body = refused.value.body
    assert set(body) >= {"message", "type", "param", "code"} and body["code"] == "invalid_api_key"  # the OpenAI shape


def _realtime_text_turn(url: str, key: str) -> list:
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        async with client.realtime.connect(model="demo") as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "hello"}]})
            await conn.response.create()
            events = []
            async for event in conn:
                events.append(event)
                if event.type in ("response.done", "error"):
                    return events
        return events

    return asyncio.run(asyncio.wait_for(main(), 120))


def test_the_sdk_opens_the_realtime_websocket_with_the_key(demo):
    events = _realtime_text_turn(demo.url, KEY)
    assert events[-1].type == "response.done", events
    with pytest.raises(Exception) as refused:
        _realtime_text_turn(demo.url, "wrong")
    assert "401" in str(refused.value)


def test_a_browser_sends_the_key_as_a_subprotocol_and_gets_realtime_back(demo):
    from websockets.sync.client import connect

    protocols = ["realtime", f"openai-insecure-api-key.{KEY}", "openai-beta.realtime-v1"]
    with connect(f"{demo.url.replace('http', 'ws')}/v1/realtime?model=demo", subprotocols=protocols) as ws:
        assert ws.subprotocol == "realtime"  # never the key
        first = json.loads(ws.recv(timeout=30))
        assert first["type"] == "session.created"


def test_the_websocket_refusal_names_the_api_to_mount(tmp_path):
    from websockets.sync.client import connect

    srv = ServerProcess("demo", "--api-key", KEY, env=ENV, cwd=str(tmp_path), ready_timeout=300)  # no realtime
    with srv.serving(), connect(f"{srv.url.replace('http', 'ws')}/v1/realtime?model=demo",
                 additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        event = json.loads(ws.recv(timeout=30))
    assert event["type"] == "error"
    message = event["error"]["message"]
    assert "'realtime'" in message and "--api realtime" in message, message

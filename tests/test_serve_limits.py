"""``serve.max_request_bytes``: every route of a real ``omni serve`` (the core routes and a plugin's
API) answers a body over the limit with a 413 naming the limit and the field to raise, whether the
body declares its length or comes chunked; the limit is enforced as the body arrives, so no route
ever holds more of it than the limit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from runtime_helpers import no_leaks  # noqa: F401

from omni_core.config import load_config
from omni_core.errors import ConfigError
from omni_core.serve.limits import BodyLimit
from omni_core.testing.serve import ServerProcess

HERE = Path(__file__).parent
WORDS = HERE / "configs" / "serve" / "words.yaml"
LIMIT = 4096


def chunked(size: int, piece: int = 1024):
    """A body of ``size`` bytes sent without Content-Length (chunked transfer encoding)."""
    def gen():
        sent = 0
        while sent < size:
            n = min(piece, size - sent)
            yield b" " * n
            sent += n
    return gen()


def refused(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["type"] == "RequestTooLarge"
    assert "serve.max_request_bytes (4096 bytes)" in error["message"] and "raise serve.max_request_bytes" in error["message"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_route_refuses_a_body_over_the_limit_declared_or_chunked(plugin_site_dir, tmp_path):
    config = WORDS.read_text() + f"serve:\n  max_request_bytes: {LIMIT}\n"
    server = ServerProcess.of_config(config, tmp_path, "--api", "acme.api", name="words", cwd=Path.cwd(),
                                     env={"OMNI_LOAD_PLUGINS": "good"}, pythonpath=[plugin_site_dir, HERE]).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            padding = " " * (LIMIT - 200)
            ok = client.post("/v1/pipelines/words/requests", content=f'{{"input": {{"text": "a b"}}}}{padding}')
            assert ok.status_code == 200 and ok.json()["result"]["count"] == 2
            big = '{"input": {"text": "' + "x " * LIMIT + '"}}'
            for path in ("/v1/pipelines/words/requests", "/v1/acme/echo"):
                refused(client.post(path, content=big))  # Content-Length over the limit
                refused(client.post(path, content=chunked(LIMIT + 1)))  # chunked, one byte over
                refused(client.post(path, content=chunked(8 * 1024 * 1024, 64 * 1024)))  # much more
            assert client.post("/v1/acme/echo", json={"text": "still here"}).status_code == 200
            assert client.post("/v1/pipelines/words/requests", content=chunked(LIMIT)).status_code == 400  # not JSON
    finally:
        assert server.stop() == 0, server.output()
    server.assert_nothing_left()


def test_the_limit_defaults_to_16_mib_and_must_be_positive(tmp_path):
    assert load_config(WORDS).serve.max_request_bytes == 16 * 1024 * 1024
    bad = tmp_path / "bad.yaml"
    bad.write_text(WORDS.read_text() + "serve:\n  max_request_bytes: 0\n")
    with pytest.raises(ConfigError, match=r"serve\.max_request_bytes"):
        load_config(bad)


def test_a_chunked_body_is_cut_off_the_moment_it_passes_the_limit():
    """The route gets at most the limit: the message that crosses it is never handed over, and
    no further message is read from the client."""
    pulled: list[int] = []
    seen: list[int] = []
    sent: list[dict] = []

    async def receive() -> dict:
        pulled.append(len(pulled))
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}  # an endless body

    async def send(message: dict) -> None:
        sent.append(message)

    async def route(scope, receive, send):
        try:
            while True:
                seen.append(len((await receive())["body"]))
        except Exception:
            await send({"type": "http.response.start", "status": 400, "headers": []})  # a route catching it all
            await send({"type": "http.response.body", "body": b"bad body"})

    scope = {"type": "http", "method": "POST", "path": "/x", "headers": [(b"transfer-encoding", b"chunked")]}
    asyncio.run(BodyLimit(route, 4500)(scope, receive, send))
    assert sum(seen) == 4000 and len(pulled) == 5
    assert sent[0]["status"] == 413 and b"serve.max_request_bytes (4500 bytes)" in sent[1]["body"]
    assert len(sent) == 2

"""A property-based fuzz of ``omni serve demo`` over its OpenAPI document (``GET /openapi.json``):
hypothesis draws requests for every operation the document lists (the core routes, the console's,
the OpenAI API's), in the shapes the document describes and far outside them (wrong types, unknown
fields, paths where files go, data URLs that are not media, huge numbers, bodies that are not JSON
or nest deeply, wrong methods and content types), with and without an API key set on the server.

No answer may be a 5xx: a client's mistake is a 4xx, and nothing the client sends may crash the
server (the one exception: a 504 for a request that set its own ``timeout``, which is the answer it
asked for). The server still answers ``/ready`` after, and stops cleanly. Seeded and bounded:
:data:`REQUESTS` requests per server, in batches sent concurrently.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from omni_core.testing.serve import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

try:
    import omni_contrib_stages  # noqa: F401 - the demo pipeline
except ImportError:  # pragma: no cover - the core env without contrib
    pytest.skip("omni-contrib-stages (the demo pipeline) is not installed", allow_module_level=True)

HERE = Path(__file__).parent
ENV = {"OMNI_LOAD_PLUGINS": "contrib"}
KEY = "sk-fuzz-0123456789"

#: Requests per server (the keyed and the open one): 2 x 1,200 = 2,400 in all.
REQUESTS = int(os.environ.get("OMNI_FUZZ_REQUESTS", "1200"))
BATCH = 24
CLIENT_TIMEOUT = 90.0

# -- values ---------------------------------------------------------------------------------------------

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**63),
    st.sampled_from([0, -1, 1, 13, 64, 65, 10**9, 2**31, 2**64]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, -0.5, 1e308, 2.5]),
    st.text(max_size=40),
)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                    max_leaves=12)

#: Strings where a server path, a URL or a media payload may go.
PATHS = st.sampled_from([
    "/etc/hostname", "/etc/passwd", "../../x.wav", "..%2f..%2fx.wav", "%2e%2e/%2e%2e/x.wav", "/tmp", "/dev/zero",
    "out.wav", "a/b.wav", "file:///etc/hostname", "~/.bashrc", "\u0000", "/proc/self/environ", "C:\\x.wav",
])
DATA_URLS = st.sampled_from([
    "data:image/png;base64,AAAA", "data:image/png;base64,!!!", "data:text/plain;base64,aGk=", "data:,hello",
    "data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8\xff\xe0 not a jpeg").decode(),
    "http://127.0.0.1:1/x.png", "https://example.invalid/a.png", "/etc/hostname", "file:///etc/passwd",
])
B64 = st.one_of(st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode()),
                st.sampled_from(["", "!!!", "UklGRiQAAABXQVZF", base64.b64encode(b"RIFF\x00\x00\x00\x00WAVEfmt ").decode()]))
WORDS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
ANY = st.one_of(JSON, PATHS, DATA_URLS)

# -- the demo's inputs and the OpenAI body --------------------------------------------------------------

DEMO_INPUT_FIELDS = {
    "text": st.one_of(WORDS, ANY), "max_tokens": st.one_of(st.integers(-2, 70), ANY),
    "speak": st.one_of(st.just(False), ANY), "stream_audio": st.one_of(st.booleans(), ANY),
    "wav_path": st.one_of(PATHS, st.none(), ANY), "audio": st.one_of(PATHS, B64, ANY), "image": st.one_of(PATHS, DATA_URLS, ANY),
    "nope": ANY,
}


def partial_object(fields: dict, required: tuple[str, ...] = ()) -> st.SearchStrategy[dict]:
    """Objects with any subset of ``fields`` (``required`` ones usually there), sometimes an extra key."""
    return st.fixed_dictionaries({k: v for k, v in fields.items() if k in required},
                                 optional={k: v for k, v in fields.items() if k not in required})


DEMO_INPUT = st.one_of(partial_object(DEMO_INPUT_FIELDS, ("text",)).map(
    lambda d: {**d, "max_tokens": d["max_tokens"]} if "max_tokens" in d else {**d, "max_tokens": 3}), ANY)

PARTS = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(WORDS, ANY)}),
    st.fixed_dictionaries({"type": st.just("input_audio"), "input_audio": st.one_of(
        st.fixed_dictionaries({"data": B64, "format": st.sampled_from(["wav", "mp3", "pcm16", "x"])}), ANY)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.one_of(
        st.fixed_dictionaries({"url": DATA_URLS}), ANY)}),
    st.fixed_dictionaries({"type": st.one_of(st.just("file"), WORDS)}, optional={"file": ANY}),
)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "x"]),
                           "content": st.one_of(WORDS, st.lists(PARTS, max_size=3), ANY)}, optional={"name": ANY}),
    ANY,
)
CHAT_FIELDS = {
    "model": st.one_of(st.just("demo"), WORDS), "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), ANY),
    "max_tokens": st.one_of(st.integers(-2, 70), st.just(1000000000), ANY), "max_completion_tokens": st.one_of(st.integers(-2, 70), ANY),
    "stream": st.one_of(st.booleans(), ANY), "stream_options": ANY, "temperature": st.one_of(st.floats(-1, 3), ANY),
    "top_p": st.one_of(st.floats(-1, 2), ANY), "top_k": ANY, "seed": ANY, "stop": ANY, "n": st.one_of(st.integers(-1, 4), ANY),
    "presence_penalty": ANY, "frequency_penalty": ANY, "logprobs": ANY, "top_logprobs": ANY,
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "x"])}), ANY),
    "tools": ANY, "tool_choice": ANY, "user": ANY, "metadata": ANY, "modalities": st.one_of(
        st.lists(st.sampled_from(["text", "audio", "video"]), max_size=2), ANY),
    "audio": st.one_of(st.fixed_dictionaries({"voice": WORDS, "format": st.sampled_from(["pcm16", "wav", "mp3", "x"])}), ANY),
    "unknown_field": ANY,
}
CHAT = partial_object(CHAT_FIELDS, ("model", "messages"))

#: Requests the demo runs (the happy paths, with a few options each).
VALID_CHAT = st.fixed_dictionaries(
    {"model": st.just("demo"), "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": WORDS.filter(str.strip)}),
                                                     min_size=1, max_size=2)},
    optional={"max_tokens": st.integers(1, 16), "stream": st.booleans(), "modalities": st.sampled_from([["text"], ["text", "audio"]]),
              "audio": st.just({"voice": "default", "format": "pcm16"}), "user": WORDS, "temperature": st.just(1.0)})
VALID_INPUT = st.fixed_dictionaries({"input": st.fixed_dictionaries({"text": WORDS.filter(str.strip)}, optional={
    "max_tokens": st.integers(1, 16), "speak": st.booleans(), "stream_audio": st.booleans()})},
    optional={"stream": st.booleans(), "request_id": st.uuids().map(str)})

CORE_BODY = st.fixed_dictionaries({"input": DEMO_INPUT}, optional={
    "stream": st.one_of(st.booleans(), ANY), "request_id": st.one_of(WORDS, ANY),
    "timeout": st.one_of(st.floats(0.001, 30), ANY), "extra": ANY,
})


def body_for(path: str, operation: dict) -> st.SearchStrategy:
    """Bodies for an operation: its shape (the core request body, or the OpenAI chat body for a
    route the OpenAI API mounts), anything JSON, or bytes that are not JSON."""
    if path.endswith("/requests"):
        shaped = st.one_of(CORE_BODY, VALID_INPUT)
    elif path.startswith("/v1/chat"):
        shaped = st.one_of(CHAT, VALID_CHAT)
    else:
        shaped = st.dictionaries(st.text(max_size=10), ANY, max_size=3)
    return st.one_of(shaped, shaped, shaped, JSON.map(lambda v: ("json", v)),
                     st.sampled_from([b"", b"{", b"[" * 5000 + b"]" * 5000, b"{\"a\":" * 3000 + b"1" + b"}" * 3000,
                                      b"\xff\xfe", b"null", b"[]", b'{"input": NaN}']).map(lambda raw: ("raw", raw)))


def requests_for(doc: dict, pipeline: str) -> st.SearchStrategy[dict]:
    """One request for one operation of ``doc`` (those with a body, where most can go wrong, three
    times as likely as the others)."""
    operations = [(path, method, op) for path, item in sorted(doc["paths"].items()) for method, op in sorted(item.items())]
    with_body = [o for o in operations if o[1] in ("post", "put", "patch")]

    @st.composite
    def one(draw):
        path, method, op = draw(st.one_of(st.sampled_from(with_body), st.sampled_from(with_body),
                                          st.sampled_from(with_body), st.sampled_from(operations)))
        concrete = path
        for param in op.get("parameters", ()):
            if param.get("in") == "path":
                value = draw(st.one_of(st.just(pipeline), st.just(pipeline), st.just(pipeline), st.just("console.js"),
                                       st.text(alphabet="abc./%2e\u00e9", min_size=1, max_size=12)))
                concrete = concrete.replace("{" + param["name"] + "}", value)
        # Sometimes the wrong method, a query string, another content type.
        verb = draw(st.one_of(st.just(method.upper()), st.just(method.upper()), st.sampled_from(["GET", "POST", "PUT", "DELETE"])))
        query = draw(st.one_of(st.just(""), st.just("?model=demo"), st.text(alphabet="a=&%.", max_size=8).map(lambda q: "?" + q)))
        content_type = draw(st.sampled_from(["application/json", "application/json", "text/plain", "application/x-www-form-urlencoded"]))
        req = {"operation": f"{method.upper()} {path}", "method": verb, "url": concrete + query,
               "headers": {"content-type": content_type}, "content": None, "sets_timeout": False}
        if verb in ("POST", "PUT"):
            body = draw(body_for(path, op))
            if isinstance(body, tuple) and body[0] == "raw":
                req["content"] = body[1]
            else:
                value = body[1] if isinstance(body, tuple) else body
                req["content"] = json.dumps(value).encode()
                req["sets_timeout"] = isinstance(value, dict) and "timeout" in value
        return req

    return one()


# -- the run ----------------------------------------------------------------------------------------------


async def send_all(base: str, batch: list[dict], headers: dict[str, str]) -> list[tuple[dict, int | str, str]]:
    """Send a batch concurrently; ``(request, status or transport error, body head)`` each. An
    event stream is read to its end (or its first 64 KiB), the console's push channel (which never
    ends) to its first event."""
    async with httpx.AsyncClient(base_url=base, timeout=CLIENT_TIMEOUT) as client:
        async def one(req: dict):
            try:
                async with client.stream(req["method"], req["url"], content=req["content"],
                                         headers={**req["headers"], **headers}) as r:
                    got = b""
                    async for chunk in r.aiter_bytes():
                        got += chunk
                        if len(got) > 65536 or req["url"].startswith("/console/events"):
                            break  # the push channel: its status and first event are the answer
                    text = got.decode("utf-8", "replace")
                    if r.status_code == 200 and "event: error" in text and '"InternalError"' in text:
                        return req, "500 in a stream", text[text.index("event: error"):][:300]  # a bug, told late
                    return req, r.status_code, text[:300]
            except httpx.HTTPError as exc:
                return req, type(exc).__name__, str(exc)[:300]

        return await asyncio.gather(*(one(r) for r in batch))


def fuzz(server: ServerProcess, key: str | None) -> tuple[Counter, list[str]]:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    doc = httpx.get(f"{server.url}/openapi.json", headers=auth, timeout=30).json()
    statuses: Counter = Counter()
    covered: Counter = Counter()
    by_route: Counter = Counter()
    findings: list[str] = []

    @seed(31)
    @settings(max_examples=REQUESTS // BATCH, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.lists(requests_for(doc, "demo"), min_size=BATCH, max_size=BATCH),
           st.lists(st.sampled_from(["key", "key", "key", "none", "wrong"]), min_size=BATCH, max_size=BATCH))
    def run(batch, creds):
        async def main():
            out = []
            for kind in ("key", "none", "wrong"):  # with the key, without it and with a wrong one
                part = [r for r, c in zip(batch, creds, strict=True) if c == kind]
                headers = {"key": auth, "none": {}, "wrong": {"Authorization": "Bearer wrong"} if key else {}}[kind]
                out += await send_all(server.url, part, headers)
            return out

        for req, status, head in asyncio.run(main()):
            statuses[status] += 1
            covered[req["operation"]] += 1
            by_route[(req["operation"], status)] += 1
            if not isinstance(status, int) or (status >= 500 and not (status == 504 and req["sets_timeout"])):
                findings.append(f"{req['method']} {req['url']}: {status} {head} <- {req['content']!r:.300}")

    run()
    print(f"fuzz ({'with' if key else 'without'} a key): {sum(statuses.values())} requests, statuses {dict(statuses)}")
    print("\n".join(f"  {op} {status}: {n}" for (op, status), n in sorted(by_route.items(), key=str)))
    operations = {f"{m.upper()} {p}" for p, item in doc["paths"].items() for m in item}
    assert operations <= set(covered), f"operations never tried: {operations - set(covered)}"
    return statuses, findings


@pytest.mark.parametrize("key", [None, KEY], ids=["open", "with-key"])
def test_no_request_drawn_from_the_openapi_document_gets_a_5xx(key, tmp_path):
    args = ["--api-key", KEY] if key else []
    with ServerProcess("demo", *args, env=ENV, cwd=str(tmp_path), ready_timeout=300).serving(stop_timeout=120) as server:
        statuses, findings = fuzz(server, key)
        assert sum(statuses.values()) >= REQUESTS
        distinct = sorted(set(f.split(" <- ")[0][:200] for f in findings))
        assert not findings, f"{len(findings)} answers >= 500 or failures ({dict(statuses)}):\n" + "\n".join(distinct[:40])
        assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 200
        if key:
            assert statuses[401] > 0
    assert not list(Path(tmp_path).rglob("*.wav")), "a request wrote a file in the server's directory"

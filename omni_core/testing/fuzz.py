"""Fuzz a running ``omni serve`` over its OpenAPI document (``GET /openapi.json``) with hypothesis.

::

    from omni_core.testing.fuzz import DEMO_INPUTS, fuzz_server

    report = fuzz_server(server.url, pipeline="demo", inputs=DEMO_INPUTS, requests=1200)
    assert not report.findings, report.summary()

Every operation the document lists gets requests: in the shapes it describes and far outside them
(wrong types, unknown fields, server paths where files go, data URLs that are not media, huge
numbers, bodies that are not JSON or nest deeply, wrong methods, content types and query strings),
sent concurrently in batches. The pipeline's own inputs (the core route's ``input``, the console's
playground) are drawn from a :class:`PipelineInputs`; the OpenAI chat body from
:data:`CHAT_FIELDS`. A *finding* is an answer ``>= 500`` (but a 504 to a request that set its own
``timeout``), a 200 stream with an ``InternalError`` event, or a request that got no answer.

Needs hypothesis and httpx (omni-core's ``[test]`` extra).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

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
WORDS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30)
ANY = st.one_of(JSON, PATHS, DATA_URLS)

# -- the demo's inputs and the OpenAI body --------------------------------------------------------------



def partial_object(fields: dict, required: tuple[str, ...] = ()) -> st.SearchStrategy[dict]:
    """Objects with any subset of ``fields`` (``required`` ones usually there), sometimes an extra key."""
    return st.fixed_dictionaries({k: v for k, v in fields.items() if k in required},
                                 optional={k: v for k, v in fields.items() if k not in required})



@dataclass
class PipelineInputs:
    """A pipeline's inputs for the fuzz: ``fields`` (name -> strategy of its values, right and
    wrong), the ``required`` ones, and ``valid``: inputs the pipeline runs (its happy path)."""

    fields: dict[str, Any]
    required: tuple[str, ...] = ()
    valid: Any = None

    def strategy(self) -> Any:
        shaped = partial_object(self.fields, self.required)
        return st.one_of(shaped, self.valid, ANY) if self.valid is not None else st.one_of(shaped, ANY)


#: The demo pipeline's inputs (omni-contrib-stages).
DEMO_INPUTS = PipelineInputs(
    fields={
        "text": st.one_of(WORDS, ANY), "max_tokens": st.one_of(st.integers(-2, 70), ANY),
        "speak": st.one_of(st.just(False), ANY), "stream_audio": st.one_of(st.booleans(), ANY),
        "wav_path": st.one_of(PATHS, st.none(), ANY), "audio": st.one_of(PATHS, B64, ANY),
        "image": st.one_of(PATHS, DATA_URLS, ANY), "nope": ANY,
    },
    required=("text",),
    valid=st.fixed_dictionaries({"text": WORDS.filter(str.strip)}, optional={
        "max_tokens": st.integers(1, 16), "speak": st.booleans(), "stream_audio": st.booleans()}),
)

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
#: The OpenAI chat body's fields, each with values of its kind and any other (``model``: see :func:`chat_bodies`).
CHAT_FIELDS = {
    "model": WORDS, "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), ANY),
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


def chat_bodies(model: str) -> Any:
    """OpenAI chat bodies: any subset of :data:`CHAT_FIELDS`, or one the pipeline ``model`` runs."""
    fields = {**CHAT_FIELDS, "model": st.one_of(st.just(model), st.just(model), WORDS)}
    valid = st.fixed_dictionaries(
        {"model": st.just(model), "messages": st.lists(st.fixed_dictionaries(
            {"role": st.just("user"), "content": WORDS.filter(str.strip)}), min_size=1, max_size=2)},
        optional={"max_tokens": st.integers(1, 16), "stream": st.booleans(),
                  "modalities": st.sampled_from([["text"], ["text", "audio"]]),
                  "audio": st.just({"voice": "default", "format": "pcm16"}), "user": WORDS, "temperature": st.just(1.0)})
    return st.one_of(partial_object(fields, ("model", "messages")), valid)


def core_bodies(inputs: PipelineInputs) -> Any:
    """Bodies of ``POST /v1/pipelines/{name}/requests`` (and the console's playground)."""
    return st.fixed_dictionaries({"input": inputs.strategy()}, optional={
        "stream": st.one_of(st.booleans(), ANY), "request_id": st.one_of(WORDS, st.uuids().map(str), ANY),
        "timeout": st.one_of(st.floats(0.001, 30), ANY), "extra": ANY,
    })


NOT_JSON = st.sampled_from([b"", b"{", b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000,
                            b"\xff\xfe", b"null", b"[]", b'{"input": NaN}'])


def body_for(path: str, pipeline: str, inputs: PipelineInputs) -> Any:
    """Bodies for an operation: its shape (the core request body, the OpenAI chat body), any JSON,
    or bytes that are not JSON."""
    if path.endswith("/requests"):
        shaped = core_bodies(inputs)
    elif path.startswith("/v1/chat"):
        shaped = chat_bodies(pipeline)
    else:
        shaped = st.dictionaries(st.text(max_size=10), ANY, max_size=3)
    return st.one_of(shaped, shaped, shaped, JSON.map(lambda v: ("json", v)), NOT_JSON.map(lambda raw: ("raw", raw)))


def requests_for(doc: dict, pipeline: str, inputs: PipelineInputs) -> Any:
    """One request for one operation of ``doc`` (those with a body, where most can go wrong, three
    times as likely as the others)."""
    operations = [(path, method, op) for path, item in sorted(doc["paths"].items()) for method, op in sorted(item.items())]
    with_body = [o for o in operations if o[1] in ("post", "put", "patch")] or operations

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
        query = draw(st.one_of(st.just(""), st.just(f"?model={pipeline}"),
                               st.text(alphabet="a=&%.", max_size=8).map(lambda q: "?" + q)))
        content_type = draw(st.sampled_from(["application/json", "application/json", "text/plain",
                                             "application/x-www-form-urlencoded"]))
        req = {"operation": f"{method.upper()} {path}", "method": verb, "url": concrete + query,
               "headers": {"content-type": content_type}, "content": None, "sets_timeout": False}
        if verb in ("POST", "PUT"):
            body = draw(body_for(path, pipeline, inputs))
            if isinstance(body, tuple) and body[0] == "raw":
                req["content"] = body[1]
            else:
                value = body[1] if isinstance(body, tuple) else body
                req["content"] = json.dumps(value).encode()
                req["sets_timeout"] = isinstance(value, dict) and "timeout" in value
        return req

    return one()


# -- the run ----------------------------------------------------------------------------------------------


async def send_all(base: str, batch: list[dict], headers: dict[str, str], timeout: float = 90.0) -> list[tuple[dict, int | str, str]]:
    """Send a batch concurrently; ``(request, status or transport error, body head)`` each. An
    event stream is read to its end (or its first 64 KiB), the console's push channel (which never
    ends) to its first event."""
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as client:
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



@dataclass
class FuzzReport:
    """What a fuzz run got: statuses, statuses per operation, findings, operations never tried."""

    statuses: Counter = field(default_factory=Counter)
    by_operation: Counter = field(default_factory=Counter)
    findings: list[str] = field(default_factory=list)
    missed: set[str] = field(default_factory=set)

    @property
    def total(self) -> int:
        return sum(self.statuses.values())

    def summary(self, limit: int = 40) -> str:
        distinct = sorted({f.split(" <- ")[0][:200] for f in self.findings})
        lines = [f"{self.total} requests, statuses {dict(self.statuses)}; {len(self.findings)} finding(s):", *distinct[:limit]]
        if self.missed:
            lines.append(f"operations never tried: {sorted(self.missed)}")
        return "\n".join(lines)


def fuzz_server(url: str, *, pipeline: str, inputs: PipelineInputs = DEMO_INPUTS, key: str | None = None,
                requests: int = 1200, batch: int = 24, seed_value: int = 31, timeout: float = 90.0) -> FuzzReport:
    """Send ``requests`` generated requests (seeded: the same ones each run) to the server at
    ``url``, which serves ``pipeline``. With ``key`` (the server requires it) most requests carry
    it, some none, some a wrong one."""
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    doc = httpx.get(f"{url}/openapi.json", headers=auth, timeout=30).json()
    report = FuzzReport()
    covered: set[str] = set()

    @seed(seed_value)
    @settings(max_examples=max(1, requests // batch), deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.lists(requests_for(doc, pipeline, inputs), min_size=batch, max_size=batch),
           st.lists(st.sampled_from(["key", "key", "key", "none", "wrong"]), min_size=batch, max_size=batch))
    def run(drawn, creds):
        async def main():
            out = []
            for kind in ("key", "none", "wrong"):  # with the key, without it and with a wrong one
                part = [r for r, c in zip(drawn, creds, strict=True) if c == kind]
                headers = {"key": auth, "none": {}, "wrong": {"Authorization": "Bearer wrong"} if key else {}}[kind]
                out += await send_all(url, part, headers, timeout)
            return out

        for req, status, head in asyncio.run(main()):
            report.statuses[status] += 1
            covered.add(req["operation"])
            report.by_operation[(req["operation"], status)] += 1
            if not isinstance(status, int) or (status >= 500 and not (status == 504 and req["sets_timeout"])):
                report.findings.append(f"{req['method']} {req['url']}: {status} {head} <- {req['content']!r:.300}")

    run()
    # Every operation at least once, whatever the draws: its method, the pipeline in its path, {}.
    sweep = []
    for path, item in sorted(doc["paths"].items()):
        for method, op in sorted(item.items()):
            if f"{method.upper()} {path}" in covered:
                continue
            concrete = path
            for param in op.get("parameters", ()):
                if param.get("in") == "path":
                    concrete = concrete.replace("{" + param["name"] + "}", pipeline)
            sweep.append({"operation": f"{method.upper()} {path}", "method": method.upper(), "url": concrete,
                          "headers": {"content-type": "application/json"}, "sets_timeout": False,
                          "content": b"{}" if method in ("post", "put", "patch") else None})
    for req, status, head in asyncio.run(send_all(url, sweep, auth, timeout)):
        report.statuses[status] += 1
        covered.add(req["operation"])
        report.by_operation[(req["operation"], status)] += 1
        if not isinstance(status, int) or status >= 500:
            report.findings.append(f"{req['method']} {req['url']}: {status} {head} <- {req['content']!r:.300}")
    report.missed = {f"{m.upper()} {p}" for p, item in doc["paths"].items() for m in item} - covered
    return report


# -- WebSockets (the Realtime protocol) -------------------------------------------------------------------

#: Client events of OpenAI's Realtime protocol, and some that are not.
REALTIME_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
                   "conversation.item.create", "conversation.item.truncate", "conversation.item.delete",
                   "conversation.item.retrieve", "response.create", "response.cancel", "nope", "")

REALTIME_FIELDS = {
    "event_id": st.one_of(WORDS, ANY), "session": st.one_of(st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["realtime", "transcription", "x"]), "output_modalities": st.one_of(
            st.sampled_from([["text"], ["audio"], ["text", "audio"]]), ANY),
        "audio": ANY, "instructions": st.one_of(WORDS, ANY), "max_output_tokens": st.one_of(st.integers(-1, 20), ANY)}), ANY),
    "audio": st.one_of(B64, ANY), "item": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["message", "x"])}, optional={
        "role": st.sampled_from(["user", "assistant", "system", "x"]), "content": st.one_of(st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["input_text", "input_audio", "text", "x"])}, optional={"text": WORDS, "audio": B64}),
            max_size=2), ANY), "id": ANY}), ANY),
    "item_id": st.one_of(WORDS, ANY), "content_index": ANY, "audio_end_ms": st.one_of(st.integers(-5, 10**6), ANY),
    "response": st.one_of(st.fixed_dictionaries({}, optional={"conversation": st.sampled_from(["auto", "none", "x"]),
                                                               "output_modalities": ANY, "max_output_tokens": ANY}), ANY),
    "previous_item_id": ANY,
}

REALTIME_MESSAGE = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(REALTIME_EVENTS)}).flatmap(
        lambda head: partial_object(REALTIME_FIELDS).map(lambda rest: json.dumps({**rest, **head}))),
    JSON.map(json.dumps), WORDS, st.binary(max_size=64),
)


def fuzz_websocket(url: str, path: str, *, model: str, key: str | None = None, sessions: int = 60,
                   messages: int = 6, batch: int = 10, seed_value: int = 31, quiet: float = 2.0) -> FuzzReport:
    """Open ``sessions`` WebSockets at ``path`` (``?model=``, ``batch`` at once), each sending up to ``messages``
    generated messages (Realtime events right and wrong, other JSON, text, bytes) and reading the
    answers until the server is ``quiet`` seconds or closes. A finding is a handshake answered
    ``>= 500``, a close with 1011 (the server's error), or a connection that breaks."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    ws_url = url.replace("http", "ws", 1) + f"{path}?model={model}"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    report = FuzzReport()

    async def session(sent: list) -> tuple[Any, str]:
        try:
            async with connect(ws_url, additional_headers=headers, max_size=None, open_timeout=30) as ws:
                for message in sent:
                    await ws.send(message)
                while True:
                    try:
                        await asyncio.wait_for(ws.recv(), quiet)
                    except asyncio.TimeoutError:
                        return "open", ""
        except InvalidStatus as exc:
            return exc.response.status_code, ""
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else None
            return f"closed {code}", exc.rcvd.reason if exc.rcvd is not None else ""
        except OSError as exc:
            return type(exc).__name__, str(exc)

    async def sessions_at_once(drawn: list) -> list:
        return await asyncio.gather(*(session(sent) for sent in drawn))

    @seed(seed_value)
    @settings(max_examples=max(1, sessions // batch), deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.lists(REALTIME_MESSAGE, min_size=1, max_size=messages), min_size=batch, max_size=batch))
    def run(drawn):
        for sent, (status, reason) in zip(drawn, asyncio.run(sessions_at_once(drawn)), strict=True):
            report.statuses[status] += 1
            report.by_operation[(f"WEBSOCKET {path}", status)] += 1
            broken = status in ("closed 1011", "closed None") or (isinstance(status, int) and status >= 500) \
                or (isinstance(status, str) and not status.startswith(("open", "closed")))
            if broken:
                report.findings.append(f"WEBSOCKET {path}: {status} {reason} <- {sent!r:.300}")

    run()
    return report


__all__ = ["CHAT_FIELDS", "DEMO_INPUTS", "FuzzReport", "PipelineInputs", "fuzz_server", "fuzz_websocket"]

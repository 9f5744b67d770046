"""``omni serve demo`` names no server file for a client, and answers its mistakes with 400s.

Over the core route (``POST /v1/pipelines/demo/requests``, JSON and SSE): ``wav_path`` as an
absolute path, with ``..``, through a symlink, URL-encoded, existing or not, is a 400 naming the
field, the same answer whatever is at the path, and nothing is created; requests without
``wav_path`` write nothing. With ``serve.allow_local_files`` a path inside that directory is
written there and nothing leaves it. Each client mistake of the issue (``{"input": "hi"}``,
``{"input": {"text": 5}}``, ``max_tokens: 1000000000``) is a ``BadRequestError`` for the official
SDK after ONE POST; a body nested deeper than the limit is a 400 in JSON."""

from __future__ import annotations

import json
from importlib.resources import files

import httpx
import openai
import pytest
import yaml

from omni_core.testing.serve import ServerProcess, openai_client, sse_events

pytestmark = pytest.mark.timeout(400)

REQUESTS = "/v1/pipelines/demo/requests"


def snapshot(*folders) -> dict[str, list[str]]:
    """Every path under ``folders`` (to compare before and after)."""
    return {str(f): sorted(str(p) for p in f.rglob("*")) for f in folders}


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """The server's working directory, a root a second server allows, and a folder outside both
    with a file in it; a symlink in the root leads to that folder."""
    base = tmp_path_factory.mktemp("files")
    cwd, root, outside = base / "cwd", base / "root", base / "outside"
    for folder in (cwd, root, outside):
        folder.mkdir()
    (outside / "exists.wav").write_bytes(b"not mine")
    (root / "out").symlink_to(outside)
    return {"cwd": cwd, "root": root, "outside": outside}


@pytest.fixture(scope="module")
def server(places):
    # The shipped config: no allow_local_files.
    with ServerProcess("demo", cwd=str(places["cwd"]), ready_timeout=300).serving() as srv:
        yield srv


@pytest.fixture(scope="module")
def allowing(places, tmp_path_factory):
    cfg = yaml.safe_load(files("omni_contrib_stages").joinpath("pipelines/demo.yaml").read_text())
    cfg.setdefault("serve", {})["allow_local_files"] = str(places["root"])
    with ServerProcess.of_config(cfg, tmp_path_factory.mktemp("config"), name="demo-files",
                                 cwd=places["cwd"]).serving() as srv:
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def refusal(client: httpx.Client, value: str, *, stream: bool = False) -> dict:
    r = client.post(REQUESTS, json={"input": {"text": "hi", "max_tokens": 2, "wav_path": value}, "stream": stream})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert (error["type"], error["stage"], error["field"]) == ("InvalidInput", "preprocess", "wav_path")
    assert "traceback" not in r.text.lower()
    return error


def escapes(places) -> list[str]:
    outside, root = places["outside"], places["root"]
    return [
        str(outside / "exists.wav"), str(outside / "missing.wav"), "/etc/hostname", "/proc/self/environ",
        "../outside/exists.wav", "../outside/missing.wav", "../../x.wav", "out/exists.wav", "out/missing.wav",
        "..%2Foutside%2Fmissing.wav", "%2e%2e/%2e%2e/missing.wav", str(root / ".." / "outside" / "missing.wav"),
        "missing.wav", "sub/missing.wav",
    ]


def test_without_allow_local_files_no_wav_path_is_taken_and_nothing_is_written(http, places):
    before = snapshot(places["cwd"], places["root"], places["outside"])
    messages = set()
    for value in escapes(places):
        for stream in (False, True):
            error = refusal(http, value, stream=stream)
            messages.add(error["message"].replace(repr(value), "VALUE"))
    # one answer for every path: whether a file is there, missing or not readable never shows
    assert len(messages) == 1, messages
    (message,) = messages
    assert message.startswith("wav_path: VALUE names a file on the server") and "serve.allow_local_files" in message
    assert snapshot(places["cwd"], places["root"], places["outside"]) == before
    assert (places["outside"] / "exists.wav").read_bytes() == b"not mine"


def test_the_consoles_playground_refuses_a_wav_path_too(http, places):
    before = snapshot(places["cwd"], places["outside"])
    value = str(places["outside"] / "console.wav")
    with http.stream("POST", "/console/requests", json={"input": {"text": "hi", "wav_path": value}}) as r:
        events = sse_events(list(r.iter_lines()))
    kind, data = events[-1]
    error = json.loads(data)
    assert kind == "error" and (error["type"], error["field"]) == ("InvalidInput", "wav_path")
    assert snapshot(places["cwd"], places["outside"]) == before


def test_a_request_without_wav_path_writes_no_file(http, places):
    before = snapshot(places["cwd"])
    r = http.post(REQUESTS, json={"input": {"text": "hello omni", "max_tokens": 2}})
    assert r.status_code == 200 and r.json()["result"]["vocoder"]["wav_path"] is None
    with http.stream("POST", REQUESTS, json={"input": {"text": "hi", "max_tokens": 2}, "stream": True}) as r:
        events = sse_events(list(r.iter_lines()))
    assert events[-1][0] == "result"
    assert snapshot(places["cwd"]) == before and not (places["cwd"] / "omni-demo").exists()


def test_with_allow_local_files_a_path_inside_the_root_is_written_and_nothing_leaves_it(allowing, places):
    root, outside = places["root"], places["outside"]
    with httpx.Client(base_url=allowing.url, timeout=60) as client:
        r = client.post(REQUESTS, json={"input": {"text": "hi", "max_tokens": 2, "wav_path": "made/a.wav"}})
        assert r.status_code == 200, r.text
        assert r.json()["result"]["vocoder"]["wav_path"] == str(root / "made" / "a.wav")
        assert (root / "made" / "a.wav").read_bytes()[:4] == b"RIFF"
        inside = str(root / "b.wav")
        assert client.post(REQUESTS, json={"input": {"text": "hi", "max_tokens": 2, "wav_path": inside}}
                           ).json()["result"]["vocoder"]["wav_path"] == inside
        before = snapshot(places["cwd"], root, outside)
        messages = set()
        for value in escapes(places):
            if value in ("missing.wav", "sub/missing.wav") or "%2" in value:
                continue  # inside the root here (taken literally, "%2e%2e" and "..%2F" are names)
            messages.add(refusal(client, value)["message"].replace(repr(value), "VALUE"))
        assert messages == {"wav_path: VALUE is not a file inside the directory this server lets requests name "
                            "(serve.allow_local_files): give a path relative to it"}
        assert snapshot(places["cwd"], root, outside) == before
        # URL-encoded dots are names, not parents: the file lands inside the root
        r = client.post(REQUESTS, json={"input": {"text": "hi", "max_tokens": 2, "wav_path": "%2e%2e/c.wav"}})
        assert r.json()["result"]["vocoder"]["wav_path"] == str(root / "%2e%2e" / "c.wav")


# -- client mistakes: 400 after one POST ---------------------------------------------------------


@pytest.fixture
def sdk(server):
    posts: list[str] = []
    with openai_client(server, posts) as c:
        assert c.max_retries >= 1  # a status the SDK retries would show as a second POST
        yield c, posts


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"input": "hi"}, None, "expected a JSON object"),
    ({"input": {"text": 5}}, "text", "'text' must be a non-empty string"),
    ({"input": {"text": "hi", "max_tokens": 1000000000}}, "max_tokens", "'max_tokens' must be an integer from 1 to 64"),
    ({"input": {"text": "hi", "wav_path": "/tmp/x.wav"}}, "wav_path", "names a file on the server"),
    ({"input": {"text": "hi", "colour": "red"}}, "colour", "unknown input key(s) ['colour']"),
    ({"input": {"text": "hi", "image": [[]]}}, "image", "'image' must be [h][w] or [h][w][3]"),
    ({"input": {"text": "hi", "audio": [0.1] * 10}}, "audio", "at least 400 samples"),
])
def test_each_client_mistake_is_a_400_after_one_post(sdk, body, field, words):
    client, posts = sdk
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/pipelines/demo/requests", body=body, cast_to=httpx.Response)
    assert posts == ["/v1/pipelines/demo/requests"]
    error = caught.value.body.get("error", caught.value.body)
    assert error["type"] == "InvalidInput" and error["stage"] == "preprocess" and error.get("field") == field
    assert words in error["message"]


def test_the_openai_route_refuses_a_huge_max_tokens_after_one_post(sdk):
    client, posts = sdk
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=1000000000)
    assert posts == ["/v1/chat/completions"]


@pytest.mark.parametrize("path", [REQUESTS, "/v1/chat/completions"])
def test_a_body_nested_too_deeply_is_a_400_in_json(http, path):
    deep = '{"input": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = http.post(path, content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    assert "deep" in json.dumps(r.json())
    assert http.get("/ready").status_code == 200

"""The console's server side over plain HTTP: the page and its files, the push channel
(``/console/events``: topology, then live state from the metrics and supervision states), the
playground route, ``--no-console``, and what the console must never show."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from omni_core.metrics import BUCKETS, Store, live_exports
from omni_core.serve.console import STATIC, quantile, strip_paths
from omni_core.testing.serve import ServerProcess, sse_events

HERE = Path(__file__).parent
CONFIGS = HERE / "configs" / "serve"
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
STATIC_DIR = Path(__file__).parents[1] / "omni_core" / "serve" / "static"


# -- pure parts ----------------------------------------------------------------------------------------


def test_quantiles_come_from_the_histogram_buckets():
    store = Store()
    for seconds in [0.002] * 98 + [0.7, 0.7]:
        store.observe("h", ("s",), seconds)
    row = store.histograms["h"][("s",)]
    assert BUCKETS[0] < quantile(row, 0.5) <= BUCKETS[1]  # 2 ms falls in the (1 ms, 2.5 ms] bucket
    assert 0.5 < quantile(row, 0.99) <= 1.0
    assert quantile([0.0] * (len(BUCKETS) + 3), 0.5) is None


def test_a_traceback_keeps_file_names_but_no_directories():
    tb = 'Traceback (most recent call last):\n  File "/home/me/app/stages.py", line 3, in f\n    raise ValueError\n' \
         '  File "C:\\work\\x.py", line 1, in g\n'
    assert strip_paths(tb) == 'Traceback (most recent call last):\n  File "stages.py", line 3, in f\n    raise ValueError\n' \
                              '  File "x.py", line 1, in g\n'


def test_the_in_flight_gauge_of_a_dead_process_is_not_summed():
    class FakePipeline:
        def pids(self):
            return {"a": 11}

    exports = [{"process": "a", "pid": 10, "values": {"omni_stage_in_flight": [[["x"], 2.0]], "omni_stage_calls_total": [[["x", "ok"], 5.0]]}},
               {"process": "a", "pid": 11, "values": {"omni_stage_in_flight": [[["x"], 1.0]]}}]
    kept = live_exports(FakePipeline(), exports)
    assert kept[0]["values"] == {"omni_stage_calls_total": [[["x", "ok"], 5.0]]}
    assert kept[1]["values"] == exports[1]["values"]


def chat_registry():
    """A registry whose API 'openai' says it serves chat completions (as omni-contrib-stages' does)."""
    import omni_core
    from omni_core.plugins import load_plugins

    class ChatApi:
        @omni_core.hookimpl
        def omni_register_apis(self, register):
            register("openai", "acme_chat:make_routes", description="chat", chat="/v1/chat/completions")
            register("acme.speech", "acme_chat:make_routes", description="chat or speech",
                     chat="test_console_push:chat_by_kind")

    return load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("chat", ChatApi())]).registry


def chat_by_kind(options):
    """An API's chat route per pipeline: none where its options say the pipeline speaks (tts)."""
    return None if options.get("kind") == "tts" else "/v1/acme/chat"


def test_the_console_asks_the_api_registry_for_the_chat_route():
    from omni_core.serve.console import chat_path

    registry = chat_registry()
    assert chat_path(("openai",), registry) == "/v1/chat/completions"
    assert chat_path(("realtime", "openai"), registry) == "/v1/chat/completions"
    assert chat_path(("acme.api",), registry) is None and chat_path((), registry) is None
    # chat="pkg.mod:fn": decided from the pipeline's options for that API
    assert chat_path(("acme.speech",), registry, {"acme.speech": {"kind": "tts"}}) is None
    assert chat_path(("acme.speech",), registry, {"acme.speech": {"kind": "chat"}}) == "/v1/acme/chat"
    assert chat_path(("acme.speech",), registry, {}) == "/v1/acme/chat"
    assert chat_path(("acme.speech", "openai"), registry, {"acme.speech": {"kind": "tts"}}) == "/v1/chat/completions"


def test_the_graph_groups_stages_by_process_with_their_gpus_and_relays(registry):
    from types import SimpleNamespace

    from test_plan_topology import plan_for

    from omni_core.serve.app import ServeSettings
    from omni_core.serve.console import topology

    plan = plan_for(registry, {"name": "enc", "process": "front", "gpu": 1, "next": "llm"},
                    {"name": "pre", "process": "front", "gpu": 1, "next": "llm"},
                    {"name": "llm", "tp_size": 2, "gpu": 0, "terminal": True, "wait_for": ["enc", "pre"],
                     "merge_fn": "stack"}, gpus=3)
    state = SimpleNamespace(pipeline=SimpleNamespace(plan=plan, config=plan.config), settings=ServeSettings(apis=("openai",)))
    topo = topology(state, chat_registry())
    groups = {g["name"]: g for g in topo["groups"]}
    assert groups["front"]["stages"] == ["enc", "pre"] and groups["front"]["gpus"] == [1]
    assert groups["front"]["label"] == "front · GPU 1"
    assert groups["llm"]["gpus"] == [0, 1] and [p["tp_rank"] for p in groups["llm"]["processes"]] == [0, 1]
    assert groups["llm"]["label"] == "llm · tp 2 · GPUs 0, 1"
    assert {(e["src"], e["dst"], e["label"]) for e in topo["edges"]} == \
        {(e.src, e.dst, e.relay) for e in plan.edges}
    assert topo["chat"] == "/v1/chat/completions" and topo["openai"] is True
    assert topo["requests_path"] == f"/v1/pipelines/{plan.config.name}/requests"


def test_the_page_fetches_nothing_from_elsewhere():
    """Every URL in the page's files is this server's (a path) or the SVG namespace name."""
    for name in ["console.html", *STATIC]:
        text = (STATIC_DIR / name).read_text()
        urls = set(re.findall(r"[a-z]+://[^\s\"')]+", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (name, urls)
        assert "@import" not in text


# -- a real server ----------------------------------------------------------------------------------


def served(config: str, *args: str, **kwargs) -> contextlib.AbstractContextManager[ServerProcess]:
    """``omni serve config *args`` until the block ends; then it must stop cleanly (exit 0) and
    leave nothing behind."""
    return ServerProcess(config, *args, **kwargs).serving()


@pytest.fixture(scope="module")
def server():
    with served(str(CONFIGS / "words.yaml"), "--drain-timeout", "10", env=ENV) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


class Events:
    """The push channel read in a thread: every ``(event, data)`` as it arrives."""

    def __init__(self, url: str):
        self.url = url
        self.events: list[tuple[str, dict]] = []
        self.ended = threading.Event()
        self.error: Exception | None = None  # how the stream ended, when not at its end
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            with httpx.stream("GET", f"{self.url}/console/events", timeout=30) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                block: list[str] = []
                for line in r.iter_lines():
                    if self._stop:
                        return
                    if line:
                        block.append(line)
                        continue
                    for name, data in sse_events(block):
                        self.events.append((name, json.loads(data)))
                    block = []
        except httpx.HTTPError as exc:
            self.error = exc
        finally:
            self.ended.set()

    def states(self) -> list[dict]:
        return [data for name, data in self.events if name == "state"]

    def wait(self, predicate, deadline: float = 30.0) -> dict:
        """The first state (from now on) for which ``predicate`` holds."""
        end = time.monotonic() + deadline
        seen = len(self.states())
        while time.monotonic() < end:
            states = self.states()
            for state in states[seen:]:
                if predicate(state):
                    return state
            seen = len(states)
            time.sleep(0.05)
        raise AssertionError(f"no state matched within {deadline} s; last: {self.states()[-1:]}")

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)

    def __enter__(self) -> Events:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_the_page_and_its_files_are_served_with_a_policy_that_keeps_it_local(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert 'src="/console/static/console.js"' in r.text and 'href="/console/static/console.css"' in r.text
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
    assert client.get("/console/static/console.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/console/static/console.css").headers["content-type"].startswith("text/css")
    missing = client.get("/console/static/..%2Fapp.py")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFound"
    assert client.get("/console/static/console.html").status_code == 404


def test_the_push_channel_sends_the_topology_then_live_state_that_follows_the_requests(server, client):
    with Events(server.url) as events:
        first = events.wait(lambda s: True)
        name, topo = events.events[0]
        assert name == "topology"
        assert topo["pipeline"] == "words" and topo["stages"] == ["shout", "words"] and topo["entry"] == "shout"
        assert [(g["name"], g["stages"], g["gpus"]) for g in topo["groups"]] == [("shout", ["shout"], []), ("words", ["words"], [])]
        assert [(e["src"], e["dst"], e["kind"], e["label"]) for e in topo["edges"]] == [("shout", "words", "next", "shm")]
        assert topo["example"] == {} and topo["openai"] is False
        assert first["pipeline"]["state"] == "running" and first["pipeline"]["ready"] is True
        assert {n: p["state"] for n, p in first["processes"].items()} == {"shout": "running", "words": "running"}
        before = first["stages"]["words"]["calls"]

        for i in range(3):
            r = client.post("/v1/pipelines/words/requests", json={"input": {"text": f"live {i}"}, "request_id": f"push-{i}"})
            assert r.status_code == 200
        state = events.wait(lambda s: s["stages"]["words"]["calls"] >= before + 3 and
                            any(r["id"] == "push-2" and len(r["stages"]) == 2 for r in s["recent"]))
        words = state["stages"]["words"]
        assert words["errors"] == 0 and words["p50"] is not None and words["p50"] <= words["p99"]
        assert state["pipeline"]["requests"]["ok"] >= 3
        recent = next(r for r in state["recent"] if r["id"] == "push-2")
        assert recent["status"] == "ok" and recent["error"] is None and recent["stream"] is False
        shout, word = recent["stages"]
        assert (shout["stage"], word["stage"]) == ("shout", "words") and shout["status"] == word["status"] == "ok"
        assert 0 <= shout["start"] <= word["start"] <= recent["seconds"] + 1.0
        assert [r["id"] for r in state["recent"][:3]] == ["push-2", "push-1", "push-0"]  # newest first
        # requests/s is measured over the last seconds: it goes back to 0 once nothing runs
        assert state["pipeline"]["requests_per_s"] > 0 or state["stages"]["words"]["requests_per_s"] > 0
        events.wait(lambda s: s["stages"]["words"]["requests_per_s"] == 0, deadline=20)


def test_tensor_bytes_show_per_relay_and_process_pair(server, client):
    with Events(server.url) as events:
        before = {(r["relay"], r["src"], r["dst"]): r["bytes"] for r in events.wait(lambda s: True)["relays"]}
        r = client.post("/v1/pipelines/words/requests", json={"input": {"text": "bytes", "tensor": 1000}})
        assert r.status_code == 200
        key = ("shm", "shout", "words")  # 1000 float32 from shout's process to words'
        state = events.wait(lambda s: any((x["relay"], x["src"], x["dst"]) == key and x["bytes"] >= before.get(key, 0) + 4000
                                          for x in s["relays"]))
        assert all(x["bytes"] >= 0 and x["bytes_per_s"] >= 0 for x in state["relays"])


def test_a_request_in_flight_shows_in_its_stage_and_the_pipeline(server, client, tmp_path):
    gate = tmp_path / "gate"
    done: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: done.append(client.post(
        "/v1/pipelines/words/requests", json={"input": {"text": "held here", "gate": str(gate)}})))
    try:
        with Events(server.url) as events:
            sender.start()
            state = events.wait(lambda s: s["stages"]["words"]["in_flight"] == 1)
            assert state["pipeline"]["in_flight"] == 1 and state["stages"]["shout"]["in_flight"] == 0
            gate.write_text("go")
            sender.join(30)
            assert done and done[0].status_code == 200
            events.wait(lambda s: s["stages"]["words"]["in_flight"] == 0 and s["pipeline"]["in_flight"] == 0)
    finally:  # the held request ends whatever failed
        gate.write_text("go")
        if sender.is_alive():
            sender.join(30)


def test_the_playground_streams_chunks_then_the_result(client):
    with client.stream("POST", "/console/requests", json={"input": {"text": "one two three"}}) as r:
        assert r.status_code == 200
        events = sse_events(list(r.iter_lines()))
    names = [name for name, _ in events]
    assert names == ["chunk", "chunk", "chunk", "result"]
    assert [json.loads(d)["data"]["text"] for _, d in events[:3]] == ["ONE", "TWO", "THREE"]
    assert all(json.loads(d)["stage"] == "words" for _, d in events[:3])
    assert json.loads(events[-1][1])["result"]["text"] == "ONE TWO THREE"


def test_a_playground_error_names_the_stage_with_its_traceback_and_no_paths(client):
    with client.stream("POST", "/console/requests", json={"input": {"text": "a b c", "fail_after": 2}}) as r:
        events = sse_events(list(r.iter_lines()))
    assert [name for name, _ in events] == ["chunk", "chunk", "error"]
    error = json.loads(events[-1][1])
    assert error["type"] == "ValueError" and error["stage"] == "words" and error["message"] == "failed after 2 word(s)"
    assert 'File "serve_stages.py"' in error["traceback"] and "raise ValueError" in error["traceback"]
    assert str(HERE) not in error["traceback"] and not re.search(r'File "[^"]*/', error["traceback"])


def test_playground_bodies_are_checked_like_the_request_route(client):
    r = client.post("/console/requests", json={"inputs": {}})
    assert r.status_code == 400 and "unknown field" in r.json()["error"]["message"]
    assert client.post("/console/requests", content=b"{").status_code == 400


def test_the_console_shows_no_path_address_or_environment(server, client):
    body = client.get("/console/state").json()
    text = json.dumps(body)
    assert set(body) == {"topology", "state"}
    for leak in ("omni-run-", "/tmp", str(HERE), "ipc://", "tcp://", "PYTHONPATH", "OMP_", "CUDA_VISIBLE", "env", "endpoint"):
        assert leak not in text, leak

    def strings(value):
        if isinstance(value, dict):
            for v in value.values():
                yield from strings(v)
        elif isinstance(value, list):
            for v in value:
                yield from strings(v)
        elif isinstance(value, str):
            yield value

    assert [s for s in strings(body) if "/" in s] == ["/v1/pipelines/words/requests"]
    shown = client.get("/v1/pipelines").json()["pipelines"][0]["processes"]
    assert {n: p["pid"] for n, p in body["state"]["processes"].items()} == shown


def test_an_api_may_not_take_the_console_paths():
    from omni_core.serve.app import CORE_PATHS

    assert {"/", "/console/events", "/console/requests"} <= set(CORE_PATHS)


# -- restarts, --no-console, drain -------------------------------------------------------------------


def test_a_killed_process_shows_as_restarting_then_running_with_its_restart_counted():
    server = ServerProcess(str(CONFIGS / "restarting.yaml"), env=ENV).start()
    try:
        with Events(server.url) as events:
            first = events.wait(lambda s: True)
            pid = first["processes"]["words"]["pid"]
            os.kill(pid, signal.SIGKILL)
            after = events.wait(lambda s: s["processes"]["words"]["restarts"] == 1 and s["processes"]["words"]["state"] == "running"
                                and s["pipeline"]["state"] == "running")
            assert after["processes"]["words"]["pid"] != pid and after["pipeline"]["restarts"] == 1
            assert after["processes"]["shout"] == first["processes"]["shout"]
            seen = {s["processes"]["words"]["state"] for s in events.states()}
            assert seen <= {"running", "restarting", "starting"}, seen

            # Past max_restarts it stays dead: the page sees it, then the server exits 3.
            os.kill(after["processes"]["words"]["pid"], signal.SIGKILL)
            dead = events.wait(lambda s: s["processes"]["words"]["state"] == "dead")
            assert dead["pipeline"]["state"] in ("stopping", "stopped")
            assert server.wait(30) == 3, server.output()
    finally:
        server.stop()
    server.assert_nothing_left()


def test_no_console_serves_no_page_and_no_push_channel():
    with served(str(CONFIGS / "words.yaml"), "--no-console", env=ENV) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        for path in ("/", "/console/events", "/console/state", "/console/static/console.js"):
            assert client.get(path).status_code == 404, path
        assert client.post("/console/requests", json={"input": {}}).status_code in (404, 405)
        assert client.get("/ready").status_code == 200


def test_an_open_push_channel_ends_when_the_server_drains():
    with served(str(CONFIGS / "words.yaml"), env=ENV) as server, Events(server.url) as events:
        events.wait(lambda s: True)
        server.signal(signal.SIGTERM)
        assert server.wait(30) == 0, server.output()
        # The channel ended itself when the drain began; uvicorn did not have to cut it.
        assert events.ended.wait(10) and events.error is None, events.error
        assert not any(name == "state" and data["pipeline"]["state"] == "stopped" for name, data in events.events)

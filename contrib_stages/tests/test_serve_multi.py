"""``omni serve A B ...``: several pipelines in one server. Each keeps its own processes, metrics
(their ``pipeline`` label, stage metrics included) and console graph; the core route reaches each
by name; the ``openai`` API picks one by the request's ``model`` (the official SDK against a toy
ASR and a toy TTS pipeline served beside two plain ones); ``/ready`` waits for all; SIGTERM
drains all; a pipeline that cannot go on makes the server exit non-zero; two of one name are
refused before anything starts."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile
from speech_configs import asr_config, tts_config

from omni_core.serve.server import PIPELINE_FAILED_EXIT
from omni_core.testing.serve import ServerProcess
from omni_core.testing.waiting import holds_within

pytestmark = pytest.mark.timeout(300)

# With the openai API and the toy ASR/TTS stages of these tests, and omni-core's serve test configs.
CONTRIB_TESTS = Path(__file__).parent
CORE_TESTS = CONTRIB_TESTS.parent.parent / "tests"
WORDS = str(CORE_TESTS / "configs" / "serve" / "words.yaml")
SMALL = str(CORE_TESTS / "configs" / "serve" / "small.yaml")
NEVER = str(CORE_TESTS / "configs" / "serve" / "never.yaml")
ENV = {"PYTHONPATH": os.pathsep.join([str(CORE_TESTS), str(CONTRIB_TESTS), os.environ.get("PYTHONPATH", "")])}

ASR, TTS = asr_config(), tts_config()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multi")
    (tmp / "asr.yaml").write_text(ASR)
    (tmp / "tts.yaml").write_text(TTS)
    srv = ServerProcess(WORDS, SMALL, str(tmp / "asr.yaml"), str(tmp / "tts.yaml"), env=ENV, cwd=str(tmp),
                        ready_timeout=300)
    with srv.serving():
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture
def sdk(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def wav(seconds: float = 0.5, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    samples = (0.3 * np.sin(2 * np.pi * 220 * t) * np.linspace(0, 1, len(t))).astype(np.float32)
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def test_every_pipeline_is_listed_with_processes_of_its_own(client):
    listed = client.get("/v1/pipelines").json()["pipelines"]
    assert [p["name"] for p in listed] == ["words", "small", "asr", "tts"]
    assert all(p["ready"] and p["state"] == "running" for p in listed)
    pids = [set(p["processes"].values()) for p in listed]
    assert all(pids) and sum(len(s) for s in pids) == len(set().union(*pids))  # none shared
    assert {p["name"]: p["apis"] for p in listed} == {"words": [], "small": [], "asr": ["openai"], "tts": ["openai"]}
    ready = client.get("/ready")
    assert ready.status_code == 200
    assert ready.json()["pipelines"] == {n: {"status": "ready"} for n in ("words", "small", "asr", "tts")}
    assert client.get("/openapi.json").json()["info"]["title"] == "omni serve: words small asr tts"


def test_the_core_route_serves_each_pipeline_by_name(client):
    for name in ("words", "small"):
        r = client.post(f"/v1/pipelines/{name}/requests", json={"input": {"text": "one two"}})
        assert r.status_code == 200, r.text
        assert r.json()["result"] == client.post("/v1/pipelines/words/requests",
                                                 json={"input": {"text": "one two"}}).json()["result"]
    r = client.post("/v1/pipelines/nope/requests", json={"input": {"text": "x"}})
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert all(repr(n) in message for n in ("words", "small", "asr", "tts")), message


def test_the_openai_api_picks_the_pipeline_by_model(client, sdk, monkeypatch):
    assert [m.id for m in sdk.models.list().data] == ["asr", "tts"]
    assert sdk.models.retrieve("tts").id == "tts"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("words")
    data = wav()
    text = sdk.audio.transcriptions.create(model="asr", file=("a.wav", data, "audio/wav")).text
    monkeypatch.syspath_prepend(str(CONTRIB_TESTS))
    from audio_stages import transcribe

    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    assert text == " ".join(w for _, _, w in transcribe(samples, rate))
    speech = sdk.audio.speech.create(model="tts", input="hello", voice="0", response_format="pcm")
    assert len(speech.content) > 0
    # A model served that has no such route, and one that does not exist.
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.audio.transcriptions.create(model="tts", file=("a.wav", data, "audio/wav"))
    assert "'asr'" in str(bad.value)
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.audio.speech.create(model="nope", input="hello", voice="0")
    assert "'tts'" in str(missing.value) and "'asr'" in str(missing.value)
    with pytest.raises(openai.BadRequestError) as no_model:
        sdk.audio.speech.create(model="", input="hello", voice="0")
    assert "model" in str(no_model.value)


def test_metrics_are_labelled_by_pipeline(client):
    for name in ("words", "small"):
        assert client.post(f"/v1/pipelines/{name}/requests", json={"input": {"text": "a b"}}).status_code == 200

    def labelled() -> bool:
        text = client.get("/metrics").text
        return all(f'omni_stage_calls_total{{pipeline="{n}",stage="words",status="ok"}}' in text
                   for n in ("words", "small"))

    assert holds_within(labelled, 30), client.get("/metrics").text
    text = client.get("/metrics").text
    assert 'omni_requests_total{pipeline="small",status="ok"}' in text
    assert 'omni_requests_total{pipeline="words",status="ok"}' in text
    assert text.count("# TYPE omni_stage_calls_total counter") == 1


def test_each_pipeline_has_its_own_console_graph(client):
    default = client.get("/console/state").json()
    assert default["pipelines"] == ["words", "small", "asr", "tts"]
    assert default["topology"]["pipeline"] == "words"
    asr = client.get("/console/state", params={"pipeline": "asr"}).json()
    assert asr["topology"]["pipeline"] == "asr"
    assert asr["topology"]["stages"] == ["asr"]
    r = client.get("/console/state", params={"pipeline": "nope"})
    assert r.status_code == 404 and "'tts'" in r.json()["error"]["message"]
    r = client.post("/console/requests", params={"pipeline": "small"}, json={"input": {"text": "hi"}})
    assert r.status_code == 200 and "event: result" in r.text


def test_sigterm_drains_every_pipeline(tmp_path):
    """A request in flight in each pipeline finishes after SIGTERM; then the server exits 0 and
    leaves nothing behind."""
    server = ServerProcess(WORDS, SMALL, env=ENV, cwd=str(tmp_path)).start()
    gates = {name: tmp_path / f"gate-{name}" for name in ("words", "small")}
    answers: dict[str, httpx.Response] = {}

    def send(name: str) -> None:
        answers[name] = httpx.post(f"{server.url}/v1/pipelines/{name}/requests", timeout=60,
                                   json={"input": {"text": "one two", "gate": str(gates[name])}})

    workers = [threading.Thread(target=send, args=(n,)) for n in gates]
    try:
        for w in workers:
            w.start()

        def both_in_flight() -> bool:
            text = httpx.get(f"{server.url}/metrics", timeout=30).text
            return all(f'omni_requests_in_flight{{pipeline="{n}"}} 1.0' in text for n in gates)

        assert holds_within(both_in_flight, 30)
        server.signal(signal.SIGTERM)
        assert holds_within(lambda: httpx.get(f"{server.url}/ready", timeout=5).status_code == 503, 10)
        for gate in gates.values():
            gate.write_text("open")
        for w in workers:
            w.join(60)
        assert {n: r.status_code for n, r in answers.items()} == {"words": 200, "small": 200}
        assert server.wait(60) == 0, server.output()
    finally:
        server.stop()
    server.assert_nothing_left()


def test_a_pipeline_that_cannot_go_on_makes_the_server_exit_non_zero(tmp_path):
    server = ServerProcess(WORDS, NEVER, env=ENV, cwd=str(tmp_path)).start()
    try:
        listed = httpx.get(f"{server.url}/v1/pipelines", timeout=30).json()["pipelines"]
        pid = next(p for p in listed if p["name"] == "never")["processes"]["words"]
        os.kill(pid, signal.SIGKILL)
        seen: list[httpx.Response] = []

        def probe() -> bool:
            try:
                r = httpx.get(f"{server.url}/health", timeout=5)
            except httpx.TransportError:
                return True
            seen.append(r)
            return r.status_code == 503

        assert holds_within(probe, 20)
        assert server.wait(30) == PIPELINE_FAILED_EXIT, server.output()
    finally:
        server.stop()
    failed = [r.json() for r in seen if r.status_code == 503]
    assert not failed or failed[-1]["pipeline"] == "never"
    server.assert_nothing_left()


def test_two_pipelines_of_one_name_are_refused_before_anything_starts(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "from omni_core.cli import main; main()", "serve", WORDS, WORDS,
                           "--port", "0"], env={**os.environ, **ENV}, cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "two pipelines named 'words'" in proc.stderr

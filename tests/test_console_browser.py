"""The console in a real browser (Debian's chromium driven by Playwright) against a real
``omni serve demo``: the graph, live numbers, the playground (a stream that grows, a stage error),
the chat tab, recent requests, a stage process killed under the page's eyes; no console error, no
request leaving 127.0.0.1, and a full-page screenshot.

Runs in tox's ``console`` env (``.ci/run`` installs chromium with apt), where
``OMNI_REQUIRE_CHROMIUM=1`` makes a missing Playwright, chromium or omni-contrib-stages (the demo
pipeline) a failure; elsewhere (the ``core`` env) the module is skipped then. The screenshot goes to
``$OMNI_TEST_ARTIFACTS/console.png`` (default: the test's temporary directory); docs/img/console.png
is a copy of it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import wave
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from test_console_push import served

CHROMIUM = os.environ.get("OMNI_CHROMIUM", "/usr/bin/chromium")
if os.environ.get("OMNI_REQUIRE_CHROMIUM") == "1":  # tox env console: a skip would be a failure
    import omni_contrib_stages  # noqa: F401 - the demo pipeline
    from playwright import sync_api as playwright_api
    assert os.path.exists(CHROMIUM), f"no chromium at {CHROMIUM}: apt-get install chromium (.ci/run does)"
else:
    playwright_api = pytest.importorskip("playwright.sync_api")
    pytest.importorskip("omni_contrib_stages")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
STAGES = ["preprocess", "audio_encoder", "image_encoder", "thinker", "talker", "vocoder"]
TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The demo's vocoder writes its WAV files in the server's working directory.
    env = {"OMNI_LOAD_PLUGINS": "contrib"}
    with served("demo", cwd=str(tmp_path_factory.mktemp("console")), env=env, ready_timeout=300) as srv:
        yield srv


class Watch:
    """What the page did: console messages and errors, and the host of every request it made."""

    def __init__(self):
        self.errors: list[str] = []
        self.hosts: list[tuple[str, str]] = []
        self.refused: list[str] = []

    def route(self, route):
        url = route.request.url
        host = urlsplit(url).hostname or ""
        self.hosts.append((host, url))
        if host != "127.0.0.1":
            self.refused.append(url)
            route.abort()
        else:
            route.continue_()


@pytest.fixture(scope="module")
def browser_page(server):
    watch = Watch()
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            context.route("**/*", watch.route)
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.on("console", lambda msg: watch.errors.append(f"console {msg.type}: {msg.text}") if msg.type == "error" else None)
            page.on("pageerror", lambda exc: watch.errors.append(f"page error: {exc}"))
            page.goto(server.url + "/")
            page.get_by_test_id("stage-vocoder").wait_for()
            yield page, watch
        finally:
            browser.close()


@pytest.fixture
def page(browser_page):
    return browser_page[0]


def text(page, testid: str) -> str:
    return page.get_by_test_id(testid).inner_text()


def test_every_stage_is_a_node_grouped_by_process_with_its_edges_relays(page):
    for stage in STAGES:
        assert page.get_by_test_id(f"stage-{stage}").is_visible(), stage
    # talker and vocoder share the process "speech"; the stream edges say so
    assert "process speech" in page.get_by_test_id("group-speech").text_content()  # SVG: no innerText
    assert page.get_by_test_id("edge-label-thinker-talker-stream").text_content() == "stream: shm"
    assert page.get_by_test_id("edge-label-talker-vocoder-next").text_content() == "object"
    assert page.get_by_test_id("edge-label-preprocess-audio_encoder-next").text_content() == "shm"
    assert text(page, "pipeline-name") == "demo"
    page.wait_for_function("() => document.querySelector('[data-testid=pipeline-state]').textContent === 'running'")


def test_live_numbers_change_while_requests_run(page, server):
    before = int(text(page, "stage-calls-thinker"))
    stamp = text(page, "updated")
    results: list[int] = []

    def load():
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for i in range(4):
                r = client.post("/v1/pipelines/demo/requests", json={"input": {"text": f"load {i}", "speak": False}})
                results.append(r.status_code)

    sender = threading.Thread(target=load)
    sender.start()
    try:
        page.wait_for_function(
            f"() => Number(document.querySelector('[data-testid=stage-calls-thinker]').textContent) >= {before + 2}")
        page.wait_for_function(f"() => document.querySelector('[data-testid=updated]').textContent !== {json.dumps(stamp)}")
    finally:
        sender.join(120)
    assert results == [200] * 4
    page.wait_for_function(f"() => Number(document.querySelector('[data-testid=stage-calls-thinker]').textContent) >= {before + 4}")
    assert text(page, "stage-errors-thinker") == "0"
    assert text(page, "stage-p50-thinker") != "–"


RECORD = """() => {
  window.__steps = [];
  const out = document.querySelector('[data-testid=playground-output]');
  const note = () => window.__steps.push({
    chunks: out.querySelectorAll('[data-testid=playground-chunk]').length,
    result: !!out.querySelector('[data-testid=playground-result]'),
    error: !!out.querySelector('[data-testid=playground-error]'),
  });
  new MutationObserver(note).observe(out, {childList: true, subtree: true});
}"""


def test_the_playground_streams_a_request_as_it_runs(page):
    example = json.loads(page.get_by_test_id("playground-input").input_value())
    assert example["text"] and example["stream_audio"] is True  # the demo's serve.options.console.example
    page.evaluate(RECORD)
    page.get_by_test_id("playground-send").click()
    page.get_by_test_id("playground-result").wait_for()
    steps = page.evaluate("window.__steps")
    before_result = sorted({s["chunks"] for s in steps if not s["result"] and s["chunks"]})
    assert len(before_result) >= 3, steps  # the output grew in several steps before the result
    assert not any(s["error"] for s in steps)
    output = page.get_by_test_id("playground-output")
    assert output.get_by_test_id("output-stage-thinker").is_visible()
    assert "audio" in output.get_by_test_id("output-stage-vocoder").inner_text()  # pcm16 chunks, played
    wav = page.get_by_test_id("playground-wav")
    assert wav.is_visible() and wav.get_attribute("href").startswith("blob:")
    with page.expect_download() as download:
        wav.click()
    path = download.value.path()
    with wave.open(str(path)) as w:  # a WAV file of every streamed sample
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() > 0
    assert "done in" in text(page, "playground-status")


def test_a_stage_error_is_shown_with_its_stage_and_traceback(page):
    page.get_by_test_id("playground-input").fill('{"text": ""}')
    page.get_by_test_id("playground-send").click()
    error = page.get_by_test_id("playground-error")
    error.wait_for()
    shown = error.inner_text()
    assert "InvalidInput in stage preprocess" in shown and "'text' must be a non-empty string" in shown
    traceback = page.get_by_test_id("playground-traceback").inner_text()
    assert 'File "stages.py"' in traceback and "Traceback" in traceback
    assert "/" not in "".join(line for line in traceback.splitlines() if line.strip().startswith("File"))


def test_the_chat_tab_talks_to_the_openai_api(page):
    page.get_by_test_id("tab-chat").click()
    page.get_by_test_id("chat-input").fill("hello omni")
    page.get_by_test_id("chat-send").click()
    page.wait_for_function("() => (document.querySelector('[data-testid=chat-answer]') || {}).textContent?.length > 3")
    page.wait_for_function("() => !document.querySelector('[data-testid=chat-send]').disabled")
    assert "error" not in page.get_by_test_id("chat-answer").get_attribute("class")
    page.get_by_test_id("tab-request").click()


def test_recent_requests_show_status_latency_and_a_timeline(page):
    page.wait_for_function("() => document.querySelectorAll('[data-testid=recent-row]').length >= 3")
    statuses = page.get_by_test_id("recent-status").all_inner_texts()
    assert "error (preprocess)" in statuses and "ok" in statuses, statuses  # the playground's requests
    # the stage processes' call records arrive within an export interval: segments per stage
    page.wait_for_function("() => document.querySelector('[data-testid=timeline]').querySelectorAll('.seg').length >= 3")


def test_full_page_screenshot(page, tmp_path):
    out = Path(os.environ.get("OMNI_TEST_ARTIFACTS") or tmp_path) / "console.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    # The playground's streamed example, as a reader of the docs would see it.
    page.get_by_test_id("playground-input").fill(json.dumps({"text": "hello omni", "max_tokens": 13, "stream_audio": True}, indent=2))
    page.get_by_test_id("playground-send").click()
    page.get_by_test_id("playground-result").wait_for()
    page.wait_for_function("() => [...document.querySelectorAll('[data-testid^=stage-in-flight-]')].every((td) => td.textContent === '0')")
    page.evaluate("() => { document.querySelector('[data-testid=playground-output]').scrollTop = 0; }")
    page.screenshot(path=str(out), full_page=True)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_a_killed_stage_process_is_restarted_and_shown_running_with_its_restart_counted(page, server):
    pid = httpx.get(f"{server.url}/v1/pipelines", timeout=10).json()["pipelines"][0]["processes"]["speech"]
    before = int(text(page, "process-restarts-speech"))
    os.kill(pid, signal.SIGKILL)
    # The demo's restart policy is on-failure: the speech group comes back (often within one push of
    # the page, so its passing 'restarting' state need not show), its restart counted; the others
    # never stopped.
    page.wait_for_function(f"() => Number(document.querySelector('[data-testid=process-restarts-speech]').textContent) > {before}"
                           " && document.querySelector('[data-testid=process-state-speech]').textContent === 'running'"
                           " && document.querySelector('[data-testid=pipeline-state]').textContent === 'running'", timeout=120_000)
    assert text(page, "process-state-thinker") == "running"
    assert httpx.get(f"{server.url}/v1/pipelines", timeout=10).json()["pipelines"][0]["processes"]["speech"] != pid


def test_no_console_error_and_no_request_left_127_0_0_1(browser_page):
    _, watch = browser_page
    assert watch.errors == []
    assert watch.hosts and watch.refused == []
    assert {host for host, _ in watch.hosts} == {"127.0.0.1"}
    assert any(url.endswith("/console/events") for _, url in watch.hosts)


#: Speech pipelines behind the openai API: each mounts /v1/audio/*, no chat completions route.
SPEAKER = {
    "name": "speaker",
    "stages": [{"name": "tts", "factory": "console_stages:Tone", "terminal": True}],
    "serve": {"apis": ["openai"], "options": {"openai": {"kind": "tts", "audio_stage": "tts", "voices": ["alloy"]}}},
}
LISTENER = {
    "name": "listener",
    "stages": [{"name": "asr", "factory": "console_stages:Heard", "terminal": True}],
    "serve": {"apis": ["openai"], "options": {"openai": {"kind": "asr"}}},
}


def test_tts_and_asr_pipelines_get_speech_and_transcribe_tabs_and_no_chat(browser_page, tmp_path):
    """The tabs follow what the mounted API serves each pipeline: the openai API of a tts pipeline
    serves /v1/audio/speech (a Speech tab: text in, a WAV that plays), of an asr pipeline
    /v1/audio/transcriptions (a Transcribe tab: a file in, its text); neither has a Chat tab. The
    demo, a chat pipeline, keeps its Chat tab (test_the_chat_tab_talks_to_the_openai_api) and gets
    neither of the others."""
    import yaml

    from omni_core.testing.serve import ServerProcess

    browser = browser_page[0].context.browser  # the module's browser (one Playwright per process)
    assert browser_page[0].get_by_test_id("tab-speech").is_hidden()
    assert browser_page[0].get_by_test_id("tab-transcribe").is_hidden()
    (tmp_path / "listener.yaml").write_text(yaml.safe_dump(LISTENER))
    clip = tmp_path / "clip.wav"
    with wave.open(str(clip), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x10\x00" * 8000)
    env = {"OMNI_LOAD_PLUGINS": "contrib"}
    with ServerProcess.of_config(SPEAKER, tmp_path, str(tmp_path / "listener.yaml"), name="speaker", env=env,
                                 pythonpath=[Path(__file__).parent], ready_timeout=300).serving() as srv:
        tabs = {}
        for name in ("speaker", "listener"):
            topo = httpx.get(f"{srv.url}/console/state", params={"pipeline": name}, timeout=30).json()["topology"]
            tabs[name] = (topo["chat"], topo["speech"], topo["transcription"])
        assert tabs == {"speaker": (None, "/v1/audio/speech", None),
                        "listener": (None, None, "/v1/audio/transcriptions")}
        watch = Watch()
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        try:
            context.route("**/*", watch.route)
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.on("pageerror", lambda exc: watch.errors.append(f"page error: {exc}"))

            page.goto(srv.url + "/?pipeline=speaker")
            page.get_by_test_id("stage-row-tts").wait_for()  # the topology is drawn (the tabs set with it)
            assert page.get_by_test_id("tab-chat").is_hidden() and page.get_by_test_id("tab-transcribe").is_hidden()
            page.get_by_test_id("tab-speech").click()
            page.get_by_test_id("speech-input").fill("one two three")
            page.get_by_test_id("speech-send").click()
            page.wait_for_function("() => document.querySelector('[data-testid=speech-audio]').duration > 0")
            seconds = page.evaluate("() => document.querySelector('[data-testid=speech-audio]').duration")
            assert abs(seconds - 0.3) < 0.01  # three words, a 0.1 s tone each
            assert text(page, "speech-status").endswith("bytes of WAV")
            page.get_by_test_id("speech-voice").fill("nobody")  # the API's 400, shown in its words
            page.get_by_test_id("speech-send").click()
            page.wait_for_function("() => document.querySelector('[data-testid=speech-status]').classList"
                                   ".contains('state-error')")
            assert "the voice 'nobody' is not one of this model's: alloy" in text(page, "speech-status")

            page.goto(srv.url + "/?pipeline=listener")
            page.get_by_test_id("stage-row-asr").wait_for()
            assert page.get_by_test_id("tab-chat").is_hidden() and page.get_by_test_id("tab-speech").is_hidden()
            page.get_by_test_id("tab-transcribe").click()
            page.get_by_test_id("transcribe-file").set_input_files(str(clip))
            page.get_by_test_id("transcribe-send").click()
            page.wait_for_function(
                "() => document.querySelector('[data-testid=transcribe-text]').textContent.length > 0")
            assert text(page, "transcribe-text") == "8000 samples at 16000 Hz"
        finally:
            context.close()
        assert watch.errors == [] and watch.refused == []

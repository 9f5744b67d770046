"""The demo pipeline end to end: result shape, the WAV file, determinism across runs, streaming
order, routing without speech, concurrency, input errors."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import wave

import pytest
from conftest import arun
from omni_contrib_stages.demo.models import PATTERN, VOCAB, WORDS

from omni_core import Pipeline, StageError, metrics

pytestmark = pytest.mark.timeout(120)

TEXT = "hello omni"


def read_wav(path):
    with wave.open(str(path), "rb") as w:
        header = (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes(), w.getcomptype())
        return header, w.readframes(w.getnframes())


@pytest.fixture(scope="module")
def clean_env():
    """The module's pipelines must not see the OMNI_* settings of the shell running pytest."""
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("OMNI_")]:
            mp.delenv(key)
        yield


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, clean_env, module_no_leaks):
    """The same request through two separately started demo pipelines: once with ``submit``,
    once with ``stream`` (recording every event)."""
    out = tmp_path_factory.mktemp("runs")

    async def submitted():
        async with Pipeline("demo") as p:
            return await p.submit({"text": TEXT, "wav_path": str(out / "first.wav")})

    async def streamed():
        async with Pipeline("demo") as p:
            return [event async for event in p.stream({"text": TEXT, "wav_path": str(out / "second.wav")})]

    first = arun(submitted(), 100)
    events = arun(streamed(), 100)
    return {"first": first, "events": events, "second": events[-1].data, "dir": out}


@pytest.fixture(scope="module")
def demo(clean_env, module_no_leaks):
    """One demo pipeline for the module, running on an event loop in a thread; ``call(coro)``
    runs a coroutine there."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="demo-loop", daemon=True)
    thread.start()

    def call(coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), loop).result()

    pipeline = Pipeline("demo")
    try:
        call(pipeline.start(), 100)
        yield pipeline, call
    finally:
        call(pipeline.stop(), 60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


# -- one request --------------------------------------------------------------------------------------


def test_the_result_holds_the_thinker_text_and_the_vocoder_file(two_runs):
    result = two_runs["first"]
    assert set(result) == {"thinker", "vocoder"}
    thinker, vocoder = result["thinker"], result["vocoder"]
    words = thinker["text"].removesuffix(".").split()
    assert thinker["text"].endswith(".") and len(words) == 13 == len(thinker["token_ids"])
    assert words == [VOCAB[i] for i in thinker["token_ids"]]
    assert all(word in WORDS[PATTERN[i]] for i, word in enumerate(words))  # readable: follows the pattern
    assert vocoder["wav_path"] == str(two_runs["dir"] / "first.wav")
    assert vocoder["sample_rate"] == 24000
    assert vocoder["frames"] == 13 * 4
    assert vocoder["duration"] == pytest.approx(vocoder["samples"] / 24000)
    assert vocoder["samples"] == (13 * 4 + 1) * 1200  # one hop per frame, plus the fade-out


def test_the_wav_file_is_mono_16_bit_pcm_with_sound_in_it(two_runs):
    vocoder = two_runs["first"]["vocoder"]
    (channels, width, rate, nframes, comp), data = read_wav(vocoder["wav_path"])
    assert (channels, width, rate, comp) == (1, 2, 24000, "NONE")
    assert nframes == vocoder["samples"] and len(data) == 2 * nframes
    samples = memoryview(data).cast("h")
    assert max(abs(s) for s in samples) > 3000  # not silence
    assert not [n for n in os.listdir(two_runs["dir"]) if n.endswith(".partial")]


def test_two_runs_give_the_same_words_and_the_same_audio(two_runs):
    first, second = two_runs["first"], two_runs["second"]
    assert first["thinker"] == second["thinker"]
    assert {k: v for k, v in first["vocoder"].items() if k != "wav_path"} == \
        {k: v for k, v in second["vocoder"].items() if k != "wav_path"}
    assert read_wav(first["vocoder"]["wav_path"]) == read_wav(second["vocoder"]["wav_path"])


def test_streamed_tokens_come_in_order_before_the_result(two_runs):
    events = two_runs["events"]
    *chunks, last = events
    assert last.is_result and not any(e.is_result for e in chunks)
    assert {e.stage for e in chunks} == {"thinker"}  # the talker's frames go to the vocoder only
    assert [e.data["index"] for e in chunks] == list(range(13))
    assert [e.data["token_id"] for e in chunks] == last.data["thinker"]["token_ids"]
    assert " ".join(e.data["text"] for e in chunks) + "." == last.data["thinker"]["text"]


# -- a running pipeline -----------------------------------------------------------------------------------


def test_different_texts_give_different_words(demo, tmp_path):
    pipeline, call = demo
    texts = ["hello omni", "what is in this picture?", "a quiet morning by the sea"]
    results = [call(pipeline.submit({"text": t, "wav_path": str(tmp_path / f"{i}.wav"), "max_tokens": 6}))
               for i, t in enumerate(texts)]
    sentences = {r["thinker"]["text"] for r in results}
    assert len(sentences) >= 2
    assert all(len(r["thinker"]["token_ids"]) == 6 for r in results)


def test_without_speech_only_the_thinker_answers(demo, tmp_path):
    pipeline, call = demo
    result = call(pipeline.submit({"text": TEXT, "speak": False, "wav_path": str(tmp_path / "none.wav")}))
    assert set(result) == {"thinker"}
    assert len(result["thinker"]["token_ids"]) == 13
    assert not (tmp_path / "none.wav").exists()


def test_concurrent_requests_get_the_same_answers_as_alone(demo, tmp_path):
    pipeline, call = demo
    alone = call(pipeline.submit({"text": TEXT, "wav_path": str(tmp_path / "alone.wav"), "max_tokens": 5}))

    async def together():
        texts = [TEXT] + [f"request number {i}" for i in range(5)]
        return await asyncio.gather(*(pipeline.submit({"text": t, "wav_path": str(tmp_path / f"c{i}.wav"), "max_tokens": 5})
                                      for i, t in enumerate(texts)))

    results = call(together(), 100)
    assert results[0]["thinker"] == alone["thinker"]
    assert read_wav(tmp_path / "c0.wav") == read_wav(tmp_path / "alone.wav")
    assert len({r["vocoder"]["wav_path"] for r in results}) == 6
    assert all(os.path.exists(r["vocoder"]["wav_path"]) for r in results)


def test_audio_and_image_inputs_are_accepted(demo, tmp_path):
    pipeline, call = demo
    audio = [((i * 7) % 50 - 25) / 25 for i in range(3200)]
    image = [[[(x + y) / 14, x / 7, y / 7] for x in range(8)] for y in range(8)]
    given = call(pipeline.submit({"text": TEXT, "audio": audio, "image": image, "speak": False}))
    default = call(pipeline.submit({"text": TEXT, "speak": False}))
    assert len(given["thinker"]["token_ids"]) == 13
    assert given["thinker"]["token_ids"] != default["thinker"]["token_ids"]  # the encoders' output matters


def stage_calls(pipeline):
    """The stage calls that ended, by ``(stage, status)``, over every process (omni_stage_calls_total)."""
    rows = metrics.collect(pipeline)["values"].get("omni_stage_calls_total", [])
    return {tuple(labels): value for labels, value in rows}


def in_flight(pipeline):
    """The stages with a call running now (omni_stage_in_flight)."""
    rows = metrics.collect(pipeline)["values"].get("omni_stage_in_flight", [])
    return {labels[0]: value for labels, value in rows if value}


def test_leaving_the_stream_early_aborts_the_request_everywhere(demo, tmp_path):
    pipeline, call = demo

    async def read_three():
        events = []
        stream = pipeline.stream({"text": TEXT, "wav_path": str(tmp_path / "aborted.wav"), "max_tokens": 40})
        async for event in stream:
            events.append(event)
            if len(events) == 3:
                break
        await stream.aclose()
        return events

    before = stage_calls(pipeline)
    events = call(read_three())
    assert [e.data["index"] for e in events] == [0, 1, 2]
    # Wait until the request ended in every stage that ran it: the thinker's call and the
    # vocoder's ended, aborted (unaborted, the thinker would finish its 40 words and the vocoder
    # write its file), and no stage has a call in flight.
    deadline = time.monotonic() + 30
    while True:
        ended = {stage: n - before.get(stage, 0) for stage, n in stage_calls(pipeline).items()}
        if ended.get(("thinker", "aborted")) and ended.get(("vocoder", "aborted")) and not in_flight(pipeline):
            break
        assert time.monotonic() < deadline, f"the aborted request did not end everywhere: calls ended {ended}"
        time.sleep(0.05)
    assert not list(tmp_path.iterdir())  # no WAV, no partial file
    again = call(pipeline.submit({"text": TEXT, "wav_path": str(tmp_path / "after.wav"), "max_tokens": 3}))
    assert len(again["thinker"]["token_ids"]) == 3 and os.path.exists(again["vocoder"]["wav_path"])


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"txt": "hi"}, r"unknown input key\(s\) \['txt'\]"),
        ({"text": ""}, "'text' must be a non-empty string"),
        ({"text": "hi", "max_tokens": 0}, "'max_tokens' must be an integer from 1 to 64"),
        ({"text": "hi", "audio": [1, 2]}, "'audio' must be a flat list of at least 400 samples"),
        ("just text", "expected a JSON object, got str"),
    ],
)
def test_bad_inputs_fail_in_preprocess_with_an_example(demo, inputs, message):
    pipeline, call = demo
    with pytest.raises(StageError, match=message) as info:
        call(pipeline.submit(inputs))
    assert info.value.stage == "preprocess"
    assert '{"text": "hello omni", "max_tokens": 5}' in str(info.value)

"""The demo streams speech while it writes: the talker speaks while the thinker writes and the
vocoder's audio reaches the caller as frames come; every request gets a WAV file of its own."""

from __future__ import annotations

import asyncio
import os
import threading
import wave
from importlib.resources import files

import pytest
import yaml
from test_demo import clean_env  # noqa: F401 - the fixture

from omni_core import Pipeline

pytestmark = pytest.mark.timeout(180)

TEXT = "hello omni"


def read_wav(path) -> tuple[int, bytes]:
    with wave.open(str(path), "rb") as w:
        return w.getframerate(), w.readframes(w.getnframes())


@pytest.fixture(scope="module")
def live(tmp_path_factory, clean_env, module_no_leaks):  # noqa: F811 - clean_env is the fixture
    """The demo with 4 credits per stream, started in a fresh directory (where its default WAV
    files go), on an event loop in a thread; ``call(coro)`` runs a coroutine there.

    With 4 credits the thinker cannot write its 40th word before the caller has read some of
    the vocoder's audio: word 40 needs the talker to have read word 36, which needs the vocoder
    to have read about 32 frames, which needs the caller to have read about 28 audio chunks. So
    "audio before the last word" is an order the runtime guarantees, not a race the test wins."""
    cwd = tmp_path_factory.mktemp("cwd")
    cfg = yaml.safe_load(files("omni_contrib_stages").joinpath("pipelines/demo.yaml").read_text())
    cfg["limits"] = {**cfg.get("limits", {}), "stream_buffer": 4, "stream_stall_timeout": 30}
    # A folder for the WAVs of requests that name none (the shipped config writes none).
    cfg["stages"][0]["args"]["wav_dir"] = "omni-demo"
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="demo-live-loop", daemon=True)
    thread.start()

    def call(coro, timeout: float = 90):
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), loop).result()

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        pipeline = Pipeline(cfg)
        try:
            call(pipeline.start(), 100)
            yield pipeline, call, cwd
        finally:
            call(pipeline.stop(), 60)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


def test_the_first_audio_chunk_arrives_before_the_last_text_chunk(live, tmp_path):
    pipeline, call, _ = live

    async def stream():
        inputs = {"text": TEXT, "max_tokens": 40, "stream_audio": True, "wav_path": str(tmp_path / "live.wav")}
        return [event async for event in pipeline.stream(inputs)]

    events = call(stream())
    kinds = [(e.stage, e.data["index"]) for e in events if not e.is_result]
    text = [i for i, (stage, _) in enumerate(kinds) if stage == "thinker"]
    audio = [i for i, (stage, _) in enumerate(kinds) if stage == "vocoder"]
    assert len(text) == 40 and len(audio) == 41  # a chunk per word, then the fade-out
    assert audio[0] < text[-1], f"the first audio chunk came after the last word: {kinds}"
    assert [kinds[i][1] for i in audio] == list(range(41))
    # the streamed audio is the file's, chunk by chunk, in order
    result = events[-1].data["vocoder"]
    rate, frames = read_wav(result["wav_path"])
    pcm = b"".join(e.data["pcm16"] for e in events if not e.is_result and e.stage == "vocoder")
    assert rate == 24000 and pcm == frames and len(frames) == 2 * result["samples"]


def test_concurrent_requests_each_write_a_wav_named_by_their_request_id(live):
    pipeline, call, cwd = live
    ids = [f"req-{i}" for i in range(6)] + ["a/b", "../escape", ".hidden"]

    async def together():
        return await asyncio.gather(*(pipeline.submit({"text": f"request {rid}", "max_tokens": 3}, request_id=rid)
                                      for rid in ids))

    results = call(together())
    paths = [r["vocoder"]["wav_path"] for r in results]
    folder = cwd / "omni-demo"
    assert paths[:6] == [str(folder / f"req-{i}.wav") for i in range(6)]
    assert len(set(paths)) == len(ids), "one file per request"
    for path, result in zip(paths, results, strict=True):
        assert os.path.dirname(path) == str(folder) and not os.path.basename(path).startswith(".")
        rate, frames = read_wav(path)
        assert rate == 24000 and len(frames) == 2 * result["vocoder"]["samples"]
    assert sorted(os.listdir(folder)) == sorted(os.path.basename(p) for p in paths)  # no partial files


def test_a_null_wav_path_writes_no_file(live):
    pipeline, call, cwd = live
    before = sorted(p for p in cwd.rglob("*"))
    result = call(pipeline.submit({"text": TEXT, "max_tokens": 2, "wav_path": None}))
    assert result["vocoder"]["wav_path"] is None and result["vocoder"]["samples"] == (2 * 4 + 1) * 1200
    assert sorted(p for p in cwd.rglob("*")) == before

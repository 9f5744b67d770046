"""The ``openai`` API's audio endpoints against real ``omni serve`` processes running the toy speech
pipelines of :mod:`audio_stages`: ``/v1/audio/transcriptions`` and ``/v1/audio/speech`` through
the official ``openai`` SDK (streamed and not, every response format), httpx and curl, and bad
requests answered 400 / 404 / 413 in OpenAI's error shape after one POST."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile
from audio_stages import RATE, speak, transcribe
from speech_configs import asr_config, tts_config

from omni_core.testing.serve import ServerProcess, openai_client

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent

# The ASR pipeline as its tests ask it: language and prompt keys, at most 20 s of audio, 1 MB bodies.
ASR_OPTIONS: dict = {"audio": {"language_key": "language", "prompt_key": "prompt", "max_audio_seconds": 20},
                     "serve": {"max_request_bytes": 1000000}}
ASR = asr_config(**ASR_OPTIONS)

TTS = tts_config(audio={"speed_key": "speed"})


def serve(tmp_path_factory, name: str, config: str, env: dict[str, str] | None = None, *args: str):
    return ServerProcess.of_config(config, tmp_path_factory.mktemp(name), *args, name=name, env=env,
                                   pythonpath=[HERE]).serving()


@pytest.fixture(scope="module")
def asr(tmp_path_factory):
    hold = tmp_path_factory.mktemp("hold")
    with serve(tmp_path_factory, "asr", ASR, {"AUDIO_STAGES_HOLD": str(hold)}) as srv:
        srv.hold = hold
        yield srv


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    hold = tmp_path_factory.mktemp("hold")
    with serve(tmp_path_factory, "tts", TTS, {"AUDIO_STAGES_HOLD": str(hold)}) as srv:
        srv.hold = hold
        yield srv


@pytest.fixture
def posts():
    return []


def sdk(server, posts):
    return openai_client(server, posts, max_retries=0)


@pytest.fixture
def asr_client(asr, posts):
    with sdk(asr, posts) as c:
        yield c


@pytest.fixture
def tts_client(tts, posts):
    with sdk(tts, posts) as c:
        yield c


def clip(seconds: float = 0.75, rate: int = 16000) -> np.ndarray:
    """A tone whose loudness ramps up: each 0.1 s block reads as another word."""
    t = np.arange(round(seconds * rate)) / rate
    return (np.sin(2 * np.pi * 440 * t) * np.linspace(0.05, 0.9, len(t))).astype(np.float32)


def audio_file(fmt: str, samples: np.ndarray | None = None, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    samples = clip(rate=rate) if samples is None else samples
    subtype = {"WAV": "PCM_16", "FLAC": "PCM_16", "OGG": "VORBIS", "MP3": "MPEG_LAYER_III"}[fmt]
    soundfile.write(out, samples, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def expected_words(data: bytes) -> list[tuple[float, float, str]]:
    """What the toy ASR makes of a file, decoded as the server decodes it."""
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return transcribe(samples.mean(axis=1, dtype=np.float32), rate)


def expected_text(data: bytes) -> str:
    return " ".join(w for _, _, w in expected_words(data))


def openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# -- transcriptions -------------------------------------------------------------------------------


def test_the_asr_pipeline_is_the_model_and_has_no_chat_route(asr, asr_client):
    assert [m.id for m in asr_client.models.list()] == ["asr"]
    r = httpx.post(f"{asr.url}/v1/chat/completions", json={"model": "asr", "messages": []}, timeout=30)
    assert r.status_code in (404, 405)


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG", "MP3"])
def test_a_transcription_of_each_file_type(asr_client, fmt, posts):
    data = audio_file(fmt)
    done = asr_client.audio.transcriptions.create(model="asr", file=(f"clip.{fmt.lower()}", data))
    assert done.text == expected_text(data) and len(done.text.split()) >= 7
    assert done.usage.type == "tokens" and done.usage.input_tokens == len(expected_words(data))
    assert posts == ["/v1/audio/transcriptions"]


def test_a_stereo_file_is_mixed_down(asr_client):
    left = clip()
    data = audio_file("WAV", np.stack([left, left * 0.5], axis=1))
    assert asr_client.audio.transcriptions.create(model="asr", file=("s.wav", data)).text == expected_text(data)


def test_text_srt_and_vtt(asr_client):
    data = audio_file("WAV")
    words = expected_words(data)
    assert asr_client.audio.transcriptions.create(model="asr", file=("a.wav", data),
                                                  response_format="text") == expected_text(data)
    srt = asr_client.audio.transcriptions.create(model="asr", file=("a.wav", data), response_format="srt")
    blocks = [b.split("\n") for b in srt.strip().split("\n\n")]
    assert [b[0] for b in blocks] == [str(i) for i in range(1, len(words) + 1)]
    assert blocks[1][1] == "00:00:00,100 --> 00:00:00,200" and [b[2] for b in blocks] == [w for _, _, w in words]
    vtt = asr_client.audio.transcriptions.create(model="asr", file=("a.wav", data), response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n") and "00:00:00.100 --> 00:00:00.200\n" + words[1][2] in vtt


def test_verbose_json_with_segments_language_and_prompt(asr_client):
    data = audio_file("FLAC")
    words = expected_words(data)
    done = asr_client.audio.transcriptions.create(model="asr", file=("a.flac", data), response_format="verbose_json",
                                                  timestamp_granularities=["segment"], language="de", prompt="P: ")
    assert done.language == "de" and done.text == "P: " + expected_text(data)  # the toy's text starts with the prompt
    assert done.duration == pytest.approx(0.75)
    assert [(s.start, s.end, s.text) for s in done.segments] == words
    assert [s.id for s in done.segments] == list(range(len(words)))
    assert {s.no_speech_prob for s in done.segments} == {0.5} and "avg_logprob" not in done.segments[0].model_dump(
        exclude_unset=True)


def test_sixteen_concurrent_uploads_each_get_their_own_transcript(asr_client):
    from concurrent.futures import ThreadPoolExecutor

    files = [audio_file("FLAC", clip(0.3 + 0.1 * i) * (0.3 + 0.04 * i)) for i in range(16)]

    def one(data: bytes) -> str:
        return asr_client.audio.transcriptions.create(model="asr", file=("a.flac", data)).text

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, files)) == [expected_text(f) for f in files]


def test_a_streamed_transcription_joins_to_the_whole_text(asr_client):
    data = audio_file("WAV")
    whole = asr_client.audio.transcriptions.create(model="asr", file=("a.wav", data)).text
    events = list(asr_client.audio.transcriptions.create(model="asr", file=("a.wav", data), stream=True))
    deltas = [e for e in events if e.type == "transcript.text.delta"]
    assert len(deltas) == len(expected_words(data)) and events[-1].type == "transcript.text.done"
    assert "".join(d.delta for d in deltas) == events[-1].text == whole
    assert events[-1].usage.total_tokens == 2 * len(deltas)


def test_a_streamed_transcription_sends_each_piece_as_it_is_made(asr, asr_client):
    data = audio_file("WAV")
    words = expected_words(data)
    stream = asr_client.audio.transcriptions.create(model="asr", file=("a.wav", data), stream=True,
                                                    prompt="hold-asr")  # the stage waits after its first word
    events = iter(stream)
    first = next(events)  # all of the text there is while the rest is not made yet
    assert (first.type, first.delta) == ("transcript.text.delta", "hold-asr")
    (asr.hold / "hold-asr").touch()
    rest = list(events)
    assert [e.type for e in rest] == ["transcript.text.delta"] * len(words) + ["transcript.text.done"]
    assert "".join(e.delta for e in [first, *rest[:-1]]) == rest[-1].text == "hold-asr " + expected_text(data)


def test_a_streamed_transcription_as_text_over_plain_http(asr):
    data = audio_file("WAV")
    files = {"file": ("a.wav", data, "audio/wav")}
    fields = {"model": "asr", "stream": "true", "response_format": "text"}
    with httpx.stream("POST", f"{asr.url}/v1/audio/transcriptions", files=files, data=fields,
                      headers={"accept": "application/json"}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "transcript.text.done" and events[-1]["text"] == expected_text(data)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_a_transcription_with_curl(asr, tmp_path):
    path = tmp_path / "clip.wav"
    path.write_bytes(audio_file("WAV"))
    out = subprocess.run(["curl", "-sS", f"{asr.url}/v1/audio/transcriptions", "-F", f"file=@{path}",
                          "-F", "model=asr", "-F", "response_format=text"], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout == expected_text(path.read_bytes())


@pytest.mark.parametrize("name, data, param, words", [
    ("notes.txt", b"these are not audio bytes at all" * 10, "file", "not audio"),
    ("empty.wav", b"", "file", "empty"),
    ("long.wav", None, "file", "20 s"),
])
def test_bad_files_are_400s_after_one_post(asr_client, posts, name, data, param, words):
    if data is None:  # 25 s at 8 kHz: under the body limit, over max_audio_seconds
        data = audio_file("WAV", clip(25, 8000), 8000)
    with pytest.raises(openai.BadRequestError) as caught:
        asr_client.audio.transcriptions.create(model="asr", file=(name, data))
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and words in error["message"]
    assert posts == ["/v1/audio/transcriptions"]


def test_a_file_over_the_body_limit_is_a_413(asr_client, posts):
    with pytest.raises(openai.APIStatusError) as caught:
        asr_client.audio.transcriptions.create(model="asr", file=("big.wav", b"\0" * 1_500_000))
    assert caught.value.status_code == 413 and "serve.max_request_bytes" in caught.value.body["message"]
    assert caught.value.body["type"] == "invalid_request_error" and posts == ["/v1/audio/transcriptions"]


def test_wrong_fields_and_unsupported_options_are_refused(asr):
    url = f"{asr.url}/v1/audio/transcriptions"
    wav = audio_file("WAV")
    cases = [
        ({"audio": ("a.wav", wav)}, {"model": "asr"}, "audio"),  # the wrong field name
        ({}, {"model": "asr"}, "file"),
        ({"file": ("a.wav", wav)}, {}, "model"),
        ({"file": ("a.wav", wav)}, {"model": "asr", "response_format": "xml"}, "response_format"),
        ({"file": ("a.wav", wav)}, {"model": "asr", "include[]": "logprobs"}, "include[]"),
        ({"file": ("a.wav", wav)}, {"model": "asr", "timestamp_granularities[]": "word",
                                    "response_format": "verbose_json"}, "timestamp_granularities[]"),
        ({"file": ("a.wav", wav)}, {"model": "asr", "temperature": "0.5"}, "temperature"),
        ({"file": ("a.wav", wav)}, {"model": "asr", "stream": "true", "response_format": "srt"}, "stream"),
        ({"file": ("a.wav", wav)}, {"model": "asr", "stream": "yes"}, "stream"),
        ({}, {"model": "asr", "file": "not a file part"}, "file"),
        ({"file": ("a.wav", wav)}, {"model": "asr", "language": "en"} | {f"x{i}": "1" for i in range(40)}, None),
    ]
    for files, data, param in cases:  # every field a part of a multipart form
        parts = [*files.items(), *((name, (None, value)) for name, value in data.items())]
        openai_error(httpx.post(url, files=parts, timeout=30), 400, param)
    openai_error(httpx.post(url, files={"file": ("a.wav", wav), "model": (None, "whisper")}, timeout=30), 404,
                 "model")
    openai_error(httpx.post(url, json={"model": "asr"}, timeout=30), 400)


# -- speech ---------------------------------------------------------------------------------------


def expected_pcm(text: str, speed: float = 1.0) -> bytes:
    samples = np.concatenate(speak(text, 480, speed))
    return np.rint(np.clip(samples, -1, 1) * np.float32(32767)).astype("<i2").tobytes()


def test_speech_as_wav_and_pcm(tts_client, posts):
    wav = tts_client.audio.speech.create(model="tts", voice="0", input="hello", response_format="wav").content
    assert wav[:4] == b"RIFF" and wav[8:16] == b"WAVEfmt " and wav[36:40] == b"data"
    assert struct.unpack("<HHI", wav[20:28]) == (1, 1, RATE) and wav[44:] == expected_pcm("hello")
    pcm = tts_client.audio.speech.create(model="tts", voice="1", input="hello", response_format="pcm").content
    assert pcm == expected_pcm("hello") and posts == ["/v1/audio/speech"] * 2


def test_speech_speed_is_passed_on(tts_client):
    pcm = tts_client.audio.speech.create(model="tts", voice="0", input="hey", response_format="pcm", speed=2.0)
    assert pcm.content == expected_pcm("hey", 2.0) and len(pcm.content) == 3 * 240 * 2


def test_speech_streamed_as_it_is_made(tts_client):
    with tts_client.audio.speech.with_streaming_response.create(model="tts", voice="0", input="streaming speech",
                                                                response_format="pcm") as r:
        assert r.headers["content-type"] == "audio/pcm" and r.headers["x-sample-rate"] == "24000"
        data = b"".join(r.iter_bytes())
    assert data == expected_pcm("streaming speech")


@pytest.mark.parametrize("fmt, header", [("pcm", 0), ("wav", 44)])
def test_speech_bytes_leave_as_the_audio_is_made(tts, tts_client, fmt, header):
    text = f"hold-{fmt}"  # the stage waits after its first tone until the test creates this file
    tone = expected_pcm(text)[:480 * 2]
    with tts_client.audio.speech.with_streaming_response.create(model="tts", voice="0", input=text,
                                                                response_format=fmt) as r:
        chunks = r.iter_bytes()
        first = b""
        while len(first) < header + len(tone):  # all of it is there while the rest is not made yet
            first += next(chunks)
        assert first[header:] == tone
        (tts.hold / text).touch()
        data = first + b"".join(chunks)
    assert data[header:] == expected_pcm(text)


def test_eight_concurrent_speech_requests_each_get_their_own_audio(tts_client):
    from concurrent.futures import ThreadPoolExecutor

    texts = [f"voice number {i} says {'x' * i}" for i in range(8)]

    def one(text: str) -> bytes:
        return tts_client.audio.speech.create(model="tts", voice="1", input=text, response_format="pcm").content

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, texts)) == [expected_pcm(t) for t in texts]


def test_speech_as_server_sent_events(tts_client):
    with tts_client.audio.speech.with_streaming_response.create(model="tts", voice="0", input="abc",
                                                                response_format="pcm", stream_format="sse") as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta"] * 3 + ["speech.audio.done"]
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == expected_pcm("abc")
    assert events[-1]["usage"] == {"input_tokens": 3, "output_tokens": 3, "total_tokens": 6}


@pytest.fixture(scope="module")
def tts16k(tmp_path_factory):
    """The toy TTS speaking at 16 kHz (20 ms per character)."""
    config = tts_config(args={"samples_per_char": 320, "rate": 16000}, audio={"speed_key": "speed"}, sample_rate=16000)
    with serve(tmp_path_factory, "tts16k", config) as srv:
        yield srv


def dominant_hz(pcm: bytes, rate: int) -> float:
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
    return float(np.argmax(np.abs(np.fft.rfft(samples))) * rate / len(samples))


def test_speech_pcm_is_24khz_whatever_the_pipelines_rate(tts16k, posts):
    """OpenAI's pcm is 16-bit mono at 24 kHz: a 16 kHz pipeline's audio is resampled as it streams
    (the pieces joined, bytes or SSE deltas, equal the whole resampled at once within 2 LSB), the WAV keeps the pipeline's rate."""
    import soxr

    text = "resample me"
    native = np.concatenate(speak(text, 320, rate=16000))
    native_pcm = np.rint(np.clip(native, -1, 1) * np.float32(32767)).astype("<i2")
    whole = soxr.resample(native_pcm, 16000, 24000)
    with sdk(tts16k, posts) as client:
        with client.audio.speech.with_streaming_response.create(model="tts", voice="0", input=text,
                                                                response_format="pcm") as r:
            assert r.headers["x-sample-rate"] == "24000"
            pcm = b"".join(r.iter_bytes())
        with client.audio.speech.with_streaming_response.create(model="tts", voice="0", input=text,
                                                                response_format="pcm", stream_format="sse") as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        wav = client.audio.speech.create(model="tts", voice="0", input=text, response_format="wav").content
    got = np.frombuffer(pcm, dtype="<i2")
    assert len(got) == len(native_pcm) * 3 // 2 == len(whole)  # 1.5 times the samples: 24 kHz
    assert np.abs(got.astype(np.int32) - whole.astype(np.int32)).max() <= 2
    # each character's tone keeps its pitch at the new rate (200 + 10 * (ord(c) % 64) Hz, 30 samples a tone)
    first = pcm[: 480 * 2]
    assert abs(dominant_hz(first, 24000) - (200 + 10 * (ord("r") % 64))) <= 50
    assert events[-1]["type"] == "speech.audio.done"
    # the SSE deltas: the same audio, within the same bound (how the pipeline's chunks are grouped
    # as they reach the resampler depends on timing, and soxr's last bit on the grouping)
    deltas = np.frombuffer(b"".join(base64.b64decode(e["audio"]) for e in events[:-1]), dtype="<i2")
    assert len(deltas) == len(whole) and np.abs(deltas.astype(np.int32) - whole.astype(np.int32)).max() <= 2
    assert struct.unpack("<HHI", wav[20:28]) == (1, 1, 16000) and wav[44:] == native_pcm.tobytes()


def test_speech_as_flac_decodes_to_the_same_samples(tts_client):
    flac = tts_client.audio.speech.create(model="tts", voice="0", input="flac", response_format="flac").content
    samples, rate = soundfile.read(io.BytesIO(flac), dtype="int16")
    assert rate == RATE and samples.astype("<i2").tobytes() == expected_pcm("flac")


def test_bad_speech_requests_are_refused_after_one_post(tts, tts_client, posts):
    cases = [
        (dict(voice="0", input="hi", response_format="aac"), "response_format", "wav"),
        (dict(voice="7", input="hi"), "voice", "0, 1"),
        (dict(voice="0", input="hi", speed=9.0), "speed", "0.25"),
        (dict(voice="0", input="hi", instructions="whisper it"), "instructions", "instructions"),
        (dict(voice="0", input=""), "input", "input"),
        (dict(voice="0", input="fail"), "input", "cannot be spoken"),
    ]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            tts_client.audio.speech.create(model="tts", **kwargs)
        assert caught.value.body["param"] == param and words in caught.value.body["message"], caught.value.body
    assert posts == ["/v1/audio/speech"] * len(cases)
    with pytest.raises(openai.NotFoundError):
        tts_client.audio.speech.create(model="csm", voice="0", input="hi")
    openai_error(httpx.post(f"{tts.url}/v1/audio/speech", json={"model": "tts", "input": "x", "voice": "0",
                                                                "pitch": 3}, timeout=30), 400, "pitch")
    openai_error(httpx.post(f"{tts.url}/v1/audio/speech", content=b"{not json", timeout=30), 400)


# -- the docs' examples -----------------------------------------------------------------------------

DOCS = HERE.parents[1] / "docs" / "serving.md"


def docs_examples(lang: str) -> list[str]:
    text = DOCS.read_text()
    section = text[text.index("\n## Speech in and out"):]
    section = section[: section.index("\n## ", 1)]
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def test_the_docs_examples_run_as_written(asr, tts, tmp_path):
    transcribe_script, speak_script = docs_examples("python")
    data = audio_file("WAV")
    (tmp_path / "clip.wav").write_bytes(data)
    for name, script, server in (("t.py", transcribe_script, asr), ("s.py", speak_script, tts)):
        (tmp_path / name).write_text(script)
        out = subprocess.run([sys.executable, name], cwd=tmp_path, env={**os.environ, "OMNI_URL": server.url},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        server.printed = out.stdout
    text = expected_text(data)
    words = len(expected_words(data))
    lines = asr.printed.splitlines()
    assert lines[:3] == [text, text, f"[{2 * words} tokens]"]
    assert lines[3:6] == ["1", "00:00:00,000 --> 00:00:00,100", text.split()[0]] and len(lines) == 3 + 5 * words
    assert lines[3 + 4 * words:] == [f"{s:.2f}-{e:.2f} s: {w}" for s, e, w in expected_words(data)]  # verbose_json
    assert tts.printed == f"hello.wav written; {len(expected_pcm('hello omni')) // 2} samples streamed\n"
    assert (tmp_path / "hello.wav").read_bytes()[44:] == expected_pcm("hello omni")
    (tmp_path / "hello.wav").unlink()
    transcribe_curl, speak_curl = docs_examples("bash")
    for command, server in ((transcribe_curl, asr), (speak_curl, tts)):
        command = command.replace("http://127.0.0.1:8000", server.url).replace("\\\n", " ")
        out = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        server.printed = out.stdout
    assert asr.printed == text
    assert (tmp_path / "hello.wav").read_bytes()[44:] == expected_pcm("hello omni")


def test_bad_audio_options_are_refused_naming_them():
    from omni_contrib_stages.openai_audio import audio_options

    assert audio_options(None)["audio_key"] == "audio"
    with pytest.raises(ValueError) as caught:
        audio_options({"bogus": 1, "max_audio_seconds": -3})
    assert "serve.options.openai.audio.bogus: unknown option" in str(caught.value)
    assert "serve.options.openai.audio.max_audio_seconds: expected a positive number" in str(caught.value)


# -- requests as the server counts and guards them ------------------------------------------------


def metric(srv, name: str, **labels: str) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def wait_metric(srv, name: str, value: float, timeout: float = 30, **labels: str) -> None:
    deadline = time.monotonic() + timeout
    while (got := metric(srv, name, **labels)) != value:
        assert time.monotonic() < deadline, f"{name}{labels} stayed {got}, expected {value}"
        time.sleep(0.05)


def test_a_client_leaving_mid_speech_aborts_its_request(tts, tts_client):
    wait_metric(tts, "omni_requests_in_flight", 0)
    aborted = metric(tts, "omni_requests_total", status="aborted")
    with tts_client.audio.speech.with_streaming_response.create(model="tts", voice="0", input="hold-forever",
                                                                response_format="pcm") as r:
        chunks = r.iter_bytes()
        assert next(chunks)  # the first tone; the stage now waits for a file that never comes
        assert metric(tts, "omni_requests_in_flight") == 1
        chunks.close()
    wait_metric(tts, "omni_requests_in_flight", 0)
    wait_metric(tts, "omni_requests_total", aborted + 1, status="aborted")
    ok = metric(tts, "omni_requests_total", status="ok")
    assert tts_client.audio.speech.create(model="tts", voice="0", input="ok", response_format="pcm").content
    wait_metric(tts, "omni_requests_total", ok + 1, status="ok")


def test_the_audio_routes_need_the_api_key(tmp_path_factory):
    with serve(tmp_path_factory, "keyed", asr_config("keyed", **ASR_OPTIONS), None, "--api-key", "sesame") as srv:
        data = audio_file("WAV")
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0, timeout=60) as c, \
                pytest.raises(openai.AuthenticationError):
            c.audio.transcriptions.create(model="keyed", file=("a.wav", data))
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sesame", max_retries=0, timeout=60) as c:
            assert c.audio.transcriptions.create(model="keyed", file=("a.wav", data)).text == expected_text(data)

"""The whisper family: its tiny checkpoint, and ``omni serve`` on that checkpoint folder answering OpenAI's
``POST /v1/audio/transcriptions`` through the official SDK with the tokens and text of transformers'
``model.generate`` on the processor's features of the same file; every response format (verbose_json, srt and vtt
with the stage's timestamped segments); streamed deltas that join
to the text; 16 concurrent uploads each equal to its lone result; bad uploads refused with OpenAI's error shape."""

from __future__ import annotations

import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import soundfile
import torch
from speech_serving import sdk, serving

pytestmark = pytest.mark.timeout(600)

RATE = 16000


@pytest.fixture(scope="module")
def whisper_tiny(tmp_path_factory):
    from omni_transformers.whisper.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("whisper") / "ckpt")


@pytest.fixture(scope="module")
def reference(whisper_tiny):
    """``reference(wav_bytes, **generate_kwargs)`` → (token ids, text) of ``model.generate`` in this process on the
    processor's features of the file."""
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    processor = WhisperProcessor.from_pretrained(whisper_tiny)
    model = WhisperForConditionalGeneration.from_pretrained(whisper_tiny).eval()

    def run(data: bytes, **kwargs) -> tuple[list[int], str]:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
        assert rate == RATE
        features = processor(samples, sampling_rate=RATE, return_tensors="pt").input_features
        if "prompt" in kwargs:
            kwargs["prompt_ids"] = processor.get_prompt_ids(kwargs.pop("prompt"), return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(features, task="transcribe", **kwargs)[0].tolist()
        eos = model.generation_config.eos_token_id
        tokens = out[:out.index(eos)] if eos in out else out
        return tokens, processor.decode(tokens, skip_special_tokens=True)

    return run


def clip(seconds: float, seed: int) -> bytes:
    """A 16 kHz WAV of noise and a tone (seeded): the tiny model's text differs from clip to clip."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    samples = 0.3 * np.sin(2 * np.pi * (200 + 40 * seed) * t) + 0.05 * rng.standard_normal(t.size)
    out = io.BytesIO()
    soundfile.write(out, samples.astype(np.float32), RATE, format="WAV", subtype="PCM_16")
    return out.getvalue()


@pytest.fixture(scope="module")
def server(whisper_tiny, tmp_path_factory):
    with serving(str(whisper_tiny), cwd=tmp_path_factory.mktemp("serve-whisper")) as srv:
        yield srv


@pytest.fixture
def client(server):
    with sdk(server) as c:
        yield c


def native(server, data: bytes, **inputs) -> dict:
    """The pipeline's own result for the file (the core route, no OpenAI adapter)."""
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    from omni_core.encoding import from_jsonable, to_jsonable

    body = {"input": to_jsonable({"audio": torch.from_numpy(samples), "sample_rate": rate, **inputs})}
    r = httpx.post(f"{server.url}/v1/pipelines/whisper/requests", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return from_jsonable(r.json()["result"], "result")


def test_the_tiny_checkpoint_has_the_real_layout_and_stops(whisper_tiny):
    names = {p.name for p in whisper_tiny.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert "preprocessor_config.json" in names or "processor_config.json" in names
    gen = json.loads((whisper_tiny / "generation_config.json").read_text())
    assert gen["return_timestamps"] is False and gen["max_new_tokens"] > 0
    from transformers import WhisperTokenizer

    tok = WhisperTokenizer.from_pretrained(whisper_tiny)
    for special in ("<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>", "<|0.00|>"):
        assert len(tok(special, add_special_tokens=False).input_ids) == 1, special


def test_the_transformers_internals_the_decode_loop_drives_are_there(whisper_tiny):
    """whisper/loop.py drives the decoder's layers with a cache WhisperAttention reads as an EncoderDecoderCache:
    a transformers release that reads other names fails here, naming what moved."""
    import inspect

    from transformers import WhisperForConditionalGeneration
    from transformers.models.whisper import modeling_whisper

    source = inspect.getsource(modeling_whisper.WhisperAttention.forward)
    for name in ("isinstance(cache, EncoderDecoderCache)", "cache.is_updated", "cache.cross_attention_cache",
                 "cache.self_attention_cache", "cache.layers[self.layer_idx].keys", "cache.update("):
        assert name in source, f"transformers' WhisperAttention.forward no longer has {name!r}: see whisper/loop.py"
    decoder = WhisperForConditionalGeneration.from_pretrained(whisper_tiny).model.decoder
    assert isinstance(decoder.embed_positions.weight, torch.Tensor) and decoder.layer_norm is not None
    layer = inspect.signature(type(decoder.layers[0]).forward).parameters
    assert {"encoder_hidden_states", "cache", "attention_mask"} <= set(layer), "WhisperDecoderLayer.forward changed"


def test_the_server_is_the_checkpoints_family_pipeline(client):
    assert [m.id for m in client.models.list().data] == ["whisper"]


def test_a_transcription_equals_generate_in_every_format(client, server, reference):
    data = clip(2.0, 1)
    tokens, text = reference(data)
    assert text
    result = native(server, data)
    assert result["token_ids"] == tokens and result["text"] == text
    answer = client.audio.transcriptions.create(model="whisper", file=("a.wav", data, "audio/wav"))
    assert answer.text == text
    assert answer.usage.type == "duration" and answer.usage.seconds == 2
    plain = client.audio.transcriptions.create(model="whisper", file=("a.wav", data), response_format="text")
    assert plain == text


def test_verbose_json_srt_and_vtt_carry_the_stages_segments(client, server, reference):
    """verbose_json, srt and vtt ask the stage for timestamps (``audio.timestamps_key``): the text is that of
    ``generate(return_timestamps=True)`` and the segments are the stage's own, not one of the whole file."""
    data = clip(2.0, 2)  # the tiny model makes three segments of this clip
    tokens, text = reference(data, return_timestamps=True)
    result = native(server, data, timestamps=True)
    assert result["token_ids"] == tokens and result["text"] == text
    segments = result["segments"]
    assert len(segments) > 1
    verbose = client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                                 response_format="verbose_json",
                                                 timestamp_granularities=["segment"])
    assert verbose.text == text and verbose.language == result["language"] and verbose.duration == 2.0
    assert [(s.id, s.start, s.end, s.text) for s in verbose.segments] == [
        (i, s["start"], s["end"], s["text"]) for i, s in enumerate(segments)]

    def clock(seconds: float, sep: str) -> str:
        ms = round(seconds * 1000)
        return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"

    srt = client.audio.transcriptions.create(model="whisper", file=("a.wav", data), response_format="srt")
    assert srt == "".join(f"{i}\n{clock(s['start'], ',')} --> {clock(s['end'], ',')}\n{s['text'].strip()}\n\n"
                          for i, s in enumerate(segments, 1))
    vtt = client.audio.transcriptions.create(model="whisper", file=("a.wav", data), response_format="vtt")
    assert vtt == "WEBVTT\n\n" + "".join(f"{clock(s['start'], '.')} --> {clock(s['end'], '.')}\n{s['text'].strip()}\n\n"
                                         for s in segments)
    assert client.audio.transcriptions.create(model="whisper", file=("a.wav", data)).text == reference(data)[1]


def test_language_and_prompt_go_to_generate(client, reference):
    data = clip(1.5, 2)
    for kwargs in ({"language": "fr"}, {"language": "en", "prompt": "a b c"}):
        _, text = reference(data, **kwargs)
        answer = client.audio.transcriptions.create(model="whisper", file=("a.wav", data), **kwargs)
        assert answer.text == text, kwargs
    assert reference(data, language="fr")[1] != reference(data, language="en")[1]


def test_timestamps_are_generates_and_make_the_segments(server, reference, whisper_tiny):
    from transformers import WhisperTokenizer

    tokenizer = WhisperTokenizer.from_pretrained(whisper_tiny)
    for seed in (1, 2):
        data = clip(2.0, seed)
        tokens, text = reference(data, language="en", return_timestamps=True)
        result = native(server, data, language="en", timestamps=True)
        assert result["token_ids"] == tokens and result["text"] == text
        offsets = tokenizer.decode(tokens, output_offsets=True)["offsets"]
        assert result["segments"] == [{"start": o["timestamp"][0], "end": o["timestamp"][1], "text": o["text"]}
                                      for o in offsets if o["timestamp"][1] is not None]
    assert any(t > tokenizer.convert_tokens_to_ids("<|notimestamps|>") for t in tokens)  # timestamps were made


def test_streamed_deltas_join_to_the_text(client, reference):
    data = clip(3.0, 3)
    _, text = reference(data)
    events = list(client.audio.transcriptions.create(model="whisper", file=("a.wav", data), stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert len(deltas) > 1 and events[-1].type == "transcript.text.done"
    assert "".join(deltas) == events[-1].text == text


def test_16_concurrent_uploads_each_equal_its_lone_result_and_generate(client, reference):
    files = [clip(1.0 + (i % 5) * 0.5, 10 + i) for i in range(16)]
    expected = [reference(f)[1] for f in files]
    assert len(set(expected)) > 4  # the clips' texts differ: a mix-up would show

    def one(data: bytes) -> str:
        return client.audio.transcriptions.create(model="whisper", file=("a.wav", data)).text

    start = time.monotonic()
    alone = [one(f) for f in files]
    sequential = time.monotonic() - start
    start = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(one, files))
    concurrent = time.monotonic() - start
    print(f"16 transcriptions: one after another {sequential:.2f} s, 16 at once {concurrent:.2f} s "
          f"({sequential / concurrent:.2f}x)")
    assert together == alone == expected


def test_a_sampled_request_draws_the_same_beside_greedy_ones(client, reference):
    data = clip(2.0, 4)

    def one(temperature: float) -> str:
        return client.audio.transcriptions.create(model="whisper", file=("a.wav", data), temperature=temperature).text

    sampled, greedy = one(0.9), one(0.0)
    assert greedy == reference(data)[1] and sampled != greedy
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(one, [0.9, 0.0, 0.9, 0.0]))
    assert together == [sampled, greedy, sampled, greedy]


@pytest.mark.parametrize(("what", "files", "fields", "status", "param", "says"), [
    ("not audio", {"file": ("a.wav", b"hello, not audio", "audio/wav")}, {}, 400, "file", "not audio"),
    ("empty", {"file": ("a.wav", b"", "audio/wav")}, {}, 400, "file", "empty"),
    ("too long", {"file": ("a.wav", clip(31.0, 0), "audio/wav")}, {}, 400, "file", "30 s"),
    ("wrong field", {"audio": ("a.wav", clip(1.0, 0), "audio/wav")}, {}, 400, "audio", "unknown field"),
    ("bad language", {"file": ("a.wav", clip(1.0, 0), "audio/wav")}, {"language": "xx"}, 400, "language", "'xx'"),
    ("bad format", {"file": ("a.wav", clip(1.0, 0), "audio/wav")}, {"response_format": "mp4"}, 400,
     "response_format", "mp4"),
])
def test_bad_uploads_are_refused_with_the_openai_error_shape(server, what, files, fields, status, param, says):
    r = httpx.post(f"{server.url}/v1/audio/transcriptions", data={"model": "whisper", **fields}, files=files,
                   timeout=120)
    assert r.status_code == status, (what, r.text)
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], (what, error)
    assert error["type"] == "invalid_request_error"


def test_a_huge_form_is_refused(server):
    r = httpx.post(f"{server.url}/v1/audio/transcriptions", data={"model": "whisper"},
                   files={"file": ("a.wav", b"\0" * (200 * 1024 * 1024), "audio/wav")}, timeout=120)
    assert r.status_code == 413, r.text
    assert "error" in r.json()


def test_omni_run_on_the_checkpoint_streams_the_text(whisper_tiny, reference, tmp_path):
    import subprocess
    import sys

    data = clip(1.0, 5)
    wav = tmp_path / "a.wav"
    wav.write_bytes(data)
    out = subprocess.run([sys.executable, "-c", "from omni_core.cli import main; main()", "run", str(whisper_tiny),
                          "--input", json.dumps({"audio": str(wav), "language": "en"}), "--stream"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    pieces = "".join(line["chunk"]["text"] for line in lines if "chunk" in line)
    result = lines[-1]["result"]
    assert pieces == result["text"] == reference(data, language="en")[1]
    assert result["language"] == "english"

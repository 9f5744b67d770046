"""``omni run qwen2_5_omni --stream`` through the real console script, the checkpoint from
``OMNI_TRANSFORMERS_MODEL``: text chunks as JSON lines, then the audio, and a WAV file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import wave

import pytest
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("no_leaks")]


def test_omni_run_stream_prints_text_then_audio_and_writes_a_wav(tiny_model, tmp_path):
    omni = shutil.which("omni")
    assert omni, "the omni console script is not installed"
    env = {**os.environ, "OMNI_TRANSFORMERS_MODEL": str(tiny_model)}
    inputs = {"text": "hello", "max_new_tokens": 6, "talker_max_new_tokens": 24, "wav_path": "qwen2_5_omni.wav"}
    out = subprocess.run([omni, "run", "qwen2_5_omni", "--input", json.dumps(inputs), "--stream"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"stage"')]
    chunks = [line["chunk"] for line in lines]
    # the text from the thinker (stream_to caller), the audio from token2wav
    assert all(line["stage"] == ("thinker" if "text" in line["chunk"] else "token2wav") for line in lines)
    texts = [c for c in chunks if "text" in c]
    assert sum(len(c["token_ids"]) for c in texts) == 6
    assert "audio" in chunks[-1] and chunks[-1]["sample_rate"] == 24000
    # Tensors print as their dtype and shape (--tensor-data: whole, as omni serve sends them).
    audio = [c["audio"]["tensor"] for c in chunks if "audio" in c]  # streamed: several chunks
    assert all(a["dtype"] == "float32" and len(a["shape"]) == 1 for a in audio)
    wav_path = tmp_path / "qwen2_5_omni.wav"
    with wave.open(str(wav_path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() == sum(a["shape"][0] for a in audio) > 0

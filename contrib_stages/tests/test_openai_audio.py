"""The ``openai`` adapter's audio: float samples (torch, numpy, lists; float32, bfloat16, float16,
float64) to little-endian PCM16 (clipped, scaled by 32767, rounded half to even), int16 and bytes
as they are, empty chunks, and what is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omni_contrib_stages.api_common import pcm16, wav_bytes
from omni_contrib_stages.openai_api import DEFAULTS, adapter_options, parse_request

from omni_core import load_config


def reference(samples: torch.Tensor) -> bytes:
    """How omni-transformers quantises its waveform for its WAV files."""
    return (
        (samples.float().clamp(-1, 1) * 32767)
        .round()
        .to(torch.int16)
        .numpy()
        .astype("<i2")
        .tobytes()
    )


def as_ints(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i2").tolist()


def test_float_samples_are_clipped_scaled_and_rounded():
    samples = [
        0.0,
        1.0,
        -1.0,
        1.5,
        -7.0,
        0.5,
        -0.5,
        1 / 32767,
        0.5 / 32767,
        1.5 / 32767,
        float("inf"),
        float("-inf"),
        float("nan"),
    ]
    assert as_ints(pcm16(samples)) == [
        0,
        32767,
        -32767,
        32767,
        -32767,
        16384,
        -16384,
        1,
        0,
        2,
        32767,
        -32767,
        0,
    ]
    # never -32768: the scale is symmetric
    assert min(as_ints(pcm16(torch.full((4,), -2.0)))) == -32767


def test_random_float32_equals_the_torch_quantisation_exactly():
    g = torch.Generator().manual_seed(0)
    samples = (torch.rand(50_000, generator=g) * 3 - 1.5).float()
    assert pcm16(samples) == reference(samples)
    assert pcm16(samples.numpy()) == reference(samples)
    assert pcm16(samples.tolist()) == reference(samples)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str
)
def test_every_float_dtype(dtype):
    g = torch.Generator().manual_seed(1)
    samples = (torch.rand(4096, generator=g) * 2.4 - 1.2).to(dtype)
    out = pcm16(samples)
    assert len(out) == 2 * 4096
    if dtype is torch.float64:  # computed in float64: equal to the float64 quantisation
        want = (
            (samples.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().astype("<i2").tobytes()
        )
    else:  # widened to float32 exactly first
        want = reference(samples)
    assert out == want
    if dtype is not torch.bfloat16:  # numpy has no bfloat16
        assert pcm16(samples.numpy()) == want


def test_the_bytes_are_little_endian():
    assert pcm16([1.0, -1.0]) == b"\xff\x7f\x01\x80"
    assert pcm16(np.array([258], dtype=">i2")) == b"\x02\x01"
    assert pcm16(np.array([0.5, -1.0], dtype=">f4")) == pcm16([0.5, -1.0]) == b"\x00\x40\x01\x80"


def test_empty_chunks_are_empty_pcm():
    for empty in (
        torch.zeros(0),
        torch.zeros(0, dtype=torch.bfloat16),
        np.zeros(0, np.float32),
        [],
        b"",
    ):
        assert pcm16(empty) == b""
    assert wav_bytes(pcm16([]), 24000)[:4] == b"RIFF"


def test_int16_and_bytes_pass_through_and_mono_shapes_are_flattened():
    ints = torch.tensor([-32768, -1, 0, 1, 32767], dtype=torch.int16)
    assert pcm16(ints) == ints.numpy().tobytes() and pcm16(ints.numpy()) == pcm16(ints)
    assert (
        pcm16(b"\x01\x02\x03\x04") == b"\x01\x02\x03\x04"
        and pcm16(bytearray(b"\x00\x00")) == b"\x00\x00"
    )
    assert pcm16(memoryview(b"\x05\x06")) == b"\x05\x06"
    assert (
        pcm16(torch.tensor([[0.5, -0.5]]))
        == pcm16(torch.tensor([[0.5], [-0.5]]))
        == pcm16([0.5, -0.5])
    )
    # a tensor that needs grad, or a non-contiguous view
    assert pcm16(torch.tensor([0.25, 0.5], requires_grad=True)) == pcm16([0.25, 0.5])
    assert pcm16(torch.tensor([0.25, 9.0, 0.5])[::2]) == pcm16([0.25, 0.5])


def test_what_is_not_audio_or_not_mono():
    for value in ("text", None, {"a": 1}, 3.0):
        assert pcm16(value) is None
    with pytest.raises(ValueError, match="even number of bytes"):
        pcm16(b"\x00")
    with pytest.raises(ValueError, match=r"mono .*\[2, 3\]"):
        pcm16(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="int32"):
        pcm16(np.zeros(3, np.int32))


def test_voice_key_and_the_sample_rate_field_are_adapter_options():
    cfg = load_config("demo")
    assert DEFAULTS["voice_key"] is None and DEFAULTS["sample_rate_field"] == "sample_rate"
    opts = adapter_options(
        {**cfg.serve.options["openai"], "voice_key": "speaker", "voices": ["Chelsie"]}, cfg
    )
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "hi"}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "Chelsie", "format": "wav"},
    }
    assert parse_request(body, "demo", opts)["inputs"]["speaker"] == "Chelsie"
    text_only = parse_request(
        {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}, "demo", opts
    )
    assert "speaker" not in text_only["inputs"]


def test_the_new_options_are_checked():
    cfg = load_config("demo")
    for bad, match in (
        ({"sample_rate": 0}, "sample_rate"),
        ({"sample_rate": "24k"}, "sample_rate"),
        ({"voice_key": 3}, "voice_key"),
        ({"voices": "Chelsie"}, "voices"),
    ):
        with pytest.raises(ValueError, match=match):
            adapter_options(bad, cfg)

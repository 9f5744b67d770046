"""The client's audio: base64 PCM16 at 24 kHz in, resampled floats for the pipeline and the VAD
(:func:`~omni_contrib_stages.api_common.resample`, as ``POST /v1/audio/transcriptions`` resamples
an upload), PCM16 at 24 kHz out."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import numpy as np

# the one resampler (soxr): a turn reaches a pipeline as the same audio uploaded as a file does
from ..api_common import resample  # noqa: F401 - re-exported
from .protocol import ClientError

#: The client's audio, both ways: PCM16, mono, little-endian, 24 kHz (OpenAI's ``audio/pcm``).
RATE = 24000
#: The shortest buffer a commit accepts (OpenAI's rule).
MIN_COMMIT_MS = 100


def decode_audio(data: Any, param: str) -> bytes:
    """Base64 PCM16 from the client; a ClientError naming what is wrong."""
    if not isinstance(data, str):
        raise ClientError(f"{param} must be base64-encoded PCM16 audio (a string), got {type(data).__name__}",
                          "invalid_value", param)
    try:
        pcm = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ClientError(f"{param} is not valid base64", "invalid_value", param) from None
    if len(pcm) % 2:
        raise ClientError(f"{param}: PCM16 audio needs an even number of bytes, got {len(pcm)}; send 16-bit "
                          f"little-endian mono samples at {RATE} Hz", "invalid_audio_format", param)
    return pcm


def to_float(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0


def to_pcm16(samples: np.ndarray) -> bytes:
    return np.rint(np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def ms_of(pcm_bytes: int) -> int:
    return pcm_bytes * 1000 // (2 * RATE)


def audio_format(value: Any, param: str) -> dict[str, Any]:
    """A session's audio format: PCM16 at 24 kHz is the only one."""
    if not isinstance(value, Mapping) or value.get("type") != "audio/pcm" or value.get("rate", RATE) != RATE:
        raise ClientError(f"{param}: this server speaks PCM16 at {RATE} Hz only "
                          f'({{"type": "audio/pcm", "rate": {RATE}}}), got {value!r}', "unsupported_audio_format",
                          param)
    return {"type": "audio/pcm", "rate": RATE}

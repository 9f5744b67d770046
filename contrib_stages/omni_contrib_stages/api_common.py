"""What the ``openai`` and ``realtime`` APIs of ``omni serve`` share: the adapter option keys they
both take, the checks of those options against the pipeline, the readers of a stage's stream
chunks (text, audio, sample rate), the usage and finish reason of a result, audio as PCM16, and
the one resampler (soxr) of audio both ways: :func:`resample` whole, :class:`Resampler` as a stream.

Both APIs read a pipeline the same way, so a pipeline set up for one serves the other; this module
is that one way. It imports nothing heavy (numpy and soxr only inside the audio functions).
"""

from __future__ import annotations

import io
import wave
from collections.abc import Mapping
from typing import Any

from .plugin import REALTIME_SHARED

#: The adapter option keys both APIs take (``serve.options.realtime`` defaults them to
#: ``serve.options.openai``'s): the schema of each is in :mod:`omni_contrib_stages.plugin`.
SHARED_OPTIONS: tuple[str, ...] = REALTIME_SHARED

#: The finish reasons a result may give (anything else reads as ``"stop"``).
FINISH_REASONS = ("stop", "length")


def check_stages(opts: dict[str, Any], pipeline_config: Any, where: str) -> None:
    """Default ``text_stage`` to the pipeline's first terminal stage and check that every stage
    option names a stage of the pipeline (a ValueError naming ``where.key``)."""
    if opts["text_stage"] is None:
        opts["text_stage"] = list(pipeline_config.terminal_stages)[0]
    for key in ("text_stage", "text_only_stage", "audio_stage"):
        if opts[key] is not None and opts[key] not in pipeline_config.stage_names:
            raise ValueError(f"{where}.{key}: no stage {opts[key]!r} in pipeline {pipeline_config.name!r} "
                             f"(stages: {', '.join(pipeline_config.stage_names)})")


def text_stage_for(opts: Mapping[str, Any], want_audio: bool) -> str:
    """The stage whose chunks carry the answer's text: ``text_only_stage`` (when set) for a text-only
    answer, else ``text_stage``."""
    return opts["text_stage"] if want_audio else (opts.get("text_only_stage") or opts["text_stage"])


# -- chunk readers ----------------------------------------------------------------------------------------


def text_of(chunk: Any, opts: Mapping[str, Any]) -> str | None:
    """One piece of text: ``chunk[text_field]`` of a mapping, or the chunk itself when it is a string."""
    value = chunk.get(opts["text_field"]) if isinstance(chunk, Mapping) else chunk
    return value if isinstance(value, str) else None


def audio_of(chunk: Any, opts: Mapping[str, Any]) -> bytes | None:
    """A chunk's audio (``chunk[audio_field]``) as PCM16 bytes; None when it carries none."""
    if isinstance(chunk, Mapping) and opts["audio_field"] in chunk:
        return pcm16(chunk[opts["audio_field"]])
    return None


def rate_of(chunk: Any, opts: Mapping[str, Any]) -> int:
    """The sample rate of a chunk's audio: ``chunk[sample_rate_field]`` when it is a positive int,
    else the ``sample_rate`` option."""
    field = opts["sample_rate_field"]
    rate = chunk.get(field) if isinstance(chunk, Mapping) and field else None
    return int(rate) if isinstance(rate, int) and not isinstance(rate, bool) and rate > 0 else opts["sample_rate"]


# -- results ----------------------------------------------------------------------------------------------


def stage_part(result: Any, stage: str) -> Any:
    """``stage``'s part of a pipeline result: ``result[stage]`` when the result is keyed by
    terminal stage (several terminals), else the result itself (one terminal). A one-stage result
    may have a field named like its stage (Qwen's text stage has ``text``): only a mapping under
    that key is taken for the stage's part."""
    if isinstance(result, Mapping) and isinstance(result.get(stage), Mapping):
        return result[stage]
    return result


def final_text(result: Any, opts: Mapping[str, Any], pieces: list[str], stage: str) -> str:
    """The whole text of an answer: the result's ``result_text_field``, else its pieces joined."""
    part = stage_part(result, stage)
    if isinstance(part, Mapping) and isinstance(part.get(opts["result_text_field"]), str):
        return part[opts["result_text_field"]]
    return opts["text_joiner"].join(pieces)


def usage_of(result: Any, opts: Mapping[str, Any], stage: str) -> tuple[dict[str, int] | None, str]:
    """``(usage, finish_reason)`` from ``stage``'s part of the result (the result itself with one
    terminal stage): usage None unless both counts are non-negative ints; finish_reason
    ``"stop"`` unless the result says ``"length"``."""
    part = stage_part(result, stage)
    if not isinstance(part, Mapping):
        return None, "stop"
    finish = part.get(opts["finish_reason_field"])
    finish = finish if finish in FINISH_REASONS else "stop"
    counts = (part.get(opts["prompt_tokens_field"]), part.get(opts["completion_tokens_field"]))
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        return None, finish
    return {"prompt_tokens": counts[0], "completion_tokens": counts[1], "total_tokens": sum(counts)}, finish


# -- audio ------------------------------------------------------------------------------------------------


def pcm16(audio: Any) -> bytes | None:
    """Mono audio as little-endian 16-bit PCM bytes; None when ``audio`` is not audio (a string,
    a mapping, None ...).

    - bytes, bytearray, memoryview: PCM16 already, returned as bytes (an odd length is an error);
    - a torch tensor or numpy array, 1-D (or ``[1, N]`` / ``[N, 1]``): int16 as is; any float dtype
      (bfloat16 and float16 widened to float32, exactly): NaN → 0, clipped to [-1, 1], × 32767,
      rounded half to even, in float32 (float64 stays float64);
    - a list or tuple: float samples, as a float32 array.
    """
    import numpy as np

    if isinstance(audio, (bytes, bytearray, memoryview)):
        data = bytes(audio)
        if len(data) % 2:
            raise ValueError(f"PCM16 audio needs an even number of bytes, got {len(data)}")
        return data
    if hasattr(audio, "detach") and hasattr(audio, "is_floating_point"):  # a torch tensor
        tensor = audio.detach().cpu()
        array = (tensor.float() if tensor.is_floating_point() else tensor).numpy()
    elif isinstance(audio, np.ndarray):
        array = audio
    elif isinstance(audio, (list, tuple)):
        array = np.asarray(audio, dtype=np.float32)
    else:
        return None
    if array.ndim != 1:
        if array.ndim == 2 and 1 in array.shape:
            array = array.reshape(-1)
        else:
            raise ValueError(f"audio must be mono (1-D samples), got shape {list(array.shape)}")
    if array.dtype.kind == "i" and array.dtype.itemsize == 2:  # int16, either byte order
        return array.astype("<i2", copy=False).tobytes()
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"audio samples must be float in [-1, 1] or int16, got {array.dtype}")
    if array.dtype.itemsize < 4:
        array = array.astype(np.float32)
    array = np.clip(np.nan_to_num(array, nan=0.0), -1.0, 1.0) * array.dtype.type(32767)
    return np.rint(array).astype("<i2").tobytes()


def resample(samples: Any, src: int, dst: int) -> Any:
    """Float samples (1-D) from ``src`` Hz to ``dst`` Hz, whole, with soxr (its default, high
    quality): the one resampler of audio going to a pipeline, whichever way it came (an uploaded
    file, a realtime session's turn), and the one the transformers stages use, so the same audio
    reaches a stage as the same samples. float32 out; at the same rate the samples as they are."""
    import numpy as np

    x = np.ascontiguousarray(samples, dtype=np.float32)
    if src == dst or x.size == 0:
        return x
    import soxr

    return soxr.resample(x, src, dst).astype(np.float32, copy=False)


class Resampler:
    """PCM16 chunks at a pipeline's rate in, PCM16 at ``rate`` out, as a stream: soxr's
    ``ResampleStream`` keeps its filter state from chunk to chunk, so the pieces joined are the
    whole resampled at once (within a least significant bit or two), with no click at chunk edges.
    At the target rate already, chunks pass through untouched. The output comes in the resampler's
    blocks (734 samples at 24 kHz from 16 kHz, about 30 ms), so it trails the input by up to a
    block (a push may give nothing); :meth:`flush` gives what the filter still holds, once the
    last chunk is in. Used for OpenAI's 24 kHz speech (``/v1/audio/speech`` pcm and sse) and a
    realtime session's audio deltas."""

    def __init__(self, rate: int):
        self.rate = rate
        self._source: int | None = None
        self._stream: Any = None

    def push(self, pcm: bytes, source: int) -> bytes:
        import numpy as np

        if self._source is None:
            self._source = source
            if source != self.rate:
                import soxr

                self._stream = soxr.ResampleStream(source, self.rate, 1, dtype="int16")
        elif source != self._source:
            raise ValueError(f"the audio's sample rate changed from {self._source} to {source} Hz mid-stream")
        if self._stream is None:
            return pcm
        return self._stream.resample_chunk(np.frombuffer(pcm, dtype="<i2")).astype("<i2").tobytes()

    def flush(self) -> bytes:
        import numpy as np

        if self._stream is None:
            return b""
        return self._stream.resample_chunk(np.zeros(0, dtype="<i2"), last=True).astype("<i2").tobytes()


def wav_bytes(pcm: bytes, sample_rate: int) -> bytes:
    """PCM16 mono audio as a WAV file."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm)
    return buf.getvalue()

"""Toy speech pipelines for the tests of the ``openai`` API's audio endpoints.

``Transcriber`` "transcribes" by a deterministic function of the audio: one word per 0.1 s block,
the block's loudness as a letter (``a``: silence ... ``z``: full scale), streamed one word at a
time, with a segment per word when the input ``timestamps`` is true (the route asks for verbose_json,
srt and vtt); :func:`transcribe` is the same function for the tests. ``Transcriber(digest=True)``
ends the text with :func:`digest` of the samples it got (so a test sees whether two paths gave the
stage the same samples). A prompt is
the first piece of the text; one starting with ``"hold"`` makes it wait after that piece until the
test creates a file of that name in ``$AUDIO_STAGES_HOLD``.

``Speaker`` speaks ``text`` as one tone per character (``samples_per_char`` samples of a sine at
a frequency given by the character, scaled by ``speed``), emitting each as a chunk of float32
samples; :func:`speak` is the same function. ``"fail"`` as the text makes it refuse its input; a
text starting with ``"hold"`` makes it wait after the first tone until the test creates a file of
that name in ``$AUDIO_STAGES_HOLD``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from omni_core.errors import InvalidInput

BLOCK_SECONDS = 0.1
RATE = 24000


def transcribe(samples: np.ndarray, rate: int) -> list[tuple[float, float, str]]:
    """``(start, end, word)`` of each 0.1 s block of ``samples``."""
    block = max(1, round(rate * BLOCK_SECONDS))
    out = []
    for start in range(0, len(samples), block):
        piece = samples[start:start + block]
        level = float(np.sqrt(np.mean(piece.astype(np.float64) ** 2))) if len(piece) else 0.0
        letter = chr(ord("a") + min(25, int(level * 25 * 1.4142)))
        out.append((start / rate, (start + len(piece)) / rate, letter * 3))
    return out


def digest(samples: np.ndarray, rate: int) -> str:
    """The word ``Transcriber(digest=True)`` ends its text with: the rate and a hash of the samples."""
    import hashlib

    return f"#{rate}:{hashlib.sha256(np.ascontiguousarray(samples, np.float32).tobytes()).hexdigest()[:16]}"


class Transcriber:
    def __init__(self, digest: bool = False):
        self.digest = digest

    async def __call__(self, inputs: dict[str, Any], ctx: Any) -> dict[str, Any]:
        audio = inputs["audio"]
        rate = inputs["sample_rate"]
        words = transcribe(audio.numpy(), rate)
        prefix = inputs.get("prompt") or ""
        language = inputs.get("language") or "en"
        pieces = ([prefix.strip()] if prefix.strip() else []) + [w for _, _, w in words]
        if self.digest:
            pieces.append(digest(audio.numpy(), rate))
        for index, piece in enumerate(pieces):
            await ctx.emit({"text": piece})
            if index == 0 and prefix.startswith("hold"):
                await hold(prefix)
        result = {"text": " ".join(pieces), "language": language, "prompt_tokens": len(words),
                  "completion_tokens": len(words)}
        if inputs.get("timestamps") is True:  # segments only when asked for, as Whisper's stage
            result["segments"] = [{"start": s, "end": e, "text": w, "no_speech_prob": 0.5} for s, e, w in words]
        return result


def speak(text: str, samples_per_char: int, speed: float = 1.0, rate: int = RATE) -> list[np.ndarray]:
    """One float32 tone per character of ``text``, at ``rate`` Hz."""
    n = max(1, round(samples_per_char / speed))
    t = np.arange(n) / rate
    return [(0.5 * np.sin(2 * np.pi * (200 + 10 * (ord(c) % 64)) * t)).astype(np.float32) for c in text]


async def hold(name: str, deadline: float = 60.0) -> None:
    """Wait until the test creates the file ``name`` in ``$AUDIO_STAGES_HOLD`` (so it can see what
    arrived before the rest is made), for ``deadline`` seconds at most."""
    import asyncio
    import os
    import time
    from pathlib import Path

    path = Path(os.environ["AUDIO_STAGES_HOLD"]) / name
    end = time.monotonic() + deadline
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} never appeared")
        await asyncio.sleep(0.01)


class Speaker:
    def __init__(self, samples_per_char: int = 480, rate: int = RATE):
        self.samples_per_char = samples_per_char
        self.rate = rate

    async def __call__(self, inputs: dict[str, Any], ctx: Any) -> dict[str, Any]:
        text = inputs["text"]
        if text == "fail":
            raise InvalidInput("the text 'fail' cannot be spoken", field="text")
        voice = inputs.get("voice")
        if voice not in (None, "0", "1"):
            raise InvalidInput(f"unknown voice {voice!r}", field="voice")
        tones = speak(text, self.samples_per_char, inputs.get("speed", 1.0), self.rate)
        for index, tone in enumerate(tones):
            await ctx.emit({"pcm16": torch.from_numpy(tone), "sample_rate": self.rate})
            if index == 0 and text.startswith("hold"):
                await hold(text)
        return {"prompt_tokens": len(text), "completion_tokens": len(tones)}

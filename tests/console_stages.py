"""Speech stages for the console's Speech and Transcribe tabs (tests/test_console_browser.py):
a text-to-speech stage streaming a tone per word, and a speech-to-text stage saying what it heard."""

from __future__ import annotations

import numpy as np

RATE = 16000


class Tone:
    """``{"text"}`` -> a 0.1 s tone per word, streamed as ``{"pcm16": float samples, "sample_rate"}``
    chunks; the result counts the words."""

    async def __call__(self, inputs, ctx):
        words = str(inputs.get("text", "")).split()
        t = np.arange(RATE // 10, dtype=np.float32) / RATE
        for i, _ in enumerate(words):
            await ctx.emit({"pcm16": (0.3 * np.sin(2 * np.pi * (300 + 50 * i) * t)).astype(np.float32),
                            "sample_rate": RATE})
        return {"words": len(words)}


class Heard:
    """``{"audio": samples, "sample_rate"}`` -> ``{"text": "N samples at R Hz"}``."""

    def __call__(self, inputs, ctx):
        return {"text": f"{len(inputs['audio'])} samples at {inputs['sample_rate']} Hz"}

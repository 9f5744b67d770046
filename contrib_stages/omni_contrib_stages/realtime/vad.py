"""Server VAD: turn detection on the client's audio with the ``silero-vad`` model, and the
``turn_detection`` settings a session takes."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from .audio import RATE, resample
from .protocol import ClientError

#: The server VAD's defaults (OpenAI's).
VAD_DEFAULTS = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
                "create_response": True, "interrupt_response": True, "idle_timeout_ms": None}

_CHECKS = {
    "threshold": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1,
    "prefix_padding_ms": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 10000,
    "silence_duration_ms": lambda v: isinstance(v, int) and not isinstance(v, bool) and 32 <= v <= 10000,
    "create_response": lambda v: isinstance(v, bool),
    "interrupt_response": lambda v: isinstance(v, bool),
    "idle_timeout_ms": lambda v: v is None,
}


def turn_detection(value: Any) -> dict[str, Any] | None:
    """``session.audio.input.turn_detection`` checked: null (no VAD) or server VAD settings over
    :data:`VAD_DEFAULTS`."""
    param = "session.audio.input.turn_detection"
    if value is None:
        return None
    if not isinstance(value, Mapping) or value.get("type", "server_vad") != "server_vad":
        raise ClientError(f"{param} must be null or {{\"type\": \"server_vad\", ...}} (semantic_vad is not "
                          f"available), got {value!r}", "unsupported", param)
    vad = dict(VAD_DEFAULTS)
    for key, ok in _CHECKS.items():
        if value.get(key) is not None or key == "idle_timeout_ms":
            if key in value and not ok(value[key]):
                raise ClientError(f"{param}.{key}: invalid value {value[key]!r}", "invalid_value", f"{param}.{key}")
            if key in value:
                vad[key] = value[key]
    return vad


class _Models:
    """Loaded silero-vad models, reused across sessions (each is stateful: one session at a time)."""

    def __init__(self) -> None:
        self.free: list[Any] = []
        self.lock = threading.Lock()

    def take(self) -> Any:
        with self.lock:
            if self.free:
                return self.free.pop()
        from silero_vad import load_silero_vad

        return load_silero_vad(onnx=False)

    def give(self, model: Any) -> None:
        model.reset_states()
        with self.lock:
            self.free.append(model)


VAD_MODELS = _Models()


class Vad:
    """Server VAD on the client's 24 kHz audio: silero-vad on 32 ms windows at 16 kHz. ``feed``
    returns ``("start", ms)`` / ``("stop", ms)`` events, ``ms`` counted from the session's first
    audio sample. Runs in a worker thread (the model's calls release the GIL)."""

    WINDOW_IN = 768  # 32 ms at 24 kHz
    WINDOW = 512  # 32 ms at 16 kHz

    def __init__(self, model: Any, settings: Mapping[str, Any]):
        self.model = model
        self.threshold = float(settings["threshold"])
        self.silence_ms = int(settings["silence_duration_ms"])
        self.pending = np.zeros(0, np.float32)
        self.position_ms = 0  # of the next window
        self.speaking = False
        self.silent_since: int | None = None

    def reset(self, position_ms: int) -> None:
        self.model.reset_states()
        self.pending = np.zeros(0, np.float32)
        self.position_ms = position_ms
        self.speaking = False
        self.silent_since = None

    def feed(self, samples: np.ndarray) -> list[tuple[str, int]]:
        import torch

        self.pending = np.concatenate([self.pending, samples])
        events = []
        while self.pending.size >= self.WINDOW_IN:
            block, self.pending = self.pending[: self.WINDOW_IN], self.pending[self.WINDOW_IN:]
            window = resample(block, RATE, 16000)[: self.WINDOW]
            with torch.inference_mode():
                prob = float(self.model(torch.from_numpy(np.ascontiguousarray(window)), 16000))
            start = self.position_ms
            self.position_ms += 32
            if prob >= self.threshold:
                self.silent_since = None
                if not self.speaking:
                    self.speaking = True
                    events.append(("start", start))
            elif self.speaking and prob < max(self.threshold - 0.15, 0.01):
                if self.silent_since is None:
                    self.silent_since = start
                if self.position_ms - self.silent_since >= self.silence_ms:
                    self.speaking = False
                    events.append(("stop", self.silent_since))
                    self.silent_since = None
        return events

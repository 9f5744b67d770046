"""The ``realtime`` API of ``omni serve``: the OpenAI Realtime protocol (GA event names) on the
``/v1/realtime`` WebSocket, so ``client.realtime.connect(model=PIPELINE)`` of the official ``openai``
SDK, and any client of that protocol, talks to an omni pipeline.

A session owns its conversation (user turns as audio or text, assistant turns as text), its input
audio buffer and its turn detection (server VAD with the ``silero-vad`` model). Every response is
one ordinary pipeline request (``ApiContext.stream``): cancelling it, a barge-in and a client that
goes away abort that request, and the runtime's guarantees hold.

Options (``serve.options.realtime``; every key optional). The keys the ``openai`` API shares
(prompt_key, messages_key, inputs, text_inputs, audio_inputs, text_stage, text_only_stage,
text_field, text_joiner, result_text_field, audio_stage, audio_field, sample_rate,
sample_rate_field, voices, voice_key, max_tokens_key and the usage fields) default to
``serve.options.openai`` of the same config, so a pipeline set up for the chat API serves realtime
sessions as it is. Its own keys: ``audio_key``, ``input_sample_rate``, ``max_items``,
``max_sessions``, ``idle_timeout``, ``max_buffer_seconds``, ``max_event_bytes``,
``default_voice`` (see :data:`omni_contrib_stages.plugin.REALTIME_OPTIONS` and docs/serving.md).

How a conversation becomes the pipeline's inputs for each response:

- with ``messages_key``: ``inputs[messages_key]`` is the conversation in Qwen's chat format: the
  session's instructions as a ``system`` message, then each item in order; user audio parts as
  ``{"type": "audio", "audio": <1-D float32 tensor>, "sample_rate": input_sample_rate}``, text
  parts as ``{"type": "text", "text"}``; assistant turns as their text;
- without it: ``inputs[prompt_key]`` is the conversation as lines ``"<role>: <text>"`` (an audio
  part reads as its transcript, or ``(audio)``), and with ``audio_key`` the latest user audio goes
  to ``inputs[audio_key]`` (1-D float32 tensor at ``input_sample_rate``).

History is bounded: past ``max_items`` items the oldest are dropped first (the running
response's item is never dropped).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import json
import secrets
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from omni_core import metrics
from omni_core.logs import get_logger
from omni_core.options import parse_options

from .openai_api import pcm16, usage_of
from .plugin import REALTIME_OPTIONS, REALTIME_SHARED

#: The client's audio, both ways: PCM16, mono, little-endian, 24 kHz (OpenAI's ``audio/pcm``).
RATE = 24000
#: The shortest buffer a commit accepts (OpenAI's rule).
MIN_COMMIT_MS = 100
#: How an audio part without a transcript reads in a text prompt.
AUDIO_TEXT = "(audio)"
#: OpenAI's voices, accepted when the pipeline names none.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar")
#: The server VAD's defaults (OpenAI's).
VAD_DEFAULTS = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
                "create_response": True, "interrupt_response": True, "idle_timeout_ms": None}
#: Client events this API handles (every other type is an ``unknown_event`` error).
CLIENT_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                 "input_audio_buffer.clear", "conversation.item.create", "conversation.item.truncate",
                 "conversation.item.delete", "conversation.item.retrieve", "response.create", "response.cancel")

metrics.DEFINITIONS.setdefault("omni_realtime_sessions", ("gauge", "Realtime sessions open now.", ("pipeline",)))
metrics.DEFINITIONS.setdefault("omni_realtime_sessions_total", (
    "counter", "Realtime sessions that ended, by how (closed, refused, idle_timeout).", ("pipeline", "status")))
metrics.DEFINITIONS.setdefault("omni_realtime_responses_total", (
    "counter", "Realtime responses that ended, by status (completed, cancelled, failed).", ("pipeline", "status")))
metrics.DEFINITIONS.setdefault("omni_realtime_time_to_first_audio_seconds", (
    "histogram", "Realtime: from response.create (or the end of a turn) to the first audio delta sent.", ("pipeline",)))


class ClientError(Exception):
    """A client event the session refuses: becomes an ``error`` event; the session goes on."""

    def __init__(self, message: str, code: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.code, self.param, self.kind = message, code, param, kind


def realtime_options(options: Mapping[str, Any], pipeline_config: Any) -> dict[str, Any]:
    """The API's options: ``serve.options.openai``'s shared keys, overridden by
    ``serve.options.realtime``, checked against the schema and the pipeline."""
    base = {k: v for k, v in (pipeline_config.serve.options.get("openai") or {}).items() if k in REALTIME_SHARED}
    opts = parse_options(REALTIME_OPTIONS, {**base, **dict(options)}, "serve.options.realtime", owner="API 'realtime'")
    if opts["text_stage"] is None:
        opts["text_stage"] = list(pipeline_config.terminal_stages)[0]
    for key in ("text_stage", "text_only_stage", "audio_stage"):
        if opts[key] is not None and opts[key] not in pipeline_config.stage_names:
            raise ValueError(f"serve.options.realtime.{key}: no stage {opts[key]!r} in pipeline "
                             f"{pipeline_config.name!r} (stages: {', '.join(pipeline_config.stage_names)})")
    voices = opts["voices"]
    if voices is not None and (not isinstance(voices, list) or not voices or not all(isinstance(v, str) for v in voices)):
        raise ValueError(f"serve.options.realtime.voices: a non-empty list of voice names or null, got {voices!r}")
    return opts


# -- audio ------------------------------------------------------------------------------------------------


def resample(samples: np.ndarray, src: int, dst: int) -> np.ndarray:
    """Float samples from ``src`` Hz to ``dst`` Hz: a windowed-sinc low-pass below the lower
    Nyquist rate when going down, then linear interpolation."""
    if src == dst or samples.size == 0:
        return samples.astype(np.float32, copy=False)
    x = samples.astype(np.float32, copy=False)
    if dst < src:
        taps = 31
        cutoff = 0.5 * dst / src
        n = np.arange(taps) - (taps - 1) / 2
        kernel = (2 * cutoff * np.sinc(2 * cutoff * n) * np.hamming(taps)).astype(np.float32)
        x = np.convolve(x, kernel / kernel.sum(), mode="same")
    length = max(1, round(x.size * dst / src))
    positions = np.arange(length, dtype=np.float64) * (src / dst)
    return np.interp(positions, np.arange(x.size), x).astype(np.float32)


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


# -- server VAD --------------------------------------------------------------------------------------------


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


# -- sessions ---------------------------------------------------------------------------------------------


class Hub:
    """The server's realtime sessions: the limit and the metrics."""

    def __init__(self, api: Any, opts: dict[str, Any]):
        self.api = api
        self.opts = opts
        self.sessions: set[Session] = set()
        self.store = api.state.meter.store
        self.labels = (api.pipeline_name,)
        self._gauge()

    def _gauge(self) -> None:
        self.store.values.setdefault("omni_realtime_sessions", {})[self.labels] = float(len(self.sessions))
        self.store.version += 1

    def enter(self, session: Session) -> None:
        self.sessions.add(session)
        self._gauge()

    def leave(self, session: Session, status: str) -> None:
        self.sessions.discard(session)
        self._gauge()
        self.store.inc("omni_realtime_sessions_total", (*self.labels, status))

    def refused(self) -> None:
        self.store.inc("omni_realtime_sessions_total", (*self.labels, "refused"))

    def response_ended(self, status: str) -> None:
        self.store.inc("omni_realtime_responses_total", (*self.labels, status))

    def first_audio(self, seconds: float) -> None:
        self.store.observe("omni_realtime_time_to_first_audio_seconds", self.labels, seconds)


class Item:
    """One conversation item: a message of ``role`` with parts ``{"type": "text", "text"}`` or
    ``{"type": "audio", "samples": float32 at input_sample_rate, "ms", "transcript"}``."""

    def __init__(self, item_id: str, role: str, parts: list[dict[str, Any]], status: str = "completed"):
        self.id, self.role, self.parts, self.status = item_id, role, parts, status
        self.audio_ms = 0  # assistant: audio sent for it

    @property
    def text(self) -> str:
        return " ".join(p.get("text") or p.get("transcript") or AUDIO_TEXT for p in self.parts)

    def to_json(self) -> dict[str, Any]:
        content = []
        for part in self.parts:
            if self.role == "assistant":
                kind = "output_audio" if part["type"] == "audio" else "output_text"
                content.append({"type": kind, "transcript": part.get("text", "")} if kind == "output_audio"
                               else {"type": kind, "text": part.get("text", "")})
            elif part["type"] == "audio":
                content.append({"type": "input_audio", "transcript": part.get("transcript")})
            else:
                content.append({"type": "input_text", "text": part["text"]})
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role,
                "status": self.status, "content": content}


class Response:
    def __init__(self, response_id: str, item: Item, modalities: list[str], started: float):
        self.id, self.item, self.modalities, self.started = response_id, item, modalities, started
        self.task: asyncio.Task | None = None
        self.reason = "client_cancelled"
        self.pieces = 0
        self.first_audio: float | None = None
        self.conversation = "auto"
        self.metadata: Any = None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


class Session:
    """One WebSocket connection speaking the Realtime protocol."""

    def __init__(self, ws: Any, hub: Hub):
        self.ws, self.hub, self.api, self.opts = ws, hub, hub.api, hub.opts
        self.id = _new_id("sess")
        self.log = get_logger(component="realtime", session=self.id)
        self.counter = itertools.count(1)
        self.send_lock = asyncio.Lock()
        self.items: list[Item] = []
        self.buffer = bytearray()  # PCM16 at 24 kHz since the last commit or clear
        self.buffer_origin_ms = 0  # where the buffer starts, in session audio time
        self.audio_ms = 0  # audio appended in the whole session
        self.vad: Vad | None = None
        self.vad_busy = False  # a worker thread runs the VAD model
        self.speech_item: str | None = None  # the item id of the speech VAD is hearing
        self.speech_start_ms = 0
        self.response: Response | None = None
        has_audio = self.opts["audio_stage"] is not None
        voices = self.opts["voices"]
        voice = self.opts["default_voice"] or (voices[0] if voices else "alloy")
        self.session: dict[str, Any] = {
            "type": "realtime", "object": "realtime.session", "id": self.id, "model": self.api.pipeline_name,
            "output_modalities": ["audio"] if has_audio else ["text"], "instructions": "",
            "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": RATE}, "transcription": None,
                          "noise_reduction": None, "turn_detection": dict(VAD_DEFAULTS)},
                "output": {"format": {"type": "audio/pcm", "rate": RATE}, "voice": voice, "speed": 1.0},
            },
            "max_output_tokens": "inf", "tools": [], "tool_choice": "auto", "tracing": None, "truncation": "auto",
        }

    # -- sending --------------------------------------------------------------------------------------

    async def send(self, kind: str, **fields: Any) -> None:
        event = {"type": kind, "event_id": f"event_{self.id[5:13]}_{next(self.counter)}", **fields}
        async with self.send_lock:
            await self.ws.send_text(json.dumps(event, separators=(",", ":")))

    async def error(self, exc: ClientError, event_id: str | None) -> None:
        await self.send("error", error={"type": exc.kind, "code": exc.code, "message": exc.message,
                                        "param": exc.param, "event_id": event_id})

    # -- the connection ----------------------------------------------------------------------------------

    async def run(self) -> str:
        """Serve the connection until the client leaves or the session times out; returns how it
        ended (closed | idle_timeout)."""
        inbox: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            try:
                while True:
                    message = await self.ws.receive()
                    await inbox.put(message)
                    if message["type"] == "websocket.disconnect":
                        return
            except Exception:  # the connection broke
                await inbox.put({"type": "websocket.disconnect"})

        reader = asyncio.create_task(read())
        try:
            await self._start_vad()
            await self.send("session.created", session=self.session)
            idle = self.opts["idle_timeout"]
            while True:
                try:
                    message = await asyncio.wait_for(inbox.get(), idle)
                except asyncio.TimeoutError:
                    if self.response is not None:
                        continue  # answering: not idle
                    await self.error(ClientError(f"the session was idle for {idle:g} s (serve option "
                                                 "idle_timeout) and is closed; connect again", "session_expired",
                                                 kind="invalid_request_error"), None)
                    await self.ws.close(code=1000)
                    return "idle_timeout"
                if message["type"] == "websocket.disconnect":
                    return "closed"
                await self.handle(message)
        finally:
            reader.cancel()
            await self._cancel_response("client_disconnected")
            with contextlib.suppress(BaseException):
                await reader
            if self.vad is not None and not self.vad_busy:  # a model still in a worker thread is dropped
                VAD_MODELS.give(self.vad.model)
            self.vad = None

    async def handle(self, message: Mapping[str, Any]) -> None:
        """One client message: its event handled, or an ``error`` event."""
        event_id = None
        try:
            text = message.get("text")
            if text is None:
                raise ClientError("binary frames are not part of the Realtime protocol; send each event as a JSON "
                                  "text frame", "invalid_event")
            too_large = ClientError(f"the event is {len(text)} bytes, more than this server takes "
                                    f"({self.opts['max_event_bytes']}, serve option max_event_bytes); send audio in "
                                    "smaller input_audio_buffer.append events", "event_too_large")
            try:
                event = json.loads(text)
            except json.JSONDecodeError as exc:
                if len(text) > self.opts["max_event_bytes"]:
                    raise too_large from None
                raise ClientError(f"the event is not valid JSON: {exc}", "invalid_json") from None
            if not isinstance(event, dict):
                raise ClientError(f"an event must be a JSON object with a 'type', got {type(event).__name__}",
                                  "invalid_event")
            event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            if len(text) > self.opts["max_event_bytes"]:  # read (the id is known) but not acted on
                raise too_large
            kind = event.get("type")
            if kind not in CLIENT_EVENTS:
                raise ClientError(f"unknown event type {kind!r}; this server handles {', '.join(CLIENT_EVENTS)}",
                                  "unknown_event", "type")
            await getattr(self, "on_" + kind.replace(".", "_"))(event)
        except ClientError as exc:
            await self.error(exc, event_id)

    # -- session.update ------------------------------------------------------------------------------------

    async def on_session_update(self, event: Mapping[str, Any]) -> None:
        update = event.get("session")
        if not isinstance(update, Mapping):
            raise ClientError("session.update needs 'session': an object", "invalid_value", "session")
        new = json.loads(json.dumps(self.session))
        if update.get("type", "realtime") != "realtime":
            raise ClientError(f"session.type must be 'realtime', got {update.get('type')!r}", "invalid_value",
                              "session.type")
        if "instructions" in update:
            if not isinstance(update["instructions"], str):
                raise ClientError("session.instructions must be a string", "invalid_value", "session.instructions")
            new["instructions"] = update["instructions"]
        if "output_modalities" in update:
            new["output_modalities"] = self._modalities(update["output_modalities"], "session.output_modalities")
        audio = update.get("audio")
        if audio is not None:
            if not isinstance(audio, Mapping):
                raise ClientError("session.audio must be an object", "invalid_value", "session.audio")
            inp, out = audio.get("input") or {}, audio.get("output") or {}
            if "format" in inp:
                new["audio"]["input"]["format"] = self._format(inp["format"], "session.audio.input.format")
            if "turn_detection" in inp:
                new["audio"]["input"]["turn_detection"] = self._turn_detection(inp["turn_detection"])
            if inp.get("transcription") is not None:
                raise ClientError("input audio transcription is not available on this server; set "
                                  "session.audio.input.transcription to null", "unsupported",
                                  "session.audio.input.transcription")
            if "format" in out:
                new["audio"]["output"]["format"] = self._format(out["format"], "session.audio.output.format")
            if "voice" in out:
                new["audio"]["output"]["voice"] = self._voice(out["voice"])
        if "max_output_tokens" in update:
            new["max_output_tokens"] = self._max_tokens(update["max_output_tokens"], "session.max_output_tokens")
        if update.get("tools"):
            raise ClientError("tools are not available on this server", "unsupported", "session.tools")
        self.session = new
        await self._start_vad()
        await self.send("session.updated", session=self.session)

    def _modalities(self, value: Any, param: str) -> list[str]:
        if value not in (["text"], ["audio"]):
            raise ClientError(f'{param} must be ["text"] or ["audio"], got {value!r}', "invalid_value", param)
        if value == ["audio"] and self.opts["audio_stage"] is None:
            raise ClientError(f"pipeline {self.api.pipeline_name!r} has no audio output (serve option audio_stage); "
                              'use ["text"]', "invalid_value", param)
        return list(value)

    @staticmethod
    def _format(value: Any, param: str) -> dict[str, Any]:
        if not isinstance(value, Mapping) or value.get("type") != "audio/pcm" or value.get("rate", RATE) != RATE:
            raise ClientError(f"{param}: this server speaks PCM16 at {RATE} Hz only "
                              f'({{"type": "audio/pcm", "rate": {RATE}}}), got {value!r}', "unsupported_audio_format",
                              param)
        return {"type": "audio/pcm", "rate": RATE}

    def _voice(self, value: Any) -> str:
        voices = self.opts["voices"] or list(OPENAI_VOICES)
        if self.opts["voices"] is None and isinstance(value, str) and value:
            return value
        if value not in voices:
            raise ClientError(f"unknown voice {value!r}; voices: {', '.join(voices)}", "invalid_value",
                              "session.audio.output.voice")
        return value

    @staticmethod
    def _max_tokens(value: Any, param: str) -> int | str:
        if value == "inf" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ClientError(f"{param} must be a positive integer or 'inf', got {value!r}", "invalid_value", param)

    @staticmethod
    def _turn_detection(value: Any) -> dict[str, Any] | None:
        param = "session.audio.input.turn_detection"
        if value is None:
            return None
        if not isinstance(value, Mapping) or value.get("type", "server_vad") != "server_vad":
            raise ClientError(f"{param} must be null or {{\"type\": \"server_vad\", ...}} (semantic_vad is not "
                              f"available), got {value!r}", "unsupported", param)
        vad = dict(VAD_DEFAULTS)
        checks = {"threshold": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1,
                  "prefix_padding_ms": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 10000,
                  "silence_duration_ms": lambda v: isinstance(v, int) and not isinstance(v, bool) and 32 <= v <= 10000,
                  "create_response": lambda v: isinstance(v, bool), "interrupt_response": lambda v: isinstance(v, bool),
                  "idle_timeout_ms": lambda v: v is None}
        for key, ok in checks.items():
            if value.get(key) is not None or key == "idle_timeout_ms":
                if key in value and not ok(value[key]):
                    raise ClientError(f"{param}.{key}: invalid value {value[key]!r}", "invalid_value", f"{param}.{key}")
                if key in value:
                    vad[key] = value[key]
        return vad

    async def _start_vad(self) -> None:
        settings = self.session["audio"]["input"]["turn_detection"]
        if settings is None:
            if self.vad is not None:
                VAD_MODELS.give(self.vad.model)
                self.vad = None
            return
        model = self.vad.model if self.vad is not None else await asyncio.to_thread(VAD_MODELS.take)
        self.vad = Vad(model, settings)
        self.vad.reset(self.audio_ms)
        self.speech_item = None

    # -- the input audio buffer -------------------------------------------------------------------------

    async def on_input_audio_buffer_append(self, event: Mapping[str, Any]) -> None:
        pcm = decode_audio(event.get("audio"), "audio")
        limit = int(self.opts["max_buffer_seconds"] * RATE) * 2
        if len(self.buffer) + len(pcm) > limit:
            raise ClientError(f"the input audio buffer would hold more than {self.opts['max_buffer_seconds']:g} s "
                              "(serve option max_buffer_seconds); commit or clear it first", "input_audio_buffer_full",
                              "audio")
        self.buffer += pcm
        self.audio_ms += len(pcm) * 1000 / (2 * RATE)
        if self.vad is not None:
            self.vad_busy = True
            try:
                heard = await asyncio.to_thread(self.vad.feed, to_float(pcm))
            finally:
                self.vad_busy = False
            for kind, at in heard:
                await (self._speech_started(at) if kind == "start" else self._speech_stopped(at))
            if self.speech_item is None:  # between turns keep only the prefix padding
                self._trim_buffer()

    def _trim_buffer(self) -> None:
        keep_ms = self.session["audio"]["input"]["turn_detection"]["prefix_padding_ms"] + 64
        extra = len(self.buffer) - (keep_ms * RATE // 1000) * 2
        if extra > 0:
            del self.buffer[:extra]
            self.buffer_origin_ms += extra * 1000 / (2 * RATE)

    async def _speech_started(self, at_ms: int) -> None:
        settings = self.session["audio"]["input"]["turn_detection"]
        self.speech_item = _new_id("item")
        self.speech_start_ms = max(int(self.buffer_origin_ms), at_ms - settings["prefix_padding_ms"])
        await self.send("input_audio_buffer.speech_started", audio_start_ms=self.speech_start_ms,
                        item_id=self.speech_item)
        if settings["interrupt_response"] and self.response is not None:
            await self._cancel_response("turn_detected")  # barge-in

    async def _speech_stopped(self, at_ms: int) -> None:
        item_id, self.speech_item = self.speech_item, None
        await self.send("input_audio_buffer.speech_stopped", audio_end_ms=at_ms, item_id=item_id)
        start = max(0, int((self.speech_start_ms - self.buffer_origin_ms) * RATE / 1000) * 2)
        pcm = bytes(self.buffer[start:])
        self.buffer.clear()
        self.buffer_origin_ms = self.audio_ms
        await self._commit(pcm, item_id)
        if self.session["audio"]["input"]["turn_detection"]["create_response"] and self.response is None:
            await self._create_response({}, time.perf_counter())

    async def on_input_audio_buffer_commit(self, event: Mapping[str, Any]) -> None:
        if ms_of(len(self.buffer)) < MIN_COMMIT_MS:
            raise ClientError(f"the input audio buffer holds {ms_of(len(self.buffer))} ms of audio; a commit needs "
                              f"at least {MIN_COMMIT_MS} ms", "input_audio_buffer_commit_empty")
        pcm = bytes(self.buffer)
        self.buffer.clear()
        self.buffer_origin_ms = self.audio_ms
        item_id, self.speech_item = self.speech_item or _new_id("item"), None
        if self.vad is not None:
            self.vad.reset(int(self.audio_ms))
        await self._commit(pcm, item_id)

    async def _commit(self, pcm: bytes, item_id: str) -> None:
        samples = resample(to_float(pcm), RATE, self.opts["input_sample_rate"])
        item = Item(item_id, "user", [{"type": "audio", "samples": samples, "transcript": None}])
        previous = self.items[-1].id if self.items else None
        await self.send("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous)
        await self._add_item(item, previous)

    async def on_input_audio_buffer_clear(self, event: Mapping[str, Any]) -> None:
        self.buffer.clear()
        self.buffer_origin_ms = self.audio_ms
        self.speech_item = None
        if self.vad is not None:
            self.vad.reset(int(self.audio_ms))
        await self.send("input_audio_buffer.cleared")

    # -- the conversation ----------------------------------------------------------------------------------

    async def _add_item(self, item: Item, previous: str | None) -> None:
        index = len(self.items) if previous is None else self._index(previous, "previous_item_id") + 1
        self.items.insert(index, item)
        running = self.response.item if self.response is not None else None
        self._bound_history(keep=running)
        await self.send("conversation.item.added", item=item.to_json(), previous_item_id=previous)
        if item.status == "completed":
            await self.send("conversation.item.done", item=item.to_json(), previous_item_id=previous)

    def _bound_history(self, keep: Item | None) -> None:
        """Drop the oldest items (never ``keep``, the running response's) while there are more than
        ``max_items`` or their user audio is longer than ``max_history_seconds``."""
        rate = self.opts["input_sample_rate"]

        def audio_seconds() -> float:
            return sum(p["samples"].size for i in self.items for p in i.parts if "samples" in p) / rate

        while len(self.items) > 1 and (len(self.items) > self.opts["max_items"]
                                       or audio_seconds() > self.opts["max_history_seconds"]):
            oldest = next((i for i in self.items if i is not keep), None)
            if oldest is None or oldest is self.items[-1]:
                return  # the newest item stays, however long
            self.items.remove(oldest)

    def _index(self, item_id: Any, param: str) -> int:
        for i, item in enumerate(self.items):
            if item.id == item_id:
                return i
        raise ClientError(f"{param}: no item {item_id!r} in the conversation", "item_not_found", param)

    async def on_conversation_item_create(self, event: Mapping[str, Any]) -> None:
        raw = event.get("item")
        if not isinstance(raw, Mapping) or raw.get("type", "message") != "message":
            raise ClientError("item must be a message: {\"type\": \"message\", \"role\": ..., \"content\": [...]} "
                              "(function calls are not available)", "invalid_value", "item")
        role = raw.get("role")
        if role not in ("user", "assistant", "system"):
            raise ClientError(f"item.role must be user, assistant or system, got {role!r}", "invalid_value", "item.role")
        content = raw.get("content")
        if not isinstance(content, list) or not content:
            raise ClientError("item.content must be a non-empty list of parts", "invalid_value", "item.content")
        parts = [self._part(p, role, f"item.content[{i}]") for i, p in enumerate(content)]
        item_id = raw.get("id") if isinstance(raw.get("id"), str) and raw.get("id") else _new_id("item")
        if any(i.id == item_id for i in self.items):
            raise ClientError(f"item.id {item_id!r} is already in the conversation", "invalid_value", "item.id")
        previous = event.get("previous_item_id")
        if previous == "root":
            previous = None
            index_root = True
        else:
            index_root = False
            previous = previous if previous is not None else (self.items[-1].id if self.items else None)
            if previous is not None:
                self._index(previous, "previous_item_id")
        item = Item(item_id, role, parts)
        if index_root:
            self.items.insert(0, item)
            self._bound_history(keep=self.response.item if self.response is not None else None)
            await self.send("conversation.item.added", item=item.to_json(), previous_item_id=None)
            await self.send("conversation.item.done", item=item.to_json(), previous_item_id=None)
        else:
            await self._add_item(item, previous)

    def _part(self, part: Any, role: str, where: str) -> dict[str, Any]:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise ClientError(f"{where}.text must be a string", "invalid_value", f"{where}.text")
            return {"type": "text", "text": part["text"]}
        if kind == "output_audio" and role == "assistant":
            return {"type": "text", "text": part.get("transcript") or ""}
        if kind == "input_audio" and role == "user":
            pcm = decode_audio(part.get("audio"), f"{where}.audio")
            if len(pcm) > int(self.opts["max_buffer_seconds"] * RATE) * 2:
                raise ClientError(f"{where}.audio is longer than {self.opts['max_buffer_seconds']:g} s (serve option "
                                  "max_buffer_seconds)", "invalid_value", f"{where}.audio")
            transcript = part.get("transcript") if isinstance(part.get("transcript"), str) else None
            return {"type": "audio", "samples": resample(to_float(pcm), RATE, self.opts["input_sample_rate"]),
                    "transcript": transcript}
        raise ClientError(f"{where}.type {kind!r} is not available for a {role} item (input_text, input_audio for "
                          "user; output_text, output_audio for assistant; input_text for system)", "invalid_value",
                          f"{where}.type")

    async def on_conversation_item_truncate(self, event: Mapping[str, Any]) -> None:
        item = self.items[self._index(event.get("item_id"), "item_id")]
        if item.role != "assistant":
            raise ClientError(f"item {item.id!r} is a {item.role} item; only assistant audio can be truncated",
                              "invalid_value", "item_id")
        if self.response is not None and self.response.item is item:
            raise ClientError(f"item {item.id!r} is still being generated; cancel its response first",
                              "invalid_value", "item_id")
        if event.get("content_index", 0) != 0:
            raise ClientError("content_index must be 0 (an assistant item has one part)", "invalid_value",
                              "content_index")
        end = event.get("audio_end_ms")
        if isinstance(end, bool) or not isinstance(end, int) or not 0 <= end <= item.audio_ms:
            raise ClientError(f"audio_end_ms must be an integer from 0 to the item's {item.audio_ms} ms of audio, "
                              f"got {end!r}", "invalid_value", "audio_end_ms")
        if item.audio_ms:  # keep the share of the transcript the client heard
            words = item.parts[0]["text"].split(" ") if item.parts else []
            item.parts = [{"type": "audio", "text": " ".join(words[: round(len(words) * end / item.audio_ms)])}]
            item.audio_ms = end
        await self.send("conversation.item.truncated", item_id=item.id, content_index=0, audio_end_ms=end)

    async def on_conversation_item_delete(self, event: Mapping[str, Any]) -> None:
        index = self._index(event.get("item_id"), "item_id")
        if self.response is not None and self.response.item is self.items[index]:
            raise ClientError("the item is still being generated; cancel its response first", "invalid_value",
                              "item_id")
        item = self.items.pop(index)
        await self.send("conversation.item.deleted", item_id=item.id)

    async def on_conversation_item_retrieve(self, event: Mapping[str, Any]) -> None:
        item = self.items[self._index(event.get("item_id"), "item_id")]
        await self.send("conversation.item.retrieved", item=item.to_json())

    # -- responses -----------------------------------------------------------------------------------------

    async def on_response_create(self, event: Mapping[str, Any]) -> None:
        params = event.get("response") or {}
        if not isinstance(params, Mapping):
            raise ClientError("response must be an object", "invalid_value", "response")
        await self._create_response(params, time.perf_counter())

    async def on_response_cancel(self, event: Mapping[str, Any]) -> None:
        wanted = event.get("response_id")
        if self.response is None or (wanted is not None and wanted != self.response.id):
            what = f"response {wanted!r} is not running" if wanted is not None else "no response is running"
            raise ClientError(f"nothing to cancel: {what}", "response_cancel_not_active", "response_id")
        await self._cancel_response("client_cancelled")

    async def _cancel_response(self, reason: str) -> None:
        """Abort the running response (its pipeline request) and wait until it ended; it sends
        response.done (cancelled) unless ``reason`` is client_disconnected."""
        response = self.response
        if response is None or response.task is None:
            return
        response.reason = reason
        response.task.cancel()
        with contextlib.suppress(BaseException):
            await response.task

    async def _create_response(self, params: Mapping[str, Any], started: float) -> None:
        if self.response is not None:
            raise ClientError(f"the conversation already has an active response ({self.response.id}); wait for its "
                              "response.done or send response.cancel", "conversation_already_has_active_response")
        modalities = self.session["output_modalities"]
        if "output_modalities" in params:
            modalities = self._modalities(params["output_modalities"], "response.output_modalities")
        instructions = params.get("instructions", self.session["instructions"])
        if not isinstance(instructions, str):
            raise ClientError("response.instructions must be a string", "invalid_value", "response.instructions")
        max_tokens = self._max_tokens(params.get("max_output_tokens", self.session["max_output_tokens"]),
                                      "response.max_output_tokens")
        if params.get("conversation", "auto") not in ("auto", "none"):
            raise ClientError("response.conversation must be 'auto' or 'none'", "invalid_value",
                              "response.conversation")
        if params.get("input") is not None:
            raise ClientError("response.input is not available; add items with conversation.item.create",
                              "unsupported", "response.input")
        want_audio = modalities == ["audio"]
        inputs = self._inputs(instructions, want_audio, max_tokens)
        part_type = "audio" if want_audio else "text"
        item = Item(_new_id("item"), "assistant", [{"type": part_type, "text": ""}], status="in_progress")
        response = Response(_new_id("resp"), item, modalities, started)
        response.conversation = params.get("conversation", "auto")
        response.metadata = params.get("metadata")
        self.response = response
        await self.send("response.created", response=self._response_json(response, "in_progress", []))
        response.task = asyncio.create_task(self._run_response(response, inputs))

    def _inputs(self, instructions: str, want_audio: bool, max_tokens: int | str) -> dict[str, Any]:
        import torch

        opts = self.opts
        items = [i for i in self.items if i.role != "assistant" or i.text.strip()]
        if opts["messages_key"] is not None:
            messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
            for item in items:
                if item.role == "assistant":
                    messages.append({"role": "assistant", "content": item.parts[0].get("text", "") if len(item.parts) == 1
                                     else " ".join(p.get("text", "") for p in item.parts)})
                    continue
                content = []
                for part in item.parts:
                    if part["type"] == "audio":
                        content.append({"type": "audio", "audio": torch.from_numpy(part["samples"].copy()),
                                        "sample_rate": opts["input_sample_rate"]})
                    else:
                        content.append({"type": "text", "text": part["text"]})
                messages.append({"role": item.role, "content": content})
            prompt = {opts["messages_key"]: messages}
        else:
            lines = [f"system: {instructions}"] if instructions else []
            lines += [f"{item.role}: {item.text}" for item in items]
            prompt = {opts["prompt_key"]: "\n".join(lines) or f"user: {AUDIO_TEXT}"}
            if opts["audio_key"] is not None:
                audio = [p["samples"] for i in items if i.role == "user" for p in i.parts if p["type"] == "audio"]
                if audio:
                    prompt[opts["audio_key"]] = torch.from_numpy(audio[-1].copy())
        inputs = {**opts["inputs"], **(opts["audio_inputs"] if want_audio else opts["text_inputs"]), **prompt}
        if want_audio and opts["voice_key"] is not None:
            inputs[opts["voice_key"]] = self.session["audio"]["output"]["voice"]
        if max_tokens != "inf" and opts["max_tokens_key"] is not None:
            inputs[opts["max_tokens_key"]] = max_tokens
        return inputs

    def _response_json(self, response: Response, status: str, output: list[dict[str, Any]],
                       details: dict[str, Any] | None = None, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": response.id, "object": "realtime.response", "status": status, "status_details": details,
                "output": output, "output_modalities": response.modalities, "usage": usage,
                "conversation_id": None if response.conversation == "none" else f"conv_{self.id[5:]}",
                "metadata": response.metadata,
                "audio": {"output": {"format": {"type": "audio/pcm", "rate": RATE},
                                     "voice": self.session["audio"]["output"]["voice"]}},
                "max_output_tokens": self.session["max_output_tokens"]}

    async def _run_response(self, response: Response, inputs: dict[str, Any]) -> None:
        item = response.item
        want_audio = response.modalities == ["audio"]
        ids = {"response_id": response.id, "item_id": item.id, "output_index": 0, "content_index": 0}
        status, details, usage, result = "completed", None, None, None
        text_stage = self.opts["text_stage"] if want_audio else (self.opts["text_only_stage"] or self.opts["text_stage"])
        events = None
        try:
            await self.send("response.output_item.added", response_id=response.id, output_index=0, item=item.to_json())
            if response.conversation != "none":
                previous = self.items[-1].id if self.items else None
                await self._add_item(item, previous)
            part = {"type": "audio", "transcript": ""} if want_audio else {"type": "text", "text": ""}
            await self.send("response.content_part.added", part=part, **ids)
            events = self.api.stream(inputs, request_id=f"rt-{response.id}")
            async for event in events:
                if event.is_result:
                    result = event.data
                    break
                if event.stage == text_stage and (piece := self._text_of(event.data)):
                    delta = piece if response.pieces == 0 else self.opts["text_joiner"] + piece
                    response.pieces += 1
                    item.parts[0]["text"] += delta
                    kind = "response.output_audio_transcript.delta" if want_audio else "response.output_text.delta"
                    await self.send(kind, delta=delta, **ids)
                elif want_audio and event.stage == self.opts["audio_stage"]:
                    pcm = self._audio_of(event.data)
                    if pcm:
                        await self.send("response.output_audio.delta", delta=base64.b64encode(pcm).decode(), **ids)
                        item.audio_ms += ms_of(len(pcm))
                        if response.first_audio is None:
                            response.first_audio = time.perf_counter() - response.started
                            self.hub.first_audio(response.first_audio)
            counts, _ = usage_of(result, self.opts, text_stage)
            if counts is not None:
                usage = {"total_tokens": counts["total_tokens"], "input_tokens": counts["prompt_tokens"],
                         "output_tokens": counts["completion_tokens"]}
        except asyncio.CancelledError:
            status, details = "cancelled", {"type": "cancelled", "reason": response.reason}
        except Exception as exc:
            from omni_core.serve import describe

            err = describe(exc)
            where = f" (stage {err.stage!r})" if err.stage else ""
            status = "failed"
            details = {"type": "failed", "error": {"type": "server_error", "code": err.type,
                                                   "message": f"{err.type}{where}: {err.message}"}}
            self.log.warning("realtime response failed", response=response.id, error=err.type, stage=err.stage,
                             message=err.message)
        finally:
            if events is not None:
                with contextlib.suppress(BaseException):
                    await events.aclose()
        if usage is None:
            usage = {"total_tokens": response.pieces, "input_tokens": None, "output_tokens": response.pieces}
        self.response = None
        self.hub.response_ended(status)
        item.status = "completed" if status == "completed" else "incomplete"
        if response.reason == "client_disconnected" and status == "cancelled":
            return
        with contextlib.suppress(Exception):
            await self._finish(response, ids, status, details, usage)

    async def _finish(self, response: Response, ids: dict[str, Any], status: str, details: Any, usage: Any) -> None:
        item = response.item
        text = item.parts[0]["text"]
        if response.modalities == ["audio"]:
            await self.send("response.output_audio.done", **ids)
            await self.send("response.output_audio_transcript.done", transcript=text, **ids)
            part = {"type": "audio", "transcript": text}
        else:
            await self.send("response.output_text.done", text=text, **ids)
            part = {"type": "text", "text": text}
        await self.send("response.content_part.done", part=part, **ids)
        await self.send("response.output_item.done", response_id=response.id, output_index=0, item=item.to_json())
        if response.conversation != "none" and item in self.items:
            index = self.items.index(item)
            await self.send("conversation.item.done", item=item.to_json(),
                            previous_item_id=self.items[index - 1].id if index else None)
        await self.send("response.done", response=self._response_json(response, status, [item.to_json()], details,
                                                                       usage))

    def _text_of(self, chunk: Any) -> str | None:
        value = chunk.get(self.opts["text_field"]) if isinstance(chunk, Mapping) else chunk
        return value if isinstance(value, str) else None

    def _audio_of(self, chunk: Any) -> bytes | None:
        if not isinstance(chunk, Mapping) or self.opts["audio_field"] not in chunk:
            return None
        pcm = pcm16(chunk[self.opts["audio_field"]])
        field = self.opts["sample_rate_field"]
        rate = chunk.get(field) if field else None
        rate = rate if isinstance(rate, int) and not isinstance(rate, bool) and rate > 0 else self.opts["sample_rate"]
        if pcm and rate != RATE:
            pcm = to_pcm16(resample(to_float(pcm), rate, RATE))
        return pcm


# -- the route -------------------------------------------------------------------------------------------


def make_routes(api: Any) -> list[Any]:
    """The API factory registered as ``realtime``: the ``/v1/realtime`` WebSocket."""
    from starlette.routing import WebSocketRoute

    from omni_core.serve import HTTPError

    opts = realtime_options(api.options, api.pipeline.config)
    hub = Hub(api, opts)
    log = get_logger(component="realtime", pipeline=api.pipeline_name)

    async def refuse(ws: Any, message: str, code: str, close_code: int) -> None:
        await ws.accept()
        event = {"type": "error", "event_id": _new_id("event"),
                 "error": {"type": "invalid_request_error", "code": code, "message": message, "param": None,
                           "event_id": None}}
        with contextlib.suppress(Exception):
            await ws.send_text(json.dumps(event))
            await ws.close(code=close_code)
        hub.refused()

    async def realtime(ws: Any) -> None:
        model = ws.query_params.get("model")
        if model is not None and model != api.pipeline_name:
            await refuse(ws, f"the model {model!r} does not exist; this server serves {api.pipeline_name!r}",
                         "model_not_found", 1008)
            return
        try:
            api.state.check_available()
        except HTTPError as exc:
            await refuse(ws, exc.message, "service_unavailable", 1013)
            return
        if len(hub.sessions) >= opts["max_sessions"]:
            await refuse(ws, f"this server has {opts['max_sessions']} realtime sessions open, its limit (serve option "
                         "max_sessions); try again later", "session_limit_reached", 1013)
            return
        await ws.accept()
        session = Session(ws, hub)
        hub.enter(session)
        status = "closed"
        try:
            status = await session.run()
        except Exception as exc:  # the connection broke mid-send
            log.info("realtime session ended", session=session.id, error=type(exc).__name__)
        finally:
            hub.leave(session, status)

    return [WebSocketRoute("/v1/realtime", realtime)]

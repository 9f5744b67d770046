"""A realtime session (one WebSocket connection): reading the client's events, the session's
settings (``session.update``), the input audio buffer and its turns (server VAD); the hub of the
server's sessions (the limit, the metrics) and the ``/v1/realtime`` route."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Mapping
from typing import Any

from omni_core import metrics
from omni_core.logs import get_logger

from . import protocol
from .audio import MIN_COMMIT_MS, RATE, audio_format, decode_audio, ms_of, to_float
from .conversation import Conversation
from .protocol import ClientError, Incoming, new_id, realtime_options
from .responses import Response, Responses
from .transcription import transcribe, transcribers, transcription_setting
from .vad import VAD_DEFAULTS, VAD_MODELS, Vad, turn_detection

#: The metrics of the realtime API, defined with :func:`omni_core.metrics.define` when it is mounted.
METRICS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("omni_realtime_sessions", "gauge", "Realtime sessions open now.", ("pipeline",)),
    ("omni_realtime_sessions_total", "counter", "Realtime sessions that ended, by how (closed, refused, "
     "idle_timeout).", ("pipeline", "status")),
    ("omni_realtime_responses_total", "counter", "Realtime responses that ended, by status (completed, cancelled, "
     "failed).", ("pipeline", "status")),
    ("omni_realtime_time_to_first_audio_seconds", "histogram", "Realtime: from response.create (or the end of a "
     "turn) to the first audio delta sent.", ("pipeline",)),
)


class Hub:
    """The server's realtime sessions: the limit and the metrics."""

    def __init__(self, api: Any, opts: dict[str, Any]):
        for name, kind, help_text, labels in METRICS:
            metrics.define(name, kind, help_text, labels)
        self.api = api
        self.opts = opts
        self.sessions: set[Session] = set()
        self.store = api.state.meter.store
        self.labels = (api.pipeline_name,)
        #: The server's ASR pipelines, which a session may transcribe its input audio with.
        self.transcribers = transcribers(api)
        self._gauge()

    def _gauge(self) -> None:
        self.store.set("omni_realtime_sessions", self.labels, float(len(self.sessions)))

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


def session_config(session_id: str, pipeline: str, opts: Mapping[str, Any]) -> dict[str, Any]:
    """A new session's settings (``session.created``'s ``session``)."""
    voices = opts["voices"]
    voice = opts["default_voice"] or (voices[0] if voices else "alloy")
    return {
        "type": "realtime", "object": "realtime.session", "id": session_id, "model": pipeline,
        "output_modalities": ["audio"] if opts["audio_stage"] is not None else ["text"], "instructions": "",
        "audio": {
            "input": {"format": {"type": "audio/pcm", "rate": RATE}, "transcription": None,
                      "noise_reduction": None, "turn_detection": dict(VAD_DEFAULTS)},
            "output": {"format": {"type": "audio/pcm", "rate": RATE}, "voice": voice, "speed": 1.0},
        },
        "max_output_tokens": "inf", "tools": [], "tool_choice": "auto", "tracing": None, "truncation": "auto",
    }


class Session:
    """One WebSocket connection speaking the Realtime protocol: the client's events go to the
    session (settings, input audio), its :class:`Conversation` or its :class:`Responses`."""

    def __init__(self, ws: Any, hub: Hub):
        self.ws, self.hub, self.api, self.opts = ws, hub, hub.api, hub.opts
        self.id = new_id("sess")
        self.log = get_logger(component="realtime", session=self.id)
        self.counter = itertools.count(1)
        self.send_lock = asyncio.Lock()
        self.buffer = bytearray()  # PCM16 at 24 kHz since the last commit or clear
        self.buffer_origin_ms = 0.0  # where the buffer starts, in session audio time
        self.audio_ms = 0.0  # audio appended in the whole session
        self.vad: Vad | None = None
        self.vad_busy = False  # a worker thread runs the VAD model
        self.speech_item: str | None = None  # the item id of the speech VAD is hearing
        self.speech_start_ms = 0
        self.config = session_config(self.id, self.api.pipeline_name, self.opts)
        self.transcriptions: set[asyncio.Task] = set()  # committed turns being transcribed
        self.responses = Responses(self)
        self.conversation = Conversation(self.opts, self.send, lambda: self.response.item if self.response else None)

    @property
    def response(self) -> Response | None:
        """The running response."""
        return self.responses.current

    async def send(self, kind: str, **fields: Any) -> None:
        event = {"type": kind, "event_id": f"event_{self.id[5:13]}_{next(self.counter)}", **fields}
        async with self.send_lock:
            await self.ws.send_text(json.dumps(event, separators=(",", ":")))

    async def error(self, exc: ClientError, event_id: str | None) -> None:
        await self.send("error", error=exc.event_error(event_id))

    # -- the connection -------------------------------------------------------------------------------------

    async def run(self) -> str:
        """Serve the connection until the client leaves or the session times out; returns how it
        ended (closed | idle_timeout)."""
        inbox: asyncio.Queue = asyncio.Queue()
        reader = asyncio.create_task(self._read(inbox))
        try:
            await self._start_vad()
            await self.send("session.created", session=self.config)
            idle = self.opts["idle_timeout"]
            while True:
                try:
                    message = await asyncio.wait_for(inbox.get(), idle)
                except asyncio.TimeoutError:
                    if self.response is not None:
                        continue  # answering: not idle
                    await self.error(ClientError(f"the session was idle for {idle:g} s (serve option "
                                                 "idle_timeout) and is closed; connect again", "session_expired"), None)
                    await self.ws.close(code=1000)
                    return "idle_timeout"
                if message["type"] == "websocket.disconnect":
                    return "closed"
                await self.handle(message)
        finally:
            reader.cancel()
            await self.responses.cancel("client_disconnected")
            for task in list(self.transcriptions):  # their requests are aborted
                task.cancel()
            for task in list(self.transcriptions):
                with contextlib.suppress(BaseException):
                    await task
            with contextlib.suppress(BaseException):
                await reader
            if self.vad is not None and not self.vad_busy:  # a model still in a worker thread is dropped
                VAD_MODELS.give(self.vad.model)
            self.vad = None

    async def _read(self, inbox: asyncio.Queue) -> None:
        try:
            while True:
                message = await self.ws.receive()
                await inbox.put(message)
                if message["type"] == "websocket.disconnect":
                    return
        except Exception:  # the connection broke
            await inbox.put({"type": "websocket.disconnect"})

    async def handle(self, message: Mapping[str, Any]) -> None:
        """One client message: its event handled, or an ``error`` event."""
        incoming = Incoming(message, self.opts["max_event_bytes"])
        try:
            if incoming.problem is not None:
                raise incoming.problem
            name = incoming.handler
            owner = next(o for o in (self, self.conversation, self.responses) if hasattr(o, name))
            await getattr(owner, name)(incoming.event)
        except ClientError as exc:
            await self.error(exc, incoming.event_id)

    # -- session.update ---------------------------------------------------------------------------------------

    async def on_session_update(self, event: Mapping[str, Any]) -> None:
        update = event.get("session")
        if not isinstance(update, Mapping):
            raise ClientError("session.update needs 'session': an object", "invalid_value", "session")
        new = json.loads(json.dumps(self.config))
        if update.get("type", "realtime") != "realtime":
            raise ClientError(f"session.type must be 'realtime', got {update.get('type')!r}", "invalid_value",
                              "session.type")
        if "instructions" in update:
            new["instructions"] = protocol.instructions(update["instructions"], "session.instructions")
        if "output_modalities" in update:
            new["output_modalities"] = protocol.modalities(update["output_modalities"], "session.output_modalities",
                                                           self.opts["audio_stage"] is not None,
                                                           self.api.pipeline_name)
        audio = update.get("audio")
        if audio is not None:
            if not isinstance(audio, Mapping):
                raise ClientError("session.audio must be an object", "invalid_value", "session.audio")
            self._update_audio(new["audio"], audio.get("input") or {}, audio.get("output") or {})
        if "input_audio_transcription" in update:  # the beta protocol's place for it
            new["audio"]["input"]["transcription"] = transcription_setting(
                update["input_audio_transcription"], self.hub.transcribers, "session.input_audio_transcription")
        if "max_output_tokens" in update:
            new["max_output_tokens"] = protocol.max_tokens(update["max_output_tokens"], "session.max_output_tokens")
        if update.get("tools"):
            raise ClientError("tools are not available on this server", "unsupported", "session.tools")
        self.config = new
        await self._start_vad()
        await self.send("session.updated", session=self.config)

    def _update_audio(self, new: dict[str, Any], inp: Mapping[str, Any], out: Mapping[str, Any]) -> None:
        if "format" in inp:
            new["input"]["format"] = audio_format(inp["format"], "session.audio.input.format")
        if "turn_detection" in inp:
            new["input"]["turn_detection"] = turn_detection(inp["turn_detection"])
        if "transcription" in inp:
            new["input"]["transcription"] = transcription_setting(inp["transcription"], self.hub.transcribers,
                                                                  "session.audio.input.transcription")
        if "format" in out:
            new["output"]["format"] = audio_format(out["format"], "session.audio.output.format")
        if "voice" in out:
            new["output"]["voice"] = protocol.voice(out["voice"], self.opts["voices"])

    async def _start_vad(self) -> None:
        settings = self.config["audio"]["input"]["turn_detection"]
        if settings is None:
            if self.vad is not None:
                VAD_MODELS.give(self.vad.model)
                self.vad = None
            return
        model = self.vad.model if self.vad is not None else await asyncio.to_thread(VAD_MODELS.take)
        self.vad = Vad(model, settings)
        self.vad.reset(int(self.audio_ms))
        self.speech_item = None

    # -- the input audio buffer -----------------------------------------------------------------------------

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
        keep_ms = self.config["audio"]["input"]["turn_detection"]["prefix_padding_ms"] + 64
        extra = len(self.buffer) - (keep_ms * RATE // 1000) * 2
        if extra > 0:
            del self.buffer[:extra]
            self.buffer_origin_ms += extra * 1000 / (2 * RATE)

    def _take_buffer(self, start: int = 0) -> bytes:
        """The buffer's audio from byte ``start``; the buffer is empty after."""
        pcm = bytes(self.buffer[start:])
        self.buffer.clear()
        self.buffer_origin_ms = self.audio_ms
        return pcm

    async def _speech_started(self, at_ms: int) -> None:
        settings = self.config["audio"]["input"]["turn_detection"]
        self.speech_item = new_id("item")
        self.speech_start_ms = max(int(self.buffer_origin_ms), at_ms - settings["prefix_padding_ms"])
        await self.send("input_audio_buffer.speech_started", audio_start_ms=self.speech_start_ms,
                        item_id=self.speech_item)
        if settings["interrupt_response"] and self.response is not None:
            await self.responses.cancel("turn_detected")  # barge-in

    async def _speech_stopped(self, at_ms: int) -> None:
        item_id, self.speech_item = self.speech_item, None
        await self.send("input_audio_buffer.speech_stopped", audio_end_ms=at_ms, item_id=item_id)
        start = max(0, int((self.speech_start_ms - self.buffer_origin_ms) * RATE / 1000) * 2)
        await self._commit(self._take_buffer(start), item_id)
        if self.config["audio"]["input"]["turn_detection"]["create_response"] and self.response is None:
            await self.responses.create({}, time.perf_counter())

    async def on_input_audio_buffer_commit(self, event: Mapping[str, Any]) -> None:
        if ms_of(len(self.buffer)) < MIN_COMMIT_MS:
            raise ClientError(f"the input audio buffer holds {ms_of(len(self.buffer))} ms of audio; a commit needs "
                              f"at least {MIN_COMMIT_MS} ms", "input_audio_buffer_commit_empty")
        pcm = self._take_buffer()
        item_id, self.speech_item = self.speech_item or new_id("item"), None
        if self.vad is not None:
            self.vad.reset(int(self.audio_ms))
        await self._commit(pcm, item_id)

    async def _commit(self, pcm: bytes, item_id: str) -> None:
        item = self.conversation.user_audio(pcm, item_id)
        previous = self.conversation.last_id
        await self.send("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous)
        await self.conversation.add(item, previous)
        setting = self.config["audio"]["input"]["transcription"]
        if setting is not None:
            task = asyncio.create_task(transcribe(self, self.hub.transcribers[setting["model"]], setting, item, pcm))
            self.transcriptions.add(task)
            task.add_done_callback(self.transcriptions.discard)

    async def on_input_audio_buffer_clear(self, event: Mapping[str, Any]) -> None:
        self.buffer.clear()
        self.buffer_origin_ms = self.audio_ms
        self.speech_item = None
        if self.vad is not None:
            self.vad.reset(int(self.audio_ms))
        await self.send("input_audio_buffer.cleared")


# -- the route ------------------------------------------------------------------------------------------------


def make_routes(api: Any) -> list[Any]:
    """The API factory registered as ``realtime``: the ``/v1/realtime`` WebSocket."""
    from starlette.routing import WebSocketRoute

    # Each pipeline the API serves (``omni serve A B``: a connection's ?model= picks one, the
    # first without it) has its own options and sessions.
    peers = api.peers() if hasattr(api, "peers") else {api.pipeline_name: api}
    hubs = {name: Hub(peer, realtime_options(peer.options, peer.pipeline.config)) for name, peer in peers.items()}
    log = get_logger(component="realtime", pipeline=api.pipeline_name)

    async def realtime(ws: Any) -> None:
        model = ws.query_params.get("model")
        hub = hubs.get(model) if model is not None else next(iter(hubs.values()))
        if hub is None:
            served = ", ".join(repr(n) for n in hubs)
            await _refuse(ws, next(iter(hubs.values())),
                          f"the model {model!r} does not exist; this server serves {served}", "model_not_found", 1008)
            return
        refusal = _refusal(ws, hub.api, hub)
        if refusal is not None:
            await _refuse(ws, hub, *refusal)
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


def _refusal(ws: Any, api: Any, hub: Hub) -> tuple[str, str, int] | None:
    """Why a connection is refused (message, error code, close code), or None."""
    from omni_core.serve import HTTPError

    model = ws.query_params.get("model")
    if model is not None and model != api.pipeline_name:
        return (f"the model {model!r} does not exist; this server serves {api.pipeline_name!r}", "model_not_found",
                1008)
    try:
        api.state.check_available()
    except HTTPError as exc:
        return exc.message, "service_unavailable", 1013
    if len(hub.sessions) >= hub.opts["max_sessions"]:
        return (f"this server has {hub.opts['max_sessions']} realtime sessions open, its limit (serve option "
                "max_sessions); try again later", "session_limit_reached", 1013)
    return None


async def _refuse(ws: Any, hub: Hub, message: str, code: str, close_code: int) -> None:
    await ws.accept()
    event = {"type": "error", "event_id": new_id("event"),
             "error": {"type": "invalid_request_error", "code": code, "message": message, "param": None,
                       "event_id": None}}
    with contextlib.suppress(Exception):
        await ws.send_text(json.dumps(event))
        await ws.close(code=close_code)
    hub.refused()

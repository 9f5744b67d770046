"""The Realtime protocol's side of the API: the client events handled, how one is read, the
``error`` event a refused one becomes, the options, and the checks of the values a client sets."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from omni_core.options import parse_options
from omni_core.serve import HTTPError, parse_json

from ..api_common import SHARED_OPTIONS, check_stages
from ..plugin import REALTIME_OPTIONS

#: How an audio part without a transcript reads in a text prompt.
AUDIO_TEXT = "(audio)"
#: OpenAI's voices, accepted when the pipeline names none.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar")
#: Client events this API handles (every other type is an ``unknown_event`` error).
CLIENT_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                 "input_audio_buffer.clear", "conversation.item.create", "conversation.item.truncate",
                 "conversation.item.delete", "conversation.item.retrieve", "response.create", "response.cancel")


class ClientError(Exception):
    """A client event the session refuses: becomes an ``error`` event; the session goes on."""

    def __init__(self, message: str, code: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.code, self.param, self.kind = message, code, param, kind

    def event_error(self, event_id: str | None) -> dict[str, Any]:
        """The ``error`` field of the ``error`` event this becomes."""
        return {"type": self.kind, "code": self.code, "message": self.message, "param": self.param,
                "event_id": event_id}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


def realtime_options(options: Mapping[str, Any], pipeline_config: Any) -> dict[str, Any]:
    """The API's options: ``serve.options.openai``'s shared keys, overridden by
    ``serve.options.realtime``, checked against the schema and the pipeline."""
    base = {k: v for k, v in (pipeline_config.serve.options.get("openai") or {}).items() if k in SHARED_OPTIONS}
    opts = parse_options(REALTIME_OPTIONS, {**base, **dict(options)}, "serve.options.realtime", owner="API 'realtime'")
    check_stages(opts, pipeline_config, "serve.options.realtime")
    voices = opts["voices"]
    if voices is not None and (not isinstance(voices, list) or not voices or not all(isinstance(v, str) for v in voices)):
        raise ValueError(f"serve.options.realtime.voices: a non-empty list of voice names or null, got {voices!r}")
    return opts


class Incoming:
    """One client message read: ``event`` (the JSON object) and ``event_id`` (its ``event_id``,
    when it has one), or the ClientError ``problem`` it is refused with."""

    def __init__(self, message: Mapping[str, Any], max_bytes: int):
        self.event: dict[str, Any] = {}
        self.event_id: str | None = None
        self.problem: ClientError | None = None
        try:
            self._read(message, max_bytes)
        except ClientError as exc:
            self.problem = exc

    @property
    def handler(self) -> str:
        """The name of the session method handling the event: ``on_`` and its type."""
        return "on_" + self.event["type"].replace(".", "_")

    def _read(self, message: Mapping[str, Any], max_bytes: int) -> None:
        text = message.get("text")
        if text is None:
            raise ClientError("binary frames are not part of the Realtime protocol; send each event as a JSON "
                              "text frame", "invalid_event")
        too_large = ClientError(f"the event is {len(text)} bytes, more than this server takes ({max_bytes}, serve "
                                "option max_event_bytes); send audio in smaller input_audio_buffer.append events",
                                "event_too_large")
        try:  # the server's own JSON reader: a deeply nested event is refused before any parser recurses
            event = parse_json(text, what="the event")
        except HTTPError as exc:
            if len(text) > max_bytes:
                raise too_large from None
            raise ClientError(exc.message, "invalid_json") from None
        if not isinstance(event, dict):
            raise ClientError(f"an event must be a JSON object with a 'type', got {type(event).__name__}",
                              "invalid_event")
        self.event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
        if len(text) > max_bytes:  # read (the id is known) but not acted on
            raise too_large
        kind = event.get("type")
        if kind not in CLIENT_EVENTS:
            raise ClientError(f"unknown event type {kind!r}; this server handles {', '.join(CLIENT_EVENTS)}",
                              "unknown_event", "type")
        self.event = event


# -- the values a client sets --------------------------------------------------------------------------------


def modalities(value: Any, param: str, has_audio: bool, pipeline: str) -> list[str]:
    if value not in (["text"], ["audio"]):
        raise ClientError(f'{param} must be ["text"] or ["audio"], got {value!r}', "invalid_value", param)
    if value == ["audio"] and not has_audio:
        raise ClientError(f"pipeline {pipeline!r} has no audio output (serve option audio_stage); "
                          'use ["text"]', "invalid_value", param)
    return list(value)


def voice(value: Any, voices: list[str] | None) -> str:
    if voices is None and isinstance(value, str) and value:
        return value
    known = voices or list(OPENAI_VOICES)
    if value not in known:
        raise ClientError(f"unknown voice {value!r}; voices: {', '.join(known)}", "invalid_value",
                          "session.audio.output.voice")
    return value


def max_tokens(value: Any, param: str) -> int | str:
    if value == "inf" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ClientError(f"{param} must be a positive integer or 'inf', got {value!r}", "invalid_value", param)


def instructions(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise ClientError(f"{param} must be a string", "invalid_value", param)
    return value

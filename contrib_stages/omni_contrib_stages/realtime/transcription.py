"""Input audio transcription in a realtime session: each committed user turn goes, as one
ordinary request, to an ASR pipeline of the same server (a pipeline whose ``openai`` API is of
``kind: asr``, the session's own one included), and the session sends
``conversation.item.input_audio_transcription.delta`` events as its text is made, then
``.completed`` with the whole transcript and usage (or ``.failed`` with the error). The transcript
is the same as ``POST /v1/audio/transcriptions`` gives for the same audio: the inputs are built
from the ASR pipeline's ``serve.options.openai.audio`` mapping, and the text read as that route
reads it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .audio import RATE, resample, to_float
from .protocol import ClientError


class Transcriber:
    """One ASR pipeline of the server, as a realtime session's transcription model."""

    def __init__(self, api: Any, opts: dict[str, Any], audio: dict[str, Any]):
        self.api, self.opts, self.audio = api, opts, audio

    @property
    def name(self) -> str:
        return self.api.pipeline_name

    def inputs(self, pcm: bytes, language: str | None, prompt: str | None) -> tuple[dict[str, Any], float]:
        """The pipeline's inputs for ``pcm`` (PCM16 at 24 kHz) and the audio's seconds."""
        import torch

        rate = self.audio["input_sample_rate"] or RATE
        samples = resample(to_float(pcm), RATE, rate)
        inputs: dict[str, Any] = dict(self.audio["inputs"])
        inputs[self.audio["audio_key"]] = torch.from_numpy(samples.copy())
        if self.audio["sample_rate_key"] is not None:
            inputs[self.audio["sample_rate_key"]] = rate
        for value, key in ((language, "language_key"), (prompt, "prompt_key")):
            if value and self.audio[key] is not None:
                inputs[self.audio[key]] = value
        return inputs, len(samples) / rate

    def piece(self, event: Any) -> str | None:
        if event.is_result or event.stage != self.opts["text_stage"]:
            return None
        chunk = event.data
        value = chunk.get(self.opts["text_field"]) if isinstance(chunk, Mapping) else chunk
        return value if isinstance(value, str) and value else None

    def whole(self, result: Any, pieces: list[str]) -> tuple[str, dict[str, Any] | None]:
        from ..api_common import stage_part

        part = stage_part(result, self.opts["text_stage"])
        text = part.get(self.opts["result_text_field"]) if isinstance(part, Mapping) else None
        return (text if isinstance(text, str) else self.audio["text_joiner"].join(pieces)), (
            part if isinstance(part, Mapping) else None)

    def usage(self, part: Mapping[str, Any] | None, seconds: float) -> dict[str, Any]:
        if part is not None:
            found = (part.get(self.opts["prompt_tokens_field"]), part.get(self.opts["completion_tokens_field"]))
            if all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in found):
                return {"type": "tokens", "input_tokens": found[0], "output_tokens": found[1],
                        "total_tokens": found[0] + found[1]}
        return {"type": "duration", "seconds": max(1, math.ceil(seconds))}


def transcribers(api: Any) -> dict[str, Transcriber]:
    """The server's ASR pipelines by name: each pipeline whose ``openai`` options say ``kind:
    asr`` (whether or not it mounts that API)."""
    from omni_core.serve.context import ApiContext

    from ..openai_api import adapter_options
    from ..openai_audio import audio_options

    group = getattr(api.state, "group", None) or {api.pipeline_name: api.state}
    out: dict[str, Transcriber] = {}
    for name, state in group.items():
        config = state.pipeline.config
        options = config.serve.options.get("openai") or {}
        if not isinstance(options, Mapping) or options.get("kind") != "asr":
            continue
        try:
            opts = adapter_options(options, config)
            audio = audio_options(opts.get("audio"))
        except Exception:  # noqa: BLE001 - not a usable ASR pipeline: its own API says why
            continue
        ctx = ApiContext("realtime", state.pipeline, api.settings, dict(options), state)
        out[name] = Transcriber(ctx, opts, audio)
    return out


def transcription_setting(value: Any, available: Mapping[str, Transcriber], param: str) -> dict[str, Any] | None:
    """A session's ``audio.input.transcription`` (or ``input_audio_transcription``): null, or
    ``{"model": NAME, "language"?: str, "prompt"?: str}`` naming an ASR pipeline of this server."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ClientError(f"{param} must be an object like {{\"model\": NAME}} or null", "invalid_value", param)
    served = ", ".join(repr(n) for n in available) or "none (no pipeline of this server has openai kind asr)"
    model = value.get("model")
    if not isinstance(model, str) or not model:
        raise ClientError(f"{param}.model is required: the ASR pipeline to transcribe with; this server has {served}",
                          "invalid_value", f"{param}.model")
    if model not in available:
        raise ClientError(f"{param}.model {model!r} is not an ASR pipeline of this server; it has {served}",
                          "invalid_value", f"{param}.model")
    unknown = sorted(set(value) - {"model", "language", "prompt"})
    if unknown:
        raise ClientError(f"{param}: unknown field(s) {unknown}; it takes model, language, prompt", "invalid_value",
                          f"{param}.{unknown[0]}")
    out: dict[str, Any] = {"model": model}
    for key in ("language", "prompt"):
        item = value.get(key)
        if item is None or item == "":
            continue
        if not isinstance(item, str):
            raise ClientError(f"{param}.{key} must be a string", "invalid_value", f"{param}.{key}")
        if available[model].audio[f"{key}_key"] is None:
            raise ClientError(f"{param}.{key}: the model {model!r} does not take a {key}; leave it out",
                              "invalid_value", f"{param}.{key}")
        out[key] = item
    return out


async def transcribe(session: Any, transcriber: Transcriber, setting: Mapping[str, Any], item: Any,
                     pcm: bytes) -> None:
    """Transcribe one committed turn, sending the session's events; the text becomes the item's
    audio part's transcript."""
    from omni_core.serve import describe

    inputs, seconds = transcriber.inputs(pcm, setting.get("language"), setting.get("prompt"))
    pieces: list[str] = []
    sent = ""
    result: Any = None
    joiner = transcriber.audio["text_joiner"]
    try:
        async for event in transcriber.api.stream(inputs, request_id=f"{item.id}-transcript"):
            if event.is_result:
                result = event.data
                break
            if (piece := transcriber.piece(event)) is not None:
                delta = piece if not pieces else joiner + piece
                pieces.append(piece)
                sent += delta
                await session.send("conversation.item.input_audio_transcription.delta", item_id=item.id,
                                   content_index=0, delta=delta)
    except Exception as exc:
        err = describe(exc)
        session.log.warning("input audio transcription failed", item=item.id, model=transcriber.name,
                            error=err.type, message=err.message)
        await session.send("conversation.item.input_audio_transcription.failed", item_id=item.id, content_index=0,
                           error={"type": "transcription_error", "code": err.type, "message": err.message,
                                  "param": None})
        return
    text, part = transcriber.whole(result, pieces)
    if text.startswith(sent) and text != sent:  # what the pieces lacked: one more delta
        await session.send("conversation.item.input_audio_transcription.delta", item_id=item.id, content_index=0,
                           delta=text[len(sent):])
    for content in item.parts:
        if content.get("type") == "audio":
            content["transcript"] = text
    await session.send("conversation.item.input_audio_transcription.completed", item_id=item.id, content_index=0,
                       transcript=text, usage=transcriber.usage(part, seconds))

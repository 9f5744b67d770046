"""The wiring functions of an omni family's pipeline (processor → encoders → thinker → talker →
vocoder): where each stage's output goes, what the thinker waits for, and which payload keys each
stage reads. A family registers them under its own prefix (``omni_register_functions``); they
depend only on the stage names below and the processor's output keys."""

from __future__ import annotations


def no_payload(request_id, payload):
    """Route function: send the result nowhere (the stage's output travels in its stream)."""
    return []


# The stage names the processor's routing and the thinker's fan-in expect (both pipelines use them).
AUDIO_ENCODER, VISION_ENCODER, PROCESSOR = "audio_encoder", "vision_encoder", "processor"
# The processor's output keys that only the encoders read.
_AUDIO_KEYS, _IMAGE_KEYS = ("audio_features",), ("pixel_values",)


# The stage answering text-only requests (``return_audio: false``): a thinker without speech.
TEXT = "text"


def route_inputs(request_id, payload):
    """Route function of the processor: thinker, talker and token2wav (a text-only request,
    ``return_audio: false``: the text-only thinker ``text`` alone), plus the audio encoder when
    the request has audio and the vision encoder when it has images."""
    targets = [TEXT] if payload.get("return_audio") is False else ["thinker", "talker", "token2wav"]
    if payload.get("audio_features"):
        targets.append(AUDIO_ENCODER)
    if payload.get("pixel_values") is not None:
        targets.append(VISION_ENCODER)
    return targets


def wait_for_encoders(request_id, from_stage, payload):
    """wait_for function of the thinker: the processor's payload, plus the audio / vision encoder's
    when the request has audio / images (a text-only request waits for nothing more)."""
    if from_stage != PROCESSOR:
        return None  # known once the processor's payload is here
    needed = [PROCESSOR]
    if payload.get("audio_seqlens"):
        needed.append(AUDIO_ENCODER)
    if payload.get("image_grid_thw"):
        needed.append(VISION_ENCODER)
    return needed


def text_inputs(payload):
    """Projection: the processor's output without what only the encoders read."""
    return {k: v for k, v in payload.items() if k not in _AUDIO_KEYS + _IMAGE_KEYS}


def speech_inputs(payload):
    """Projection: the processor's output without the prompt's audio and image inputs (talker, token2wav)."""
    return {k: v for k, v in payload.items() if k not in _AUDIO_KEYS + _IMAGE_KEYS + ("audio_seqlens", "image_grid_thw")}


def audio_inputs(payload):
    """Projection: what the audio encoder reads (and ``return_audio``, which its result carries on)."""
    return {"audio_features": payload["audio_features"], "audio_seqlens": payload["audio_seqlens"],
            "return_audio": payload.get("return_audio", True)}


def image_inputs(payload):
    """Projection: what the vision encoder reads (and ``return_audio``, which its result carries on)."""
    return {"pixel_values": payload["pixel_values"], "image_grid_thw": payload["image_grid_thw"],
            "return_audio": payload.get("return_audio", True)}


def route_encoded(request_id, payload):
    """Route function of the encoders: to the thinker, or to ``text`` for a text-only request."""
    return [TEXT] if payload.get("return_audio") is False else ["thinker"]


def terminal_stages(inputs):
    """terminal_stages function: ``text`` answers a request with ``return_audio: false``, token2wav
    any other (a bad value is the processor's error)."""
    if isinstance(inputs, dict) and inputs.get("return_audio") is False:
        return [TEXT]
    return ["token2wav"]


def thinker_text(chunk):
    """Stream projection (``project_stream: {caller: ...}`` of the thinker): what the caller gets of
    a thinker chunk, a ``TextChunk`` (``{"text", "token_ids"}``, the usage counts on the last one)
    without the tensors only the talker reads."""
    if chunk.get("final"):
        usage = {k: chunk[k] for k in ("prompt_tokens", "completion_tokens", "finish_reason") if k in chunk}
        return {"text": chunk.get("text", ""), "token_ids": [], **usage}
    return {"text": chunk["text"], "token_ids": [chunk["token_id"]]}

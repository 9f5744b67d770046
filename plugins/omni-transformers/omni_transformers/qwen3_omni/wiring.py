"""The qwen3_omni pipeline's wiring functions where its stage names differ from the kit's (its vocoder
stage is ``code2wav``); the rest is the kit's (``kit.wiring``). Nothing here imports torch."""

from __future__ import annotations

from ..kit.wiring import AUDIO_ENCODER, TEXT, VISION_ENCODER

VOCODER = "code2wav"


def route_inputs(request_id, payload):
    """Route function of the processor: thinker, talker and code2wav (a text-only request,
    ``return_audio: false``: the text-only thinker ``text`` alone), plus the audio encoder when the
    request has audio and the vision encoder when it has images."""
    targets = [TEXT] if payload.get("return_audio") is False else ["thinker", "talker", VOCODER]
    if payload.get("audio_features"):
        targets.append(AUDIO_ENCODER)
    if payload.get("pixel_values") is not None:
        targets.append(VISION_ENCODER)
    return targets


def terminal_stages(inputs):
    """terminal_stages function: ``text`` answers a request with ``return_audio: false``, code2wav
    any other (a bad value is the processor's error)."""
    if isinstance(inputs, dict) and inputs.get("return_audio") is False:
        return [TEXT]
    return [VOCODER]

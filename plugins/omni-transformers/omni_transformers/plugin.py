"""The omni plugin of omni-transformers: names only; nothing heavy is imported here."""

from __future__ import annotations

import omni_core

PREFIX = "transformers.qwen2_5_omni"


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


@omni_core.hookimpl
def omni_register_stages(register):
    check = "omni_transformers.checks:check_model"  # every stage loads a part of the checkpoint
    register(f"{PREFIX}.processor", "omni_transformers.processor:Processor",
             description="Qwen2.5-Omni inputs (chat messages with text, audio, images) -> model inputs", check=check)
    register(f"{PREFIX}.audio_encoder", "omni_transformers.encoders:AudioEncoder",
             description="Qwen2.5-Omni audio tower: audio features -> embeddings, micro-batched", check=check)
    register(f"{PREFIX}.vision_encoder", "omni_transformers.encoders:VisionEncoder",
             description="Qwen2.5-Omni vision tower: image patches -> embeddings, micro-batched", check=check)
    register(f"{PREFIX}.thinker", "omni_transformers.thinker:Thinker",
             description="Qwen2.5-Omni thinker: text tokens, streaming each step to the talker", check=check)
    register(f"{PREFIX}.talker", "omni_transformers.talker:Talker",
             description="Qwen2.5-Omni talker: codec codes from the thinker's live stream", check=check)
    register(f"{PREFIX}.token2wav", "omni_transformers.token2wav:Token2Wav",
             description="Qwen2.5-Omni token2wav: codes -> waveform (DiT + BigVGAN)", check=check)


@omni_core.hookimpl
def omni_register_functions(register):
    register(f"{PREFIX}.no_payload", no_payload, kind="route", description=no_payload.__doc__)
    register(f"{PREFIX}.route_encoded", route_encoded, kind="route", description=route_encoded.__doc__)
    register(f"{PREFIX}.terminal_stages", terminal_stages, kind="terminal_stages",
             description=terminal_stages.__doc__)
    register(f"{PREFIX}.route_inputs", route_inputs, kind="route", description=route_inputs.__doc__)
    register(f"{PREFIX}.wait_for_encoders", wait_for_encoders, kind="wait_for", description=wait_for_encoders.__doc__)
    for fn in (text_inputs, speech_inputs, audio_inputs, image_inputs):
        register(f"{PREFIX}.{fn.__name__}", fn, kind="project_payload", description=fn.__doc__)


@omni_core.hookimpl
def omni_register_pipelines(register):
    register("qwen2_5_omni", "omni_transformers:pipelines/qwen2_5_omni.yaml",
             description="Qwen2.5-Omni: thinker in one process, talker + token2wav in another")
    register("qwen2_5_omni.split", "omni_transformers:pipelines/qwen2_5_omni_split.yaml",
             description="Qwen2.5-Omni: processor, thinker, talker and token2wav in a process each")

"""CSM (``model_type`` ``csm``): text to speech. Its stages (``transformers.csm.processor``, ``.talker``,
``.vocoder``) make frames of codes for concurrent requests in one batch and decode them with Mimi as they come; its
pipeline ``csm`` is served by ``omni serve`` as OpenAI's ``POST /v1/audio/speech`` (``kind: tts``); its tiny
checkpoint: ``python -m omni_transformers.tiny DIR --family csm``."""

from ..kit.family import Family

FAMILY = Family(
    name="csm",
    model_types=("csm",),
    default_pipeline="csm",
    write_tiny="omni_transformers.csm.tiny:write_tiny_checkpoint",
    stages={role: f"transformers.csm.{role}" for role in ("processor", "talker", "vocoder")},
    description="CSM text to speech (backbone + depth decoder, Mimi) from transformers",
)

"""Whisper (``model_type`` ``whisper``): speech recognition. Its stage (``transformers.whisper.asr``) transcribes
concurrent requests together (the encoder micro-batched, the decoder on the decode loop with per-row KV, tokens
streamed per row); its pipeline
``whisper`` is served by ``omni serve`` as OpenAI's ``POST /v1/audio/transcriptions`` (``kind: asr``); its tiny
checkpoint: ``python -m omni_transformers.tiny DIR --family whisper``."""

from ..kit.family import Family

FAMILY = Family(
    name="whisper",
    model_types=("whisper",),
    default_pipeline="whisper",
    write_tiny="omni_transformers.whisper.tiny:write_tiny_checkpoint",
    stages={"asr": "transformers.whisper.asr"},
    description="Whisper speech recognition from transformers",
)

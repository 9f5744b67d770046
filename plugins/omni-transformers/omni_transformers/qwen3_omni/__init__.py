"""Qwen3-Omni (``model_type`` ``qwen3_omni_moe``): MoE thinker with audio and vision towers, MoE talker whose
step makes a frame of 16 codes (code0, then its code predictor's 15), code2wav. So far the family writes its tiny
checkpoint (``python -m omni_transformers.tiny DIR --family qwen3_omni``); its stages and pipelines are to come."""

from ..kit.family import Family

FAMILY = Family(
    name="qwen3_omni",
    model_types=("qwen3_omni_moe",),
    default_pipeline="qwen3_omni",
    write_tiny="omni_transformers.qwen3_omni.tiny:write_tiny_checkpoint",
    description="Qwen3-Omni (MoE thinker, talker with code predictor, code2wav) from transformers",
)

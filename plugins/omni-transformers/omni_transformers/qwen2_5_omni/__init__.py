"""Qwen2.5-Omni, the first family on the kit: its parts, prompt and M-RoPE, talker (one code per
frame), DiT + BigVGAN token2wav, tiny checkpoint; its pipelines are ``qwen2_5_omni`` and
``qwen2_5_omni.split``."""

from ..kit.family import Family

FAMILY = Family(
    name="qwen2_5_omni",
    model_types=("qwen2_5_omni",),
    default_pipeline="qwen2_5_omni",
    write_tiny="omni_transformers.qwen2_5_omni.tiny:write_tiny_checkpoint",
    stages={role: f"transformers.qwen2_5_omni.{role}"
            for role in ("processor", "audio_encoder", "vision_encoder", "thinker", "talker", "token2wav")},
    description="Qwen2.5-Omni (thinker, talker, token2wav) from transformers",
)

"""Qwen3-Omni (``model_type`` ``qwen3_omni_moe``): MoE thinker with audio and vision towers, MoE talker whose
step makes a frame of 16 codes (code0, then its code predictor's 15), code2wav. Its tiny checkpoint
(``python -m omni_transformers.tiny DIR --family qwen3_omni``), a processor for chat messages with text, audio and
images, the audio and vision encoders, the MoE thinker and the talker on the kit's decode loops and code2wav as the
kit's streaming vocoder (pipelines ``qwen3_omni``, ``qwen3_omni.split`` and their GPU variants)."""

from ..kit.family import Family

FAMILY = Family(
    name="qwen3_omni",
    model_types=("qwen3_omni_moe",),
    default_pipeline="qwen3_omni",
    write_tiny="omni_transformers.qwen3_omni.tiny:write_tiny_checkpoint",
    stages={role: f"transformers.qwen3_omni.{role}"
            for role in ("processor", "audio_encoder", "vision_encoder", "thinker", "talker", "code2wav")},
    description="Qwen3-Omni (MoE thinker, talker with code predictor, code2wav) from transformers",
)

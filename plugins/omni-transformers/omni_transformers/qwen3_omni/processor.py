"""Qwen3-Omni's processor stage: a request's chat messages (or the ``text`` shorthand, or ``input_ids``) as the
thinker's ``input_ids``, rendered with the checkpoint's chat template, and a request's audio and images as the
encoders' inputs (``Qwen3OmniMoeProcessor``'s feature extraction, image processing and placeholder expansion).
Video parts are refused, naming the part."""

from __future__ import annotations

from ..qwen2_5_omni.processor import Processor as QwenProcessor
from .thinker import DEFAULT_SPEAKER


def qwen3_processor_class():
    """``Qwen3OmniMoeProcessor`` without its video part (which needs torchvision; videos are not taken here), built
    from the feature extractor, the image processor and the tokenizer alone."""
    from transformers import Qwen3OmniMoeProcessor
    from transformers.processing_utils import ProcessorMixin

    class Qwen3Processor(Qwen3OmniMoeProcessor):
        def __init__(self, image_processor=None, feature_extractor=None, tokenizer=None, chat_template=None):
            ProcessorMixin.__init__(self, image_processor, feature_extractor, tokenizer, chat_template=chat_template)
            for name in ("audio_token", "image_token", "video_token", "vision_bos_token", "vision_eos_token",
                         "audio_bos_token", "audio_eos_token"):
                setattr(self, name, getattr(tokenizer, name))
            for name in ("audio_token", "image_token", "video_token"):
                setattr(self, f"{name}_id", tokenizer.convert_tokens_to_ids(getattr(tokenizer, name)))

        @property
        def model_input_names(self):
            return ["input_ids", "attention_mask", "input_features", "feature_attention_mask", "pixel_values",
                    "image_grid_thw"]

    return Qwen3Processor


class Processor(QwenProcessor):
    """As the Qwen2.5-Omni processor (same request keys and checks), with no default system prompt (Qwen3-Omni
    needs none), generate's default voice (``ethan``); text, audio and image parts."""

    processor_class = staticmethod(qwen3_processor_class)

    def __init__(self, model: str | None = None, system_prompt: str | None = None, chat_template: bool = True):
        super().__init__(model, system_prompt=system_prompt, chat_template=chat_template)

    def __call__(self, payload, ctx) -> dict:
        out = super().__call__(payload, ctx)
        if payload.get("speaker") is None:  # generate's default voice (Qwen2.5-Omni's is another)
            out["speaker"] = DEFAULT_SPEAKER
        return out

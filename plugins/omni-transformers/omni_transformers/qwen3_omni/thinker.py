"""Qwen3-Omni's MoE thinker on the kit's skeleton: its part of the checkpoint and M-RoPE positions (4 axes:
the text axis, then the three rotary ones). Text prompts only so far (``speech: false``)."""

from __future__ import annotations

from ..kit.sampling import torch_dtype
from ..kit.thinker import Thinker as KitThinker
from ..kit.thinker import ThinkerEngine


def load_thinker(path, *, dtype: str | None = "auto", device: str = "cpu"):
    """The thinker of a whole ``qwen3_omni_moe`` checkpoint (only its weights are read), in eval mode."""
    import transformers

    transformers.logging.set_verbosity_error()  # the report of the other parts' weights, not loaded here
    config = transformers.Qwen3OmniMoeConfig.from_pretrained(path, local_files_only=True)
    want = torch_dtype(dtype)
    model = transformers.Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        path, config=config.thinker_config, key_mapping={r"^thinker\.": ""}, local_files_only=True,
        dtype=want if want is not None else "auto")
    return model.to(device).eval()


class Qwen3ThinkerEngine(ThinkerEngine):
    position_axes = 4  # the text axis, then M-RoPE's three

    def load_model(self, path, *, dtype: str, device: str):
        return load_thinker(path, dtype=dtype, device=device)


class Thinker(KitThinker):
    __doc__ = KitThinker.__doc__
    engine_class = Qwen3ThinkerEngine

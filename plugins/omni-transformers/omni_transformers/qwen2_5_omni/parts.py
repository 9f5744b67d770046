"""Qwen2.5-Omni's parts: the classes of a checkpoint's thinker, talker and token2wav, and its speakers."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..kit.sampling import resolve_model_path, torch_dtype

# The checkpoint's prefix of each part (keys "thinker.model.layers..." in a whole checkpoint).
_PARTS = {
    "thinker": ("Qwen2_5OmniThinkerForConditionalGeneration", "thinker_config", "qwen2_5_omni_thinker"),
    "talker": ("Qwen2_5OmniTalkerForConditionalGeneration", "talker_config", "qwen2_5_omni_talker"),
    "token2wav": ("Qwen2_5OmniToken2WavModel", "token2wav_config", "qwen2_5_omni_token2wav"),
}



def load_part(model: str | os.PathLike | None, part: str, *, dtype: str | None = "auto", device: str = "cpu"):
    """Load one part (``thinker``, ``talker`` or ``token2wav``) of a checkpoint, in eval mode.

    ``model`` is a whole Qwen2.5-Omni checkpoint (only the part's weights are read) or a folder
    holding that part alone (saved with the part class's ``save_pretrained``).
    """
    import json

    import transformers

    transformers.logging.set_verbosity_error()  # the report of the other parts' weights, not loaded here
    path = resolve_model_path(model)
    cls_name, sub_name, part_type = _PARTS[part]
    cls = getattr(transformers, cls_name)
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    kwargs: dict[str, Any] = {"local_files_only": True}
    if model_type == "qwen2_5_omni":
        config = transformers.Qwen2_5OmniConfig.from_pretrained(path, local_files_only=True)
        kwargs["config"] = getattr(config, sub_name)
        kwargs["key_mapping"] = {rf"^{part}\.": ""}
    elif model_type != part_type:
        raise ValueError(f"{path} holds a {model_type!r} checkpoint; expected qwen2_5_omni or {part_type}")
    want = torch_dtype(dtype)
    if part == "token2wav":
        want = torch.float32  # transformers runs token2wav in float32 (generate calls .float())
    if want is not None:
        kwargs["dtype"] = want
    else:
        kwargs["dtype"] = "auto"
    module = cls.from_pretrained(path, **kwargs)
    return module.to(device).eval()


def load_speakers(model: str | os.PathLike | None) -> dict[str, dict[str, Any]]:
    """The checkpoint's ``spk_dict.pt``: speaker → {bos_token, cond, ref_mel}."""
    path = resolve_model_path(model) / "spk_dict.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a Qwen2.5-Omni checkpoint ships its speakers in spk_dict.pt")
    return torch.load(path, weights_only=True)


def speaker_params(speakers: dict, name: str) -> dict[str, Any]:
    if name not in speakers:
        raise ValueError(f"speaker {name!r} is not in spk_dict.pt; available: {sorted(speakers)}")
    return speakers[name]

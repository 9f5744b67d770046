"""What the Qwen2.5-Omni stages share: defaults, the checkpoint's metadata, a request's seed."""

from __future__ import annotations

import json
from pathlib import Path

from ..kit.streams import USAGE_KEYS, StreamProgress, request_seed  # noqa: F401 (the stages import them here)

DEFAULT_SPEAKER = "Chelsie"
# The system prompt Qwen2.5-Omni needs to answer with speech (from its model card).
DEFAULT_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving auditory and "
    "visual inputs, as well as generating text and speech."
)


def sample_rate_of(path: Path, default: int = 24000) -> int:
    meta = path / "omni_transformers.json"
    if meta.is_file():
        return int(json.loads(meta.read_text()).get("sample_rate", default))
    return default


def omni_config(path: Path):
    """The whole checkpoint's config, or None for a folder holding one part."""
    import transformers

    if json.loads((path / "config.json").read_text()).get("model_type") != "qwen2_5_omni":
        return None
    return transformers.Qwen2_5OmniConfig.from_pretrained(path, local_files_only=True)

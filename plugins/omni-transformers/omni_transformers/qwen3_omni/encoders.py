"""Qwen3-Omni's encoder stages, micro-batched across requests, with the Qwen2.5-Omni stages' payloads and checks:
its audio tower (``Qwen3OmniMoeAudioEncoder``: ``audio_features`` [mel, frames] per audio and ``audio_seqlens`` in,
``audio_embeds`` [n, H] out) and its vision tower (``Qwen3OmniMoeVisionEncoder``: ``pixel_values`` and
``image_grid_thw`` in, ``image_embeds`` [n, H] and ``image_deepstack`` [layers, n, H] out). The towers attend
within each audio's windows / each image only, so a request's embeddings do not depend on its neighbours."""

from __future__ import annotations

import torch

from ..kit.sampling import resolve_model_path, torch_dtype
from ..qwen2_5_omni.encoders import AudioEncoder as QwenAudioEncoder
from ..qwen2_5_omni.encoders import VisionEncoder as QwenVisionEncoder
from .thinker import omni_config

# (class, the thinker config's attribute, the checkpoint key prefix of the tower)
_TOWERS = {"audio": ("Qwen3OmniMoeAudioEncoder", "audio_config", "audio_tower"),
           "vision": ("Qwen3OmniMoeVisionEncoder", "vision_config", "visual")}


def load_tower(model: str | None, kind: str, *, dtype: str | None = "auto", device: str = "cpu"):
    """The audio (``kind="audio"``) or vision tower of a whole ``qwen3_omni_moe`` checkpoint (only its weights are
    read), in eval mode."""
    import transformers
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

    transformers.logging.set_verbosity_error()
    path = resolve_model_path(model)
    cls_name, sub_name, prefix = _TOWERS[kind]
    config = getattr(omni_config(path).thinker_config, sub_name)
    want = torch_dtype(dtype)
    tower = getattr(modeling, cls_name).from_pretrained(
        path, config=config, local_files_only=True, key_mapping={rf"^thinker\.{prefix}\.": ""},
        dtype=want if want is not None else "auto")
    return tower.to(device).eval()


class AudioEncoder(QwenAudioEncoder):
    """The audio tower, as the thinker's ``get_audio_features`` runs it."""

    def load_tower(self, model, *, dtype, device):
        return load_tower(model, "audio", dtype=dtype, device=device)

    def forward(self, items: list[tuple[list[torch.Tensor], list[int]]]) -> list[torch.Tensor]:
        from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
            _get_feat_extract_output_lengths,
        )

        features = [f for feats, _ in items for f in feats]
        lengths = torch.tensor([n for _, lens in items for n in lens], dtype=torch.long)
        with torch.inference_mode():
            stacked = torch.cat(features, dim=1).to(self.device, self.dtype)
            out = self.tower(stacked, feature_lens=lengths.to(self.device)).last_hidden_state
        per_audio = torch.split(out, _get_feat_extract_output_lengths(lengths).tolist())
        results, k = [], 0
        for feats, _ in items:
            results.append(torch.cat(per_audio[k:k + len(feats)]))
            k += len(feats)
        return results


class VisionEncoder(QwenVisionEncoder):
    """The vision tower, as the thinker's ``get_image_features`` runs it: ``image_embeds`` [n, H] for the
    placeholders and ``image_deepstack`` [layers, n, H], what the thinker adds to the hidden states of its first
    layers at the image positions (the tower's deepstack features)."""

    def load_tower(self, model, *, dtype, device):
        return load_tower(model, "vision", dtype=dtype, device=device)

    def features(self, out) -> torch.Tensor:
        return torch.stack([out.pooler_output, *out.deepstack_features])  # [1 + layers, image tokens, H]

    async def __call__(self, payload: dict, ctx) -> dict:
        out = await super().__call__(payload, ctx)
        stacked = out.pop("image_embeds")
        return {**out, "image_embeds": stacked[0], "image_deepstack": stacked[1:]}

"""Qwen2.5-Omni's encoder stages: its own audio tower and vision tower, micro-batched across requests.

Each takes what the processor prepared for it and returns the embeddings the thinker splices in
at the prompt's placeholders:

- audio_encoder: ``{"audio_features": [[mel, frames_i], ...], "audio_seqlens": [frames_i, ...]}`` →
  ``{"audio_embeds": [n, H]}`` (every audio of the request, in order; n = the prompt's audio tokens).
- vision_encoder: ``{"pixel_values": [patches, C·T·P·P], "image_grid_thw": [[t, h, w], ...]}`` →
  ``{"image_embeds": [n, H]}`` (n = the prompt's image tokens).

Concurrent requests' inputs go through the tower together (omni_core's :class:`MicroBatcher`):
the towers attend within each audio chunk / image only, so a request's embeddings do not depend
on its neighbours in a batch.
"""

from __future__ import annotations

import json

import torch

from ..kit.encoders import Encoder, carry_route, tensor_input
from ..kit.sampling import resolve_model_path, torch_dtype

# (class, the thinker config's attribute, the checkpoint key prefix of the tower)
_TOWERS = {
    "audio": ("Qwen2_5OmniAudioEncoder", "audio_config", "audio_tower"),
    "vision": ("Qwen2_5OmniVisionEncoder", "vision_config", "visual"),
}


def load_tower(model: str | None, kind: str, *, dtype: str | None = "auto", device: str = "cpu"):
    """The audio (``kind="audio"``) or vision tower of a whole Qwen2.5-Omni checkpoint or of a
    thinker-only folder; only the tower's weights are read."""
    import transformers
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as modeling

    transformers.logging.set_verbosity_error()  # the report of the other weights, not loaded here
    path = resolve_model_path(model)
    cls_name, sub_name, prefix = _TOWERS[kind]
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type == "qwen2_5_omni":
        thinker_config = transformers.Qwen2_5OmniConfig.from_pretrained(path, local_files_only=True).thinker_config
    elif model_type == "qwen2_5_omni_thinker":
        thinker_config = transformers.Qwen2_5OmniThinkerConfig.from_pretrained(path, local_files_only=True)
    else:
        raise ValueError(f"{path} holds a {model_type!r} checkpoint; the {kind} encoder needs qwen2_5_omni or "
                         "qwen2_5_omni_thinker")
    want = torch_dtype(dtype)
    module = getattr(modeling, cls_name).from_pretrained(
        path, config=getattr(thinker_config, sub_name), local_files_only=True,
        key_mapping={rf"^(thinker\.)?(model\.)?{prefix}\.": ""}, dtype=want if want is not None else "auto")
    return module.to(device).eval()


class AudioEncoder(Encoder):
    """The audio tower (``Qwen2_5OmniAudioEncoder``), as the thinker's ``get_audio_features`` runs it."""

    kind = "audio"

    def load_tower(self, model, *, dtype, device):
        return load_tower(model, "audio", dtype=dtype, device=device)

    def forward(self, items: list[tuple[list[torch.Tensor], list[int]]]) -> list[torch.Tensor]:
        features = [f for feats, _ in items for f in feats]
        lengths = torch.tensor([n for _, lens in items for n in lens], dtype=torch.long)
        with torch.inference_mode():
            stacked = torch.cat(features, dim=1).to(self.device, self.dtype)
            after_cnn, out_lengths = self.tower._get_feat_extract_output_lengths(lengths)
            out = self.tower(stacked, feature_lens=lengths.to(self.device), aftercnn_lens=after_cnn.to(self.device))
            per_audio = torch.split(out.last_hidden_state, out_lengths.tolist())
        results, k = [], 0
        for feats, _ in items:
            results.append(torch.cat(per_audio[k:k + len(feats)]) if len(feats) > 1 else per_audio[k])
            k += len(feats)
        return results

    async def __call__(self, payload: dict, ctx) -> dict:
        feats = payload.get("audio_features")
        lens = payload.get("audio_seqlens")
        if not isinstance(feats, list) or not feats or not isinstance(lens, list) or len(lens) != len(feats):
            raise ValueError("the audio encoder's payload needs 'audio_features' (a list of [mel, frames] tensors) "
                             "and 'audio_seqlens' (their frame counts), as the processor makes them")
        mel = self.tower.config.num_mel_bins
        for i, (f, n) in enumerate(zip(feats, lens, strict=True)):
            f = tensor_input(f, f"audio_features[{i}]")
            if f.dim() != 2 or f.shape[0] != mel or f.shape[1] != n:
                raise ValueError(f"audio_features[{i}] must be [{mel}, {n}], got {list(f.shape)}")
        out = {"audio_embeds": await self.batcher.submit((feats, [int(n) for n in lens]))}
        return carry_route(payload, out)


class VisionEncoder(Encoder):
    """The vision tower (``Qwen2_5OmniVisionEncoder``), as the thinker's ``get_image_features`` runs it."""

    kind = "vision"

    def load_tower(self, model, *, dtype, device):
        return load_tower(model, "vision", dtype=dtype, device=device)

    def forward(self, items: list[tuple[torch.Tensor, list[list[int]]]]) -> list[torch.Tensor]:
        grids = [g for _, grid in items for g in grid]
        with torch.inference_mode():
            pixels = torch.cat([p for p, _ in items]).to(self.device, self.dtype)
            grid_thw = torch.tensor(grids, dtype=torch.long, device=self.device)
            out = self.features(self.tower(pixels, grid_thw=grid_thw))
        merge = self.tower.spatial_merge_size ** 2
        sizes = [sum(t * h * w // merge for t, h, w in grid) for _, grid in items]
        return list(torch.split(out, sizes, dim=-2))

    def features(self, out) -> torch.Tensor:
        """What a request gets of the tower's output: [image tokens, H] (a family with more per token stacks it
        in front: [..., image tokens, H])."""
        return out.pooler_output

    async def __call__(self, payload: dict, ctx) -> dict:
        pixels = tensor_input(payload.get("pixel_values"), "the vision encoder's 'pixel_values'")
        grid = payload.get("image_grid_thw")
        if not isinstance(grid, list) or not grid or not all(isinstance(g, list) and len(g) == 3 for g in grid):
            raise ValueError("the vision encoder's payload needs 'image_grid_thw', a list of [t, h, w]")
        patches = sum(t * h * w for t, h, w in grid)
        if pixels.dim() != 2 or pixels.shape[0] != patches:
            raise ValueError(f"pixel_values must be [{patches}, patch size] for image_grid_thw {grid}, "
                             f"got {list(pixels.shape)}")
        out = {"image_embeds": await self.batcher.submit((pixels, grid))}
        return carry_route(payload, out)

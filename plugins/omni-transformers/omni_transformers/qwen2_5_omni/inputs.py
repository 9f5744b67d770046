"""Qwen2.5-Omni's thinker prompt as model inputs: token ids, input embeddings and M-RoPE positions.

The thinker builds its prefill only through :func:`prefill_inputs`, so what a prompt holds (text
alone, or audio and image features spliced into the text embeddings) is decided here, once.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kit.thinker import PrefillInputs


def prefill_inputs(thinker_model: Any, payload: dict, device: str | torch.device) -> PrefillInputs:
    """The prompt of ``payload`` as thinker inputs, on ``device``: the processor's ``input_ids``,
    with the encoders' ``audio_embeds`` / ``image_embeds`` ([n, H]) spliced in at the audio / image
    placeholders (as the thinker's forward does) and M-RoPE positions from the model's own
    ``get_rope_index`` (which needs ``audio_seqlens`` and ``image_grid_thw`` from the processor).
    Runs the embedding lookup: call it from a worker thread."""
    ids = payload.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("the thinker's payload needs 'input_ids', a non-empty list of ints")
    audio, image = payload.get("audio_embeds"), payload.get("image_embeds")
    config = thinker_model.config
    with torch.inference_mode():
        tensor = torch.tensor(ids, dtype=torch.long, device=device)
        embeds = thinker_model.get_input_embeddings()(tensor)
        text_positions = torch.arange(len(ids), device=device).view(1, -1)
        if audio is None and image is None:
            for key, token in (("audio", config.audio_token_id), ("image", config.image_token_id)):
                if token in ids:
                    raise ValueError(f"the prompt has {key} placeholders but the thinker got no {key}_embeds: "
                                     f"wire the {key} encoder's output to the thinker (wait_for)")
            return PrefillInputs(input_ids=list(ids), inputs_embeds=embeds, position_ids=text_positions.expand(4, -1),
                                 rope_delta=0)
        embeds = embeds.clone()
        media = torch.zeros(len(ids), dtype=torch.bool, device=device)
        for key, features, token in (("audio", audio, config.audio_token_id), ("image", image, config.image_token_id)):
            mask = tensor == token
            count = int(mask.sum())
            if features is None:
                if count:
                    raise ValueError(f"the prompt has {count} {key} placeholders but the thinker got no {key}_embeds")
                continue
            if not isinstance(features, torch.Tensor) or features.dim() != 2 or features.shape[1] != embeds.shape[1]:
                raise ValueError(f"{key}_embeds must be an [n, {embeds.shape[1]}] tensor, got "
                                 f"{getattr(features, 'shape', type(features).__name__)}")
            if features.shape[0] != count:
                raise ValueError(f"{key} features and {key} tokens do not match: {features.shape[0]} embeddings "
                                 f"for {count} placeholders")
            embeds[mask] = features.to(embeds.device, embeds.dtype)
            media |= mask
        grid = payload.get("image_grid_thw")
        seqlens = payload.get("audio_seqlens")
        if audio is not None and not isinstance(seqlens, list):
            raise ValueError("audio_embeds need 'audio_seqlens' (the processor's frame count of each audio)")
        if image is not None and not isinstance(grid, list):
            raise ValueError("image_embeds need 'image_grid_thw' (the processor's [t, h, w] of each image)")
        positions, delta = thinker_model.get_rope_index(
            tensor[None],
            image_grid_thw=torch.tensor(grid, dtype=torch.long, device=device) if image is not None else None,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
            audio_seqlens=torch.tensor(seqlens, dtype=torch.long, device=device) if audio is not None else None,
        )
        position_ids = torch.cat([text_positions, positions[:, 0, :].to(device)], dim=0)
    return PrefillInputs(input_ids=list(ids), inputs_embeds=embeds, position_ids=position_ids,
                         rope_delta=int(delta.reshape(-1)[0]), media_mask=media)

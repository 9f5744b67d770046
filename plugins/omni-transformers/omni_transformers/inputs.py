"""The thinker's prompt as model inputs: token ids, input embeddings and M-RoPE positions.

The thinker builds its prefill only through :func:`prefill_inputs`, so what a prompt holds (text
alone, or audio and image features spliced into the text embeddings) is decided here, once.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch


@attrs.frozen
class PrefillInputs:
    """One request's prompt, ready for the thinker's forward.

    ``input_ids``: the prompt's token ids (L of them). ``inputs_embeds``: [L, H] text embeddings
    (with audio/image features spliced in where the prompt has their placeholders).
    ``position_ids``: [4, L], the text axis then the three M-RoPE axes (all ``arange(L)`` for
    text alone). ``rope_delta``: decode step k of the reply (k = 0 for the first fed token) sits
    at position ``L + k + rope_delta`` on every axis (0 for text alone).
    """

    input_ids: list[int]
    inputs_embeds: torch.Tensor
    position_ids: torch.Tensor
    rope_delta: int = 0

    @property
    def length(self) -> int:
        return len(self.input_ids)


def prefill_inputs(thinker_model: Any, payload: dict, device: str | torch.device) -> PrefillInputs:
    """The prompt of ``payload`` (the processor's output: ``input_ids``) as thinker inputs, on
    ``device``. Runs the embedding lookup: call it from a worker thread."""
    ids = payload.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("the thinker's payload needs 'input_ids', a non-empty list of ints")
    with torch.inference_mode():
        tensor = torch.tensor(ids, dtype=torch.long, device=device)
        embeds = thinker_model.get_input_embeddings()(tensor)
        positions = torch.arange(len(ids), device=device).view(1, -1).expand(4, -1)
    return PrefillInputs(input_ids=list(ids), inputs_embeds=embeds, position_ids=positions, rope_delta=0)

"""CSM's backbone on the decode loop: every live utterance advances by one frame per step, the backbone in one
forward for every row (each with its own KV: the kit's row buffers), then the depth decoder's codebooks for every
row that got its codebook 0 this step in one depth-decoder ``generate`` (all rows are the same length there).

Each row's codes are chosen by its own samplers (:class:`RowSampling`: the backbone's and the depth decoder's, one
generator from the request's seed), so an utterance draws the same frames alone or beside others, whatever their
settings. A row ends at its end frame (all codebooks but the last ``codebook_eos_token_id``; not spoken) or at its
``max_new`` frames.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from omni_core.kits import NO_OUTPUT
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from ..kit.batched import RowKV, RowsCache, crop_to, run_rows
from ..kit.sampling import Sampler


class RowSampling(LogitsProcessor):
    """Each row's next token chosen by its own sampler (its settings, its generator); the scores ``generate`` gets
    back allow that token alone, so its own choice (argmax) is the row's."""

    def __init__(self, samplers: list[Sampler]):
        self.samplers = samplers

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, -torch.inf)
        for i, sampler in enumerate(self.samplers):
            out[i, sampler(input_ids[i:i + 1].reshape(1, -1), scores[i:i + 1])] = 0.0
        return out


class FrameRow:
    """One utterance in the loop: its prompt, caches, samplers and frames."""

    __slots__ = ("prompt", "cache", "kv", "backbone", "depth", "max_new", "frames", "last", "ended")

    def __init__(self, prompt: list[int], backbone: Sampler, depth: Sampler, max_new: int):
        self.prompt = prompt
        self.cache: DynamicCache | None = None
        self.kv: RowKV | None = None
        self.backbone = backbone
        self.depth = depth
        self.max_new = max_new
        self.frames = 0
        self.last: list[int] = []
        self.ended = False  # its end frame came (else its max_new frames ended it)

    @property
    def reserved(self) -> int:
        return len(self.prompt) + self.max_new


class CsmDecoding:
    """The model part of the decode loop's step for CSM (a worker thread): ``step(rows)``."""

    def __init__(self, model):
        from ..kit.batched import use_row_attention

        self.model = model
        self.backbone = model.backbone_model
        use_row_attention(self.backbone, model.config)
        self.eos = model.config.codebook_eos_token_id
        # The depth decoder's generate per step: one frame's codebooks, each row's choice (RowSampling) taken as is.
        self.depth_config = copy.deepcopy(model.depth_decoder.generation_config)
        self.depth_config.update(do_sample=False, min_new_tokens=model.config.num_codebooks - 1,
                                 max_new_tokens=model.config.num_codebooks - 1)

    def step(self, rows) -> list[Any]:
        with torch.inference_mode():
            results, outs = run_rows(rows, self.decode, self.prefill)
            if outs:
                try:
                    frames = self.frames([rows[i].state for i, _ in outs], torch.cat([o[0] for _, o in outs]),
                                         torch.cat([o[1] for _, o in outs]))
                except Exception as exc:  # the depth decoder's batch: every row of it
                    for i, _ in outs:
                        results[i] = exc
                    return results
                for (i, _), frame in zip(outs, frames, strict=True):
                    state = rows[i].state
                    state.frames += 1
                    if all(c == self.eos for c in frame[:-1]):
                        state.ended = True
                        rows[i].finish()
                        results[i] = None  # the end frame: not audio
                        continue
                    state.last = frame
                    if state.frames >= state.max_new:
                        rows[i].finish()
                    results[i] = frame
        return results

    def frames(self, states: list[FrameRow], logits: torch.Tensor, hidden: torch.Tensor) -> list[list[int]]:
        """Each row's frame: codebook 0 from the backbone's logits with the row's sampler, the others from one
        depth-decoder ``generate`` over the rows, each drawn by the row's depth sampler."""
        first = [s.backbone(torch.tensor([s.prompt]), logits[j:j + 1]) for j, s in enumerate(states)]
        ids = torch.tensor([[0, c] for c in first], device=hidden.device)  # 0: the slot of the backbone's state
        out = self.model.depth_decoder.generate(
            input_ids=ids, backbone_last_hidden_state=hidden, generation_config=self.depth_config,
            logits_processor=LogitsProcessorList([RowSampling([s.depth for s in states])]))
        return out[:, 1:].tolist()

    def decode(self, rows) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One backbone forward for every decoding row: its last frame at its own position."""
        states = [row.state for row in rows]
        device = self.model.device
        codes = torch.tensor([s.last for s in states], device=device)[:, None, :]  # [B, 1, codebooks]
        positions = torch.tensor([s.kv.length for s in states], device=device).view(-1, 1)
        cache = RowsCache([s.kv for s in states])
        out = self.backbone(inputs_embeds=self.backbone.embed_tokens(codes), position_ids=positions, cache=cache,
                            attention_mask=torch.ones(len(states), 1, 1, 1, dtype=torch.bool, device=device),
                            use_cache=True)
        cache.advance()
        hidden = out.last_hidden_state[:, -1, :]
        logits = self.model.lm_head(hidden).float()
        return [(logits[j:j + 1], hidden[j:j + 1]) for j in range(len(states))]

    def prefill(self, state: FrameRow, start: int, end: int):
        """Prompt tokens [start, end) of one row; after the last, its first logits and last hidden state."""
        if start == 0 or state.cache is None:
            state.cache = DynamicCache(config=self.model.config)
        crop_to(state.cache, start)
        ids = torch.tensor([state.prompt[start:end]], device=self.model.device)
        out = self.backbone(inputs_embeds=self.model.embed_text_tokens(ids), cache=state.cache, use_cache=True,
                            position_ids=torch.arange(start, end, device=ids.device)[None])
        if end < len(state.prompt):
            return NO_OUTPUT
        state.kv = RowKV(state.cache, state.reserved)
        state.cache = None
        hidden = out.last_hidden_state[:, -1, :]
        return self.model.lm_head(hidden).float(), hidden

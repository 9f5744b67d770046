"""CSM's backbone on the kit's codec-LM talker (``kit.talker.CodecTalker``): every live utterance advances by one
frame per step, the backbone in one forward for every row (each with its own KV: the kit's row buffers), then the
depth decoder's codebooks for every row that got its codebook 0 this step in one depth-decoder ``generate`` (all
rows are the same length there).

CSM fills the kit's hooks; the kit's step runs them (prefill chunks, the batched decode forward, the frames, the
rows' ends):

- ``step_embeds``: a row's last frame through the backbone's codebook embeddings (CSM's talker reads no thinker:
  ``tail_input`` gives nothing, the rows join the loop without inputs);
- ``forward_step`` / ``forward_prefill``: the backbone and its head; what they return per row is codebook 0's
  logits and, after them, the backbone's last hidden state, which the depth decoder starts from (the kit hands a
  row's output to ``frames`` as is);
- ``frames``: codebook 0 by each row's backbone sampler, the other codebooks by one depth-decoder ``generate`` over
  the rows, each drawn by the row's depth sampler (``state.extra["depth"]``);
- ``is_end``: the end frame (all codebooks but the last ``codebook_eos_token_id``; not spoken).

Each row's codes are chosen by its own samplers (:class:`RowSampling`: the backbone's and the depth decoder's, one
generator from the request's seed), so an utterance draws the same frames alone or beside others, whatever their
settings. A row ends at its end frame or at its ``max_new`` frames.
"""

from __future__ import annotations

import copy

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from ..kit.batched import RowsCache
from ..kit.sampling import Sampler
from ..kit.talker import CodecTalker, TalkerRow


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


class CsmFrames(CodecTalker):
    """The kit's talker hooks for CSM's backbone and depth decoder (``load_model`` gives the whole
    ``CsmForConditionalGeneration``; the kit switches its backbone, which reads the model's config, to the row
    attention, and leaves the depth decoder, which reads its own, as it is)."""

    def setup(self, model) -> None:
        self.backbone = model.backbone_model
        self.vocab = model.config.vocab_size
        self.codebooks = model.config.num_codebooks
        self.codebook_eos = model.config.codebook_eos_token_id
        # The depth decoder's generate per step: one frame's codebooks, each row's choice (RowSampling) taken as is.
        self.depth_config = copy.deepcopy(model.depth_decoder.generation_config)
        self.depth_config.update(do_sample=False, min_new_tokens=self.codebooks - 1, max_new_tokens=self.codebooks - 1)
        self.no_input = torch.zeros(1)

    def tail_input(self, state: TalkerRow, step: int) -> torch.Tensor:
        return self.no_input  # no thinker: a step reads the row's last frame alone

    def step_embeds(self, states: list[TalkerRow], replies: torch.Tensor) -> torch.Tensor:
        codes = torch.tensor([s.last for s in states], device=self.device)[:, None, :]  # [B, 1, codebooks]
        return self.backbone.embed_tokens(codes)

    def _head(self, out) -> torch.Tensor:
        """[B, V + H]: codebook 0's logits, then the last hidden state the depth decoder starts from."""
        hidden = out.last_hidden_state[:, -1, :]
        return torch.cat([self.model.lm_head(hidden).float(), hidden.float()], dim=-1)

    def forward_step(self, embeds: torch.Tensor, positions: torch.Tensor, cache: RowsCache) -> torch.Tensor:
        mask = torch.ones(embeds.shape[0], 1, 1, 1, dtype=torch.bool, device=self.device)
        return self._head(self.backbone(inputs_embeds=embeds, position_ids=positions, cache=cache, attention_mask=mask,
                                        use_cache=True))

    def forward_prefill(self, embeds: torch.Tensor, cache) -> torch.Tensor:
        return self._head(self.backbone(inputs_embeds=embeds, cache=cache, use_cache=True))

    def frames(self, states: list[TalkerRow], logits: list[torch.Tensor]) -> list[list[int] | Exception]:
        """Each row's frame: codebook 0 from the backbone's logits with the row's sampler, the others from one
        depth-decoder ``generate`` over the rows, each drawn by the row's depth sampler (a failure there is every
        row's of the step)."""
        if not states:
            return []
        try:
            out = torch.cat(logits)
            hidden = out[:, self.vocab:].to(self.model.dtype)
            first = [s.sampler(torch.tensor([s.ids]), out[j:j + 1, :self.vocab]) for j, s in enumerate(states)]
            ids = torch.tensor([[0, c] for c in first], device=hidden.device)  # 0: the slot of the backbone's state
            made = self.model.depth_decoder.generate(
                input_ids=ids, backbone_last_hidden_state=hidden, generation_config=self.depth_config,
                logits_processor=LogitsProcessorList([RowSampling([s.extra["depth"] for s in states])]))
        except Exception as exc:
            return [exc] * len(states)
        return made[:, 1:].tolist()

    def is_end(self, state: TalkerRow, frame: list[int]) -> bool:
        return all(c == self.codebook_eos for c in frame[:-1])

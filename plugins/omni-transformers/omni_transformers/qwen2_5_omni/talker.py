"""Qwen2.5-Omni's talker on the kit's codec-LM skeleton: one code per frame, 3-axis M-RoPE
positions, the thinker's prompt + the speaker's text bos + reply 0 as its prompt, past the reply
the text end then padding."""

from __future__ import annotations

import torch

from ..kit.talker import CodecTalker, TalkerRow, ThinkerStream
from .parts import load_part


class Talker(CodecTalker):
    """Codec codes from the thinker's stream (the kit's ``CodecTalker``).

    Defaults are ``generate``'s talker settings (sampling with top_k 40, top_p 0.8, temperature
    0.9, repetition penalty 1.05; stop at codec pad or end); ``do_sample: false`` is greedy.
    ``max_batch_size``, ``kv_cache_tokens`` (reserved per request: prompt + 2 + most codes) and
    ``max_prefill_tokens`` bound the batch as for the thinker.
    """

    head_keys = ("text_bos", "text_eos", "text_pad")

    def load_model(self, path, *, dtype: str, device: str):
        return load_part(path, "talker", dtype=dtype, device=device)

    def setup(self, m) -> None:
        self.codec_bos, self.codec_pad, self.codec_mask = m.codec_bos_token, m.codec_pad_token, m.codec_mask_token
        # generate's default talker_eos_token_id is [8292, 8294]: the codec pad and end ids.
        self.eos = {m.codec_pad_token, m.codec_eos_token}
        self.suppress = [self.codec_bos]
        self.codec_embed = m.get_input_embeddings()

    def prefill_inputs(self, head: dict, reply0: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
        prompt = head["prompt"]
        if reply0 is None:  # one generated token: generate itself fails here; use the text end
            reply0 = head["text_eos"]
        prefix = torch.cat([prompt, head["text_bos"][None], reply0[None]], dim=0)
        # Only the repetition penalty reads these ids (generate passes the embeddings).
        return prefix, [self.codec_mask] * prompt.shape[0] + [self.codec_pad, self.codec_bos]

    def tail_input(self, state: TalkerRow, step: int) -> torch.Tensor:
        return state.head["text_eos"] if step == state.stream.count else state.head["text_pad"]

    def step_embeds(self, states: list[TalkerRow], replies: torch.Tensor) -> torch.Tensor:
        codes = torch.tensor([s.last[0] for s in states], dtype=torch.long, device=self.device)
        return self.model.thinker_to_talker_proj((self.codec_embed(codes) + replies)[:, None, :])

    def positions(self, states: list[TalkerRow]) -> torch.Tensor:
        return super().positions(states).view(1, -1, 1).expand(3, -1, 1)

    def forward_step(self, embeds, positions, cache) -> torch.Tensor:
        # Qwen2_5OmniTalkerForConditionalGeneration.forward for inputs_embeds without a mask.
        out = self.model.model(inputs_embeds=embeds, position_ids=positions, cache=cache,
                               attention_mask={"full_attention": None}, use_cache=True, return_dict=True)
        return self.model.codec_head(out.last_hidden_state)[:, -1, :].float()


def thinker_stream(ctx, source: str) -> ThinkerStream:
    """The kit's thinker-stream reader with this family's head tensors."""
    return ThinkerStream(ctx, source, Talker.head_keys)

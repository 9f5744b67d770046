"""Qwen3-Omni's talker on the kit's codec-LM skeleton: a step makes a frame of 16 codes, code0 from the MoE
talker and codes 1-15 from its code predictor (15 forwards on a fresh cache), the predictor batched across
the rows of the step.

The talker's prompt is what ``Qwen3OmniMoeForConditionalGeneration.generate`` builds: the user turns (text
positions through ``text_projection``, audio/image positions through ``hidden_projection``), then 9
assistant positions: ``<|im_start|>assistant\\n`` and four ``<tts_pad>``, ``<tts_text_bos>`` and the reply's
first token (``text_projection``) over the codec embeddings of nothing (3), ``nothink``, ``think_bos``,
``think_eos``, the speaker, ``codec_pad`` and ``codec_bos``. Decode step s adds to the sum of frame s-1's 16
code embeddings the reply's token s (``<tts_text_eod>`` once past the reply, ``<tts_pad>`` after), so frame
s waits for reply token s+1. code0 is picked with the repetition penalty over the codes so far and the upper
1024 ids suppressed but the end code.
"""

from __future__ import annotations

import torch

from ..kit.batched import RowsCache
from ..kit.sampling import Sampler, torch_dtype
from ..kit.talker import CodecTalker, TalkerRow
from .thinker import omni_config


def load_talker(path, *, dtype: str | None = "auto", device: str = "cpu"):
    """The talker (with its code predictor) of a whole ``qwen3_omni_moe`` checkpoint, in eval mode."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = omni_config(path)
    if not config.enable_audio_output:
        raise ValueError(f"{path} has no talker (enable_audio_output: false)")
    _merge_experts_on_load()
    # get_rope_index reads config.audio_config (its n_window) for a prompt with audio and an image; the talker's
    # config has none of its own: it is the thinker's audio tower's.
    config.talker_config.audio_config = config.thinker_config.audio_config
    want = torch_dtype(dtype)
    model = transformers.Qwen3OmniMoeTalkerForConditionalGeneration.from_pretrained(
        path, config=config.talker_config, key_mapping={r"^talker\.": ""}, local_files_only=True,
        dtype=want if want is not None else "auto")
    return model.to(device).eval()


def _merge_experts_on_load() -> None:
    """Loaded alone, the talker's checkpoint keys hold one tensor per expert (``experts.N.gate_proj``...):
    transformers merges them (as for the whole model and the thinker) only for the model types it lists, and
    the talker's is not one of them, so its experts would be left unloaded."""
    from transformers import conversion_mapping as cm

    name = "Qwen3OmniMoeTalkerForConditionalGeneration"
    if cm.get_checkpoint_conversion_mapping(name) is None:
        cm.register_checkpoint_conversion_mapping(name, cm.get_checkpoint_conversion_mapping("qwen3_omni_moe"))


class Talker(CodecTalker):
    """Frames of 16 codes from the thinker's stream (the kit's ``CodecTalker``).

    Defaults are ``generate``'s talker settings (sampling with top_k 50, temperature 0.9, repetition
    penalty 1.05; the code predictor with top_k 50, top_p 0.8); ``do_sample: false`` is greedy for both.
    A reply with no token to speak (the thinker ended at once) makes no frames; so does a first code that
    is the end code.
    """

    codebooks = 16
    head_keys = ("user", "media", "tts", "speaker", "ids", "audio_seqlens", "image_grid")

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "cpu",
                 max_new_tokens: int = 4096, do_sample: bool = True, top_k: int = 50, top_p: float = 1.0,
                 temperature: float = 0.9, repetition_penalty: float = 1.05, codes_per_chunk: int = 4,
                 predictor_top_k: int = 50, predictor_top_p: float = 0.8, **kwargs):
        self.predictor_sampling = {"top_k": predictor_top_k, "top_p": predictor_top_p}
        super().__init__(model, dtype=dtype, device=device, max_new_tokens=max_new_tokens, do_sample=do_sample,
                         top_k=top_k, top_p=top_p, temperature=temperature, repetition_penalty=repetition_penalty,
                         codes_per_chunk=codes_per_chunk, **kwargs)

    def load_model(self, path, *, dtype: str, device: str):
        return load_talker(path, dtype=dtype, device=device)

    def setup(self, m) -> None:
        c = m.config
        self.eos = {c.codec_eos_token_id}
        vocab = c.text_config.vocab_size
        self.suppress = [i for i in range(vocab - 1024, vocab) if i != c.codec_eos_token_id]
        self.codec_embed = m.get_input_embeddings()
        self.predictor = m.code_predictor
        self.assistant_codes = [c.codec_nothink_id, c.codec_think_bos_id, c.codec_think_eos_id, None,
                                c.codec_pad_id, c.codec_bos_id]
        self.tts_pad_id = omni_config(self.path).tts_pad_token_id
        self._prefilling: TalkerRow | None = None

    # -- the prompt --------------------------------------------------------------------------------------
    def prefill_inputs(self, head: dict, reply0: torch.Tensor | None) -> tuple[torch.Tensor, list[int]] | None:
        if reply0 is None:  # the thinker ended at once: nothing to speak
            return None
        m = self.model
        prompt, user, media = head["prompt"], head["user"].bool(), head["media"].bool()
        parts = torch.empty(prompt.shape[0], m.config.text_config.hidden_size, dtype=m.dtype, device=self.device)
        if media.any():
            parts[media] = m.hidden_projection(prompt[media])
        parts[~media] = m.text_projection(prompt[~media])
        tts_bos, _, tts_pad = m.text_projection(head["tts"][None]).to(self.device)[0]
        assistant = m.text_projection(torch.cat([prompt[-3:], reply0[None]])[None])[0]
        text = torch.cat([assistant[:3], tts_pad.expand(4, -1), tts_bos[None], assistant[3:4]])
        codes = list(self.assistant_codes)
        codes[3] = int(head["speaker"][0])
        codec = torch.cat([torch.zeros(3, text.shape[1], dtype=text.dtype, device=self.device),
                           self.codec_embed(torch.tensor(codes, device=self.device))])
        prefix = torch.cat([parts[user], text + codec])
        seqlens, grid = head["audio_seqlens"], head["image_grid"]
        if seqlens.numel() or grid.numel():  # M-RoPE positions over the talker's prompt ids (user turns, tts_pad)
            ids = torch.cat([head["ids"][user.to(head["ids"].device)],
                             torch.full((text.shape[0],), self.tts_pad_id, dtype=torch.long, device=self.device)])
            rope, delta = self.model.get_rope_index(
                ids[None], image_grid_thw=grid if grid.numel() else None,
                attention_mask=torch.ones(1, ids.shape[0], dtype=torch.long, device=self.device),
                audio_seqlens=seqlens if seqlens.numel() else None)
            head["positions"] = torch.cat([torch.arange(ids.shape[0], device=self.device)[None], rope[:, 0]])
            head["rope_delta"] = int(delta.reshape(-1)[0])
        # The repetition penalty reads the codes made (generate passes the prompt as embeddings only).
        return prefix, []

    def tail_input(self, state: TalkerRow, step: int) -> torch.Tensor:
        tts = state.head["tts"]
        return tts[1] if step == state.stream.count else tts[2]  # the text's end once, then padding

    def step_embeds(self, states: list[TalkerRow], replies: torch.Tensor) -> torch.Tensor:
        frames = torch.tensor([s.last for s in states], dtype=torch.long, device=self.device)
        embeds = [self.codec_embed(frames[:, :1])]
        table = self.predictor.get_input_embeddings()
        embeds += [table[g](frames[:, g + 1:g + 2]) for g in range(self.codebooks - 1)]
        return torch.cat(embeds, dim=1).sum(1, keepdim=True) + self.model.text_projection(replies[:, None])

    def positions(self, states: list[TalkerRow]) -> torch.Tensor:
        """[4, B, 1]: each row's length on the text axis, plus its prompt's M-RoPE delta on the other three."""
        text = super().positions(states).view(1, -1, 1)
        delta = torch.tensor([s.head.get("rope_delta", 0) for s in states], device=self.device).view(1, -1, 1)
        return torch.cat([text, (text + delta).expand(3, -1, 1)])

    def prefill(self, state: TalkerRow, start: int, end: int):
        self._prefilling = state  # forward_prefill reads its positions (the decode loop's one thread)
        try:
            return super().prefill(state, start, end)
        finally:
            self._prefilling = None

    # -- forwards: code0's logits with the talker's last hidden state after them (the code predictor's input) --
    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.codec_head(hidden)[:, -1, :].float()
        return torch.cat([logits, hidden[:, -1, :].float()], dim=-1)

    def forward_step(self, embeds: torch.Tensor, positions: torch.Tensor, cache: RowsCache) -> torch.Tensor:
        mask = torch.ones(embeds.shape[0], 1, 1, 1, dtype=torch.bool, device=self.device)  # rows: no padding
        out = self.model.model(inputs_embeds=embeds, position_ids=positions, cache=cache, attention_mask=mask,
                               use_cache=True)
        return self._head(out.last_hidden_state)

    def forward_prefill(self, embeds: torch.Tensor, cache) -> torch.Tensor:
        positions = None
        state = self._prefilling
        if state is not None and "positions" in state.head:
            start = cache.get_seq_length()
            positions = state.head["positions"][:, start:start + embeds.shape[1]][:, None, :]
        out = self.model.model(inputs_embeds=embeds, position_ids=positions, cache=cache, use_cache=True)
        return self._head(out.last_hidden_state)

    # -- a frame: code0, then the code predictor's 15 codes for every row at once --------------------------
    def frames(self, states: list[TalkerRow], logits: list[torch.Tensor]) -> list[list[int] | Exception]:
        vocab = self.model.config.text_config.vocab_size
        made: list = []
        for state, lg in zip(states, logits, strict=True):
            try:
                made.append(state.sampler(torch.tensor([state.ids], dtype=torch.long, device=self.device),
                                          lg[:, :vocab]))
            except Exception as exc:
                made.append(exc)
        live = [j for j, code0 in enumerate(made) if not isinstance(code0, Exception) and code0 not in states[j].eos]
        if live:
            hidden = torch.cat([logits[j][:, vocab:] for j in live]).to(self.model.dtype)
            rest = self.predict([states[j] for j in live], [made[j] for j in live], hidden)
            for j, codes in zip(live, rest, strict=True):
                made[j] = [made[j], *codes]
        return [code0 if isinstance(code0, Exception | list) else [code0] * self.codebooks for code0 in made]

    def predict(self, states: list[TalkerRow], code0: list[int], hidden: torch.Tensor) -> list[list[int]]:
        """Codes 1..15 of each row: the code predictor on [talker hidden, code0's embedding], then each code
        fed back (``...CodePredictorModelForConditionalGeneration.generate``'s forwards, B rows at once)."""
        from transformers import DynamicCache

        cp = self.predictor
        samplers = [self._predictor_sampler(s) for s in states]
        first = self.codec_embed(torch.tensor(code0, dtype=torch.long, device=self.device))
        cache = DynamicCache(config=cp.config)
        out = cp(inputs_embeds=torch.stack([hidden, first], dim=1), cache=cache, use_cache=True)
        codes: list[list[int]] = [[] for _ in states]
        for g in range(1, self.codebooks):
            scores = out.logits[:, -1, :].float()
            picks = [sampler(torch.tensor([row], dtype=torch.long, device=self.device), scores[j:j + 1])
                     for j, (sampler, row) in enumerate(zip(samplers, codes, strict=True))]
            for row, pick in zip(codes, picks, strict=True):
                row.append(pick)
            if g < self.codebooks - 1:
                ids = torch.tensor(picks, dtype=torch.long, device=self.device)[:, None]
                out = cp(input_ids=ids, cache=cache, use_cache=True, generation_steps=g)
        return codes

    def _predictor_sampler(self, state: TalkerRow) -> Sampler:
        sampler = state.extra.get("predictor")
        if sampler is None:
            sampler = state.extra["predictor"] = Sampler(do_sample=state.sampler.do_sample, **self.predictor_sampling,
                                                         generator=state.sampler.generator, device=self.device)
        return sampler

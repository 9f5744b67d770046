"""The thinker stage: text tokens, streaming per step what the talker needs."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from .common import DEFAULT_SPEAKER, omni_config, request_seed
from .models import (
    Sampler,
    TextDecoder,
    load_part,
    load_speakers,
    make_generator,
    resolve_model_path,
)


class Thinker:
    """Text generation, streaming per step the token, its text and what the talker needs.

    Greedy by default (the checkpoint's generation config decides, as in ``generate``);
    ``do_sample`` with ``temperature``/``top_k``/``top_p`` samples from a per-request generator.
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "cpu",
                 max_new_tokens: int = 1024, do_sample: bool | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, repetition_penalty: float | None = None,
                 eos_token_id: int | list[int] | None = None, speech: bool = True):
        from transformers import AutoTokenizer

        self.path = resolve_model_path(model)
        self.device = torch.device(device)
        self.model = load_part(self.path, "thinker", dtype=dtype, device=device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        gen = self.model.generation_config
        self.max_new_tokens = max_new_tokens
        self.do_sample = bool(gen.do_sample) if do_sample is None else do_sample
        self.temperature = gen.temperature if temperature is None else temperature
        self.top_k = gen.top_k if top_k is None else top_k
        self.top_p = gen.top_p if top_p is None else top_p
        self.repetition_penalty = gen.repetition_penalty if repetition_penalty is None else repetition_penalty
        eos = gen.eos_token_id if eos_token_id is None else eos_token_id
        if eos is None:
            eos = self.model.config.text_config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
        self.speech = speech
        if speech:
            config = omni_config(self.path)
            if config is None:
                raise ValueError(f"{self.path} holds the thinker alone; speech needs the whole checkpoint's "
                                 "talker ids and spk_dict.pt (or set speech: false)")
            self.text_eos_id = config.talker_config.tts_text_end_token_id
            self.text_pad_id = config.talker_config.tts_text_pad_token_id
            self.speakers = {name: int(p["bos_token"]) for name, p in load_speakers(self.path).items()}
        self.embed_tokens = self.model.get_input_embeddings()

    # -- model steps (worker threads) -------------------------------------------------
    def _forward(self, ids: list[int], cache, start: int):
        with torch.inference_mode():
            input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
            # Text only: the three M-RoPE axes and the text axis are the plain positions.
            pos = torch.arange(start, start + len(ids), device=self.device).view(1, 1, -1).expand(4, 1, -1)
            out = self.model(input_ids=input_ids, cache=cache, position_ids=pos, use_cache=True,
                             output_hidden_states=True, return_dict=True)
            # generate adds the thinker's input embedding and last hidden state for the talker
            # (in the thinker's dtype: bfloat16 stays bfloat16).
            talker_input = (out.hidden_states[0] + out.hidden_states[-1])[0]
            return out.logits[:, -1, :].float(), talker_input

    def _embeds(self, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.embed_tokens(torch.tensor(ids, dtype=torch.long, device=self.device))

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config.get_text_config())

    # -- one request ---------------------------------------------------------------------
    async def __call__(self, payload: dict, ctx) -> dict:
        prompt = list(payload["input_ids"])
        max_new = int(payload.get("max_new_tokens") or self.max_new_tokens)
        if max_new < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new}")
        sampler = Sampler(do_sample=self.do_sample, temperature=self.temperature, top_k=self.top_k,
                          top_p=self.top_p, repetition_penalty=self.repetition_penalty,
                          generator=make_generator(request_seed(payload), self.device), device=self.device)
        first: dict[str, Any] = {}
        if self.speech:
            bos = self.speakers.get(payload.get("speaker", DEFAULT_SPEAKER))
            if bos is None:
                raise ValueError(f"speaker {payload.get('speaker')!r} is not in spk_dict.pt; "
                                 f"available: {sorted(self.speakers)}")
            special = await asyncio.to_thread(self._embeds, [bos, self.text_eos_id, self.text_pad_id])
            first = {"text_bos": special[0], "text_eos": special[1], "text_pad": special[2]}
        cache = self._new_cache()
        decoder = TextDecoder(self.tokenizer)
        sequence = torch.tensor([prompt], dtype=torch.long, device=self.device)
        logits, talker_input = await asyncio.to_thread(self._forward, prompt, cache, 0)
        tokens: list[int] = []
        step = 0
        while True:
            token = sampler(sequence, logits)
            tokens.append(token)
            sequence = torch.cat([sequence, sequence.new_tensor([[token]])], dim=1)
            chunk = {"step": step, "token_id": token, "text": decoder.push(token)}
            if step == 0:
                chunk.update(first, prompt=talker_input)
            else:
                chunk["reply"] = talker_input[0]
            await ctx.emit(chunk)
            if token in self.eos or len(tokens) >= max_new:
                break
            step += 1
            logits, talker_input = await asyncio.to_thread(self._forward, [token], cache, len(prompt) + step - 1)
        await ctx.emit({"final": True, "text": decoder.flush()})
        return {"text": decoder.text(), "token_ids": tokens}


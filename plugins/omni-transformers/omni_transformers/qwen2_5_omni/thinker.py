"""The thinker stage: text tokens for every live request in one forward per step, streaming per
step what the talker needs (or, text only, the text itself)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from omni_core.decode_loop import NO_OUTPUT, DecodeLoop
from omni_core.errors import InvalidInput

from .batched import RowKV, RowsCache, crop_to, run_rows, sample, use_row_attention
from .common import DEFAULT_SPEAKER, omni_config, request_seed
from .inputs import PrefillInputs, prefill_inputs
from .models import (
    Sampler,
    TextDecoder,
    load_part,
    load_speakers,
    make_generator,
    resolve_model_path,
)


class ThinkerRow:
    """One request in the thinker's decode loop: its prompt, cache, sampler and tokens."""

    __slots__ = ("pre", "cache", "kv", "sampler", "greedy", "ids", "tokens", "max_new", "eos", "speech", "parts",
                 "seed")

    def __init__(self, pre: PrefillInputs, sampler: Sampler, max_new: int, eos: set[int], speech: bool, seed: int):
        self.pre = pre
        self.cache = None  # the prompt's DynamicCache while it is prefilled
        self.kv: RowKV | None = None  # then the row's own buffers
        self.sampler = sampler
        self.greedy = not sampler.do_sample and not sampler.processors
        self.ids = list(pre.input_ids)  # what the repetition penalty reads
        self.tokens: list[int] = []
        self.max_new = max_new
        self.eos = eos
        self.speech = speech
        self.parts: dict[int, torch.Tensor] = {}  # the talker's prompt input, per prompt chunk
        self.seed = seed

    @property
    def reserved(self) -> int:
        """KV tokens the row may fill: its prompt and every token it may feed back."""
        return self.pre.length + self.max_new


class ThinkerEngine:
    """The model, tokenizer and decode loop of one process's thinker stages (a ``thinker`` that
    feeds the talker and a text-only one share them, so their requests batch together).

    ``step`` runs in the loop's worker thread: first one batched forward for every decoding row
    (the only part that may raise, and it changes nothing but the cache slot it writes again on
    a retry), then each prompt chunk on its own (a failure is that row's), then the choice of
    each row's token with its own sampler and generator.
    """

    def __init__(self, path, *, dtype: str, device: str, max_batch_size: int, kv_cache_tokens: int | None,
                 max_prefill_tokens: int | None, name: str = "thinker"):
        from transformers import AutoTokenizer

        self.device = torch.device(device)
        self.model = load_part(path, "thinker", dtype=dtype, device=device)
        self.text_config = self.model.config.get_text_config()
        use_row_attention(self.model, self.text_config)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.embed_tokens = self.model.get_input_embeddings()
        self.loop = DecodeLoop(self.step, max_batch_size=max_batch_size, memory_budget=kv_cache_tokens,
                               max_prefill_tokens=max_prefill_tokens, name=name)

    # -- the step (worker thread) --------------------------------------------------------------
    def step(self, rows) -> list[Any]:
        with torch.inference_mode():
            results, outs = run_rows(rows, self._decode_rows, self.prefill)
            greedy = [(i, lg, t) for i, (lg, t) in outs if rows[i].state.greedy]
            if greedy:  # argmax is exact per row: one call for every greedy row
                picks = torch.argmax(torch.cat([lg for _, lg, _ in greedy]), dim=-1).tolist()
                for (i, _, talker), token in zip(greedy, picks, strict=True):
                    results[i] = self._emit(rows[i], int(token), talker)
            for i, (lg, talker) in outs:
                if rows[i].state.greedy:
                    continue
                try:
                    token = sample(rows[i].state, lg, self.device)
                except Exception as exc:
                    results[i] = exc
                    continue
                results[i] = self._emit(rows[i], token, talker)
        return results

    def _decode_rows(self, rows) -> list[tuple[torch.Tensor, torch.Tensor]]:
        logits, talker = self.decode([row.state for row in rows])
        return [(logits[j:j + 1], talker[j].clone()) for j in range(len(rows))]

    @staticmethod
    def _emit(row, token: int, talker: torch.Tensor | None):
        state = row.state
        state.tokens.append(token)
        state.ids.append(token)
        finish = None
        if token in state.eos:
            finish = "stop"
        elif len(state.tokens) >= state.max_new:
            finish = "length"
        if finish is not None:
            row.finish()
        return token, talker, finish

    def decode(self, states: list[ThinkerRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward for every decoding row: each feeds its last token at its own position."""
        ids = torch.tensor([s.tokens[-1] for s in states], dtype=torch.long, device=self.device)
        # Decode step k of a reply sits at L + k + rope_delta on every M-RoPE axis (and the text axis).
        pos = torch.tensor([s.kv.length + s.pre.rope_delta for s in states], device=self.device)
        cache = RowsCache([s.kv for s in states])
        out = self.model(inputs_embeds=self.embed_tokens(ids)[:, None, :], position_ids=pos.view(1, -1, 1).expand(4, -1, 1),
                         cache=cache, attention_mask={"full_attention": None}, use_cache=True,
                         output_hidden_states=True, return_dict=True)
        cache.advance()
        # generate adds the thinker's input embedding and last hidden state for the talker
        # (in the thinker's dtype: bfloat16 stays bfloat16).
        return out.logits[:, -1, :].float(), (out.hidden_states[0] + out.hidden_states[-1])[:, 0]

    def prefill(self, state: ThinkerRow, start: int, end: int):
        """Run prompt tokens [start, end) of one row; after the last chunk, its first logits."""
        from transformers import DynamicCache

        if start == 0 or state.cache is None:
            state.cache = DynamicCache(config=self.text_config)
        crop_to(state.cache, start)  # the same chunk again (a retried step) starts from the same cache
        pre = state.pre
        out = self.model(inputs_embeds=pre.inputs_embeds[start:end][None],
                         position_ids=pre.position_ids[:, start:end][:, None, :], cache=state.cache,
                         use_cache=True, output_hidden_states=state.speech, return_dict=True)
        if state.speech:
            embeds = out.hidden_states[0]
            if pre.media_mask is not None:  # generate zeroes the audio/image positions of the embeddings
                embeds = embeds.masked_fill(pre.media_mask[start:end].to(embeds.device)[None, :, None], 0)
            state.parts[start] = (embeds + out.hidden_states[-1])[0]
        if end < pre.length:
            return NO_OUTPUT
        state.kv = RowKV(state.cache, state.reserved)
        state.cache = None
        talker = torch.cat([state.parts[k] for k in sorted(state.parts)]) if state.speech else None
        state.parts = {}
        return out.logits[:, -1, :].float(), talker

    def embeds(self, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.embed_tokens(torch.tensor(ids, dtype=torch.long, device=self.device))


_ENGINES: dict[tuple, ThinkerEngine] = {}


class Thinker:
    """Text generation for every live request of the stage process in one forward per step,
    streaming per step the token, its text and what the talker needs.

    Greedy by default (the checkpoint's generation config decides, as in ``generate``);
    ``do_sample`` with ``temperature``/``top_k``/``top_p`` samples from a per-request generator.
    ``speech: false`` makes a text-only thinker: it needs no talker ids, streams ``{"text",
    "token_ids"}`` chunks for the caller and is meant to be terminal. Batching: ``max_batch_size``
    rows decode together; ``kv_cache_tokens`` bounds the KV tokens their reservations (prompt +
    ``max_new_tokens``) hold together, a request waits for room otherwise; ``max_prefill_tokens``
    is the most prompt tokens one step runs (a longer prompt is spread over steps while the
    others decode). Thinker stages of one process with the same model and settings share one
    model and one decode loop.
    """

    engine_class = ThinkerEngine

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "cpu",
                 max_new_tokens: int = 1024, do_sample: bool | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, repetition_penalty: float | None = None,
                 eos_token_id: int | list[int] | None = None, speech: bool = True, max_batch_size: int = 64,
                 kv_cache_tokens: int | None = 262144, max_prefill_tokens: int | None = 512):
        self.path = resolve_model_path(model)
        self.device = torch.device(device)
        key = (type(self).engine_class, str(self.path.resolve()), dtype, str(self.device), max_batch_size,
               kv_cache_tokens, max_prefill_tokens)
        engine = _ENGINES.get(key)
        if engine is None:
            engine = _ENGINES[key] = type(self).engine_class(
                self.path, dtype=dtype, device=device, max_batch_size=max_batch_size,
                kv_cache_tokens=kv_cache_tokens, max_prefill_tokens=max_prefill_tokens)
        self.engine = engine
        self.model = engine.model
        self.tokenizer = engine.tokenizer
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

    def _prepare(self, payload: dict, speaker_bos: int | None) -> tuple[PrefillInputs, dict]:
        """Worker thread: the prompt's inputs, and (speech) the talker's special embeddings."""
        pre = prefill_inputs(self.model, payload, self.device)
        if speaker_bos is None:
            return pre, {}
        special = self.engine.embeds([speaker_bos, self.text_eos_id, self.text_pad_id])
        return pre, {"text_bos": special[0], "text_eos": special[1], "text_pad": special[2]}

    def new_row(self, pre: PrefillInputs, payload: dict, max_new: int) -> ThinkerRow:
        seed = request_seed(payload)
        sampler = Sampler(do_sample=self.do_sample, temperature=self.temperature, top_k=self.top_k,
                          top_p=self.top_p, repetition_penalty=self.repetition_penalty,
                          generator=make_generator(seed, self.device), device=self.device)
        return ThinkerRow(pre, sampler, max_new, self.eos, self.speech, seed)

    async def __call__(self, payload: dict, ctx) -> dict:
        max_new = payload.get("max_new_tokens") or self.max_new_tokens
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise InvalidInput(f"max_new_tokens must be a positive integer, got {max_new!r}", field="max_new_tokens")
        bos = None
        if self.speech:
            bos = self.speakers.get(payload.get("speaker", DEFAULT_SPEAKER))
            if bos is None:
                raise InvalidInput(f"speaker {payload.get('speaker')!r} is not in spk_dict.pt; "
                                   f"available: {sorted(self.speakers)}", field="speaker")
        pre, first = await asyncio.to_thread(self._prepare, payload, bos)
        row = self.new_row(pre, payload, max_new)
        budget = self.engine.loop.memory_budget
        if budget is not None and row.reserved > budget:  # it could never be admitted: the caller asked too much
            raise InvalidInput(f"the prompt ({pre.length} tokens) and max_new_tokens ({max_new}) need {row.reserved} "
                               f"tokens of KV cache, more than this model holds for one request ({budget}, "
                               "kv_cache_tokens): shorten the prompt or ask for fewer tokens", field="max_new_tokens")
        decoder = TextDecoder(self.tokenizer)
        finish_reason = "length"
        tokens: list[int] = []
        async with self.engine.loop.join(row, prompt_tokens=pre.length, memory=row.reserved) as seq:
            async for token, talker, finish in seq:
                step = len(tokens)
                tokens.append(token)
                text = decoder.push(token)
                if not self.speech:
                    chunk = {"text": text, "token_ids": [token]}
                elif step == 0:
                    chunk = {"step": 0, "token_id": token, "text": text, **first, "prompt": talker}
                else:
                    chunk = {"step": step, "token_id": token, "text": text, "reply": talker}
                await ctx.emit(chunk)
                if finish is not None:
                    finish_reason = finish
        tail = decoder.flush()
        usage = {"prompt_tokens": pre.length, "completion_tokens": len(tokens), "finish_reason": finish_reason}
        if self.speech:  # the talker passes the counts on to token2wav, whose result carries them
            await ctx.emit({"final": True, "text": tail, **usage})
        elif tail:
            await ctx.emit({"text": tail, "token_ids": []})
        return {"text": decoder.text(), "token_ids": tokens, **usage}

    async def close(self) -> None:
        await self.engine.loop.close()

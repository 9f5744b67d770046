"""The thinker skeleton: text tokens for every live request in one forward per step (one decode
loop, per-row KV), streaming per step the text, or what a talker needs.

A family subclasses :class:`ThinkerEngine` and :class:`Thinker` and fills the hooks:

- ``ThinkerEngine.load_model(path, dtype, device)``: its model (default ``AutoModelForCausalLM``);
  ``position_axes`` (1; a multimodal rotary embedding has more); ``hands_off``: whether the
  forward must return hidden states for ``step_conditioning(out)`` / ``prompt_conditioning(out,
  state, start, end)`` (what a talker reads per generated token and over the prompt);
  ``decode_mask(n)``: the ``attention_mask`` of a batched decode step;
- ``Thinker.prefill_inputs(payload)`` (worker thread): the prompt as :class:`PrefillInputs`
  (default: ``input_ids``, positions ``0..L-1``);
- ``Thinker.setup_speech()``: what a thinker feeding a talker needs (else speech is refused);
  ``Thinker.speech_head(payload)`` (event loop) and ``Thinker.head_extra(payload, head)`` (worker
  thread): the family's extra tensors of the first chunk (:class:`~.chunks.ThinkerHead`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
import torch
from omni_core.errors import InvalidInput
from omni_core.kits import NO_OUTPUT, DecodeLoop

from .batched import RowKV, RowsCache, crop_to, run_rows, sample, use_row_attention
from .chunks import TextChunk, ThinkerEnd, ThinkerHead, ThinkerStep
from .engines import EngineRegistry
from .sampling import (
    Sampler,
    TextDecoder,
    make_generator,
    request_sampling,
    resolve_model_path,
    sampling_for,
    torch_dtype,
)
from .streams import request_seed


@attrs.frozen
class PrefillInputs:
    """One request's prompt, ready for the thinker's forward.

    ``input_ids``: the prompt's token ids (L of them). ``inputs_embeds``: [L, H] input embeddings
    (a family splices audio/image features in). ``position_ids``: [A, L], A = the engine's
    ``position_axes`` (for a multimodal rotary embedding, the text axis then its axes).
    ``rope_delta``: decode step k of the reply (k = 0 for the first fed token) sits at position
    ``L + k + rope_delta`` on every axis. ``media_mask``: [L] bool, true at media placeholders (None
    without media), for a family's ``prompt_conditioning``.
    """

    input_ids: list[int]
    inputs_embeds: torch.Tensor
    position_ids: torch.Tensor
    rope_delta: int = 0
    media_mask: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return len(self.input_ids)


def text_prefill(model, payload: dict, device, axes: int = 1) -> PrefillInputs:
    """A text prompt (``input_ids``) as :class:`PrefillInputs`: embeddings and positions ``0..L-1``."""
    ids = payload.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("the thinker's payload needs 'input_ids', a non-empty list of ints")
    with torch.inference_mode():
        embeds = model.get_input_embeddings()(torch.tensor(ids, dtype=torch.long, device=device))
    positions = torch.arange(len(ids), device=device).view(1, -1).expand(axes, -1)
    return PrefillInputs(input_ids=list(ids), inputs_embeds=embeds, position_ids=positions)


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

    #: Axes of the position ids (a multimodal rotary embedding has more than one).
    position_axes = 1
    #: Whether the forward returns hidden states for a talker (``step_conditioning``, ``prompt_conditioning``).
    hands_off = False

    def __init__(self, path, *, dtype: str, device: str, max_batch_size: int, kv_cache_tokens: int | None,
                 max_prefill_tokens: int | None, name: str = "thinker"):
        from transformers import AutoTokenizer

        self.device = torch.device(device)
        self.model = self.load_model(path, dtype=dtype, device=device)
        self.text_config = self.model.config.get_text_config()
        use_row_attention(self.model, self.text_config)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.embed_tokens = self.model.get_input_embeddings()
        self.loop = DecodeLoop(self.step, max_batch_size=max_batch_size, memory_budget=kv_cache_tokens,
                               max_prefill_tokens=max_prefill_tokens, name=name)

    # -- hooks -----------------------------------------------------------------------------------
    def load_model(self, path, *, dtype: str, device: str):
        """The thinker's model, in eval mode on ``device``."""
        import transformers

        want = torch_dtype(dtype)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                                  dtype=want if want is not None else "auto")
        return model.to(device).eval()

    def decode_mask(self, n: int):
        """The ``attention_mask`` of a batched decode step of ``n`` rows. The rows' attention needs
        none (``omni_rows`` attends over each row's exact length); a 4-D one is taken as given."""
        return torch.ones(n, 1, 1, 1, dtype=torch.bool, device=self.device)

    def step_conditioning(self, out) -> torch.Tensor | None:
        """[B, H]: what a talker reads of each row's decode step (``hands_off`` engines)."""
        return None

    def prompt_conditioning(self, out, state, start: int, end: int) -> torch.Tensor | None:
        """[end - start, H]: what a talker reads of a prompt chunk (``hands_off`` engines)."""
        return None

    def _positions(self, positions: torch.Tensor) -> torch.Tensor:
        """[A, n] positions of one row as the model takes them: [1, n], or [A, 1, n] with several axes."""
        return positions if self.position_axes == 1 else positions[:, None, :]

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
        return [(logits[j:j + 1], None if talker is None else talker[j].clone()) for j in range(len(rows))]

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

    def decode(self, states: list[ThinkerRow]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward for every decoding row: each feeds its last token at its own position."""
        ids = torch.tensor([s.tokens[-1] for s in states], dtype=torch.long, device=self.device)
        # Decode step k of a reply sits at L + k + rope_delta on every position axis.
        pos = torch.tensor([s.kv.length + s.pre.rope_delta for s in states], device=self.device)
        axes = self.position_axes
        cache = RowsCache([s.kv for s in states])
        out = self.model(inputs_embeds=self.embed_tokens(ids)[:, None, :],
                         position_ids=pos.view(-1, 1) if axes == 1 else pos.view(1, -1, 1).expand(axes, -1, 1),
                         cache=cache, attention_mask=self.decode_mask(len(states)), use_cache=True,
                         output_hidden_states=self.hands_off, return_dict=True)
        cache.advance()
        return out.logits[:, -1, :].float(), self.step_conditioning(out)

    def prefill(self, state: ThinkerRow, start: int, end: int):
        """Run prompt tokens [start, end) of one row; after the last chunk, its first logits."""
        from transformers import DynamicCache

        if start == 0 or state.cache is None:
            state.cache = DynamicCache(config=self.text_config)
        crop_to(state.cache, start)  # the same chunk again (a retried step) starts from the same cache
        pre = state.pre
        out = self.model(inputs_embeds=pre.inputs_embeds[start:end][None],
                         position_ids=self._positions(pre.position_ids[:, start:end]), cache=state.cache,
                         use_cache=True, output_hidden_states=state.speech, return_dict=True)
        if state.speech:
            state.parts[start] = self.prompt_conditioning(out, state, start, end)
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

    async def close(self) -> None:
        """Close the decode loop (the registry calls it when the engine's last stage closed)."""
        await self.loop.close()


class Thinker:
    """Text generation for every live request of the stage process in one forward per step,
    streaming per step the token, its text and (``speech``) what the talker needs.

    Greedy by default (the checkpoint's generation config decides, as in ``generate``);
    ``do_sample`` with ``temperature``/``top_k``/``top_p`` samples from a per-request generator; a
    request's own ``temperature`` / ``top_p`` / ``top_k`` override them for it (a temperature of 0:
    greedy; see :func:`~.sampling.request_sampling`).
    ``speech: false`` makes a text-only thinker: it streams :class:`~.chunks.TextChunk` chunks for
    the caller and is meant to be terminal. Batching: ``max_batch_size`` rows decode together;
    ``kv_cache_tokens`` bounds the KV tokens their reservations (prompt + ``max_new_tokens``) hold
    together, a request waits for room otherwise; ``max_prefill_tokens`` is the most prompt tokens
    one step runs (a longer prompt is spread over steps while the others decode). Thinker stages
    of one process with the same model and settings share one engine (model and decode loop),
    counted by an :class:`~.engines.EngineRegistry` (``engines``, else the process's): the last
    stage to close closes it.
    """

    engine_class = ThinkerEngine
    #: The family's extra tensors in the first speech chunk (``speech_head`` makes them).
    head_keys: tuple[str, ...] = ()

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "cpu",
                 max_new_tokens: int = 1024, do_sample: bool | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, repetition_penalty: float | None = None,
                 eos_token_id: int | list[int] | None = None, speech: bool = False, max_batch_size: int = 64,
                 kv_cache_tokens: int | None = 262144, max_prefill_tokens: int | None = 512,
                 engines: EngineRegistry | None = None):
        self.path = resolve_model_path(model)
        self.device = torch.device(device)
        self.engines = engines if engines is not None else EngineRegistry.process()
        self.engine_key = (type(self).engine_class, str(self.path.resolve()), dtype, str(self.device),
                           max_batch_size, kv_cache_tokens, max_prefill_tokens)
        engine = self.engines.acquire(self.engine_key, lambda: type(self).engine_class(
            self.path, dtype=dtype, device=device, max_batch_size=max_batch_size,
            kv_cache_tokens=kv_cache_tokens, max_prefill_tokens=max_prefill_tokens))
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
            eos = engine.text_config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
        self.speech = speech
        self._closed = False
        if speech:
            self.setup_speech()

    # -- hooks -----------------------------------------------------------------------------------
    def setup_speech(self) -> None:
        """What feeding a talker needs (ids, speakers); the skeleton alone has no talker hand-off."""
        raise ValueError(f"{type(self).__name__} cannot feed a talker; set speech: false")

    def speech_head(self, payload: dict) -> Any:
        """Event loop, before the prompt: check the request's speech options (raise
        ``InvalidInput`` naming the field) and return what ``head_extra`` needs."""
        return None

    def head_extra(self, payload: dict, head: Any) -> dict[str, torch.Tensor]:
        """Worker thread: the family's extra tensors of the first speech chunk (keys ``head_keys``)."""
        return {}

    def prefill_inputs(self, payload: dict) -> PrefillInputs:
        """Worker thread: the prompt of ``payload`` as model inputs."""
        return text_prefill(self.model, payload, self.device, self.engine.position_axes)

    # -- the call ----------------------------------------------------------------------------------
    def _prepare(self, payload: dict, head: Any) -> tuple[PrefillInputs, dict]:
        pre = self.prefill_inputs(payload)
        return pre, (self.head_extra(payload, head) if self.speech else {})

    def new_row(self, pre: PrefillInputs, payload: dict, max_new: int) -> ThinkerRow:
        seed = request_seed(payload)
        settings = sampling_for(request_sampling(payload), do_sample=self.do_sample, temperature=self.temperature,
                                top_k=self.top_k, top_p=self.top_p)
        sampler = Sampler(**settings, repetition_penalty=self.repetition_penalty,
                          generator=make_generator(seed, self.device), device=self.device)
        return ThinkerRow(pre, sampler, max_new, self.eos, self.speech, seed)

    async def __call__(self, payload: dict, ctx) -> dict:
        max_new = payload.get("max_new_tokens") or self.max_new_tokens
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise InvalidInput(f"max_new_tokens must be a positive integer, got {max_new!r}", field="max_new_tokens")
        head = self.speech_head(payload) if self.speech else None
        pre, extra = await asyncio.to_thread(self._prepare, payload, head)
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
                    chunk: Any = TextChunk(text, [token])
                elif step == 0:
                    chunk = ThinkerHead(token, text, talker, extra)
                else:
                    chunk = ThinkerStep(step, token, text, talker)
                await ctx.emit(chunk.to_wire())
                if finish is not None:
                    finish_reason = finish
        tail = decoder.flush()
        usage = {"prompt_tokens": pre.length, "completion_tokens": len(tokens), "finish_reason": finish_reason}
        if self.speech:  # the talker passes the counts on to the vocoder, whose result carries them
            await ctx.emit(ThinkerEnd(tail, usage).to_wire())
        elif tail:
            await ctx.emit(TextChunk(tail).to_wire())
        return {"text": decoder.text(), "token_ids": tokens, **usage}

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self.engines.release(self.engine_key)

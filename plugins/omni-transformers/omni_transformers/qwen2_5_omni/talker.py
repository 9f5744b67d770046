"""The talker stage: codec codes from the thinker's live stream, every live request of the
process in one forward per step."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from omni_core.decode_loop import NO_OUTPUT, DecodeLoop

from ..kit.batched import RowKV, RowsCache, crop_to, run_rows, sample, use_row_attention
from ..kit.chunks import CodesChunk, TextChunk, ThinkerEnd, ThinkerHead, thinker_chunk
from ..kit.sampling import Sampler, make_generator, resolve_model_path
from .common import USAGE_KEYS, StreamProgress, request_seed
from .parts import load_part

#: The thinker's extra tensors in its first chunk (the Qwen2.5-Omni thinker's ``head_keys``).
HEAD_KEYS = ("text_bos", "text_eos", "text_pad")


class TalkerRow:
    """One request in the talker's decode loop: its prefix, cache, sampler and codes."""

    __slots__ = ("prefix", "cache", "kv", "sampler", "ids", "last", "generated", "max_new", "eos", "stream",
                 "text_eos", "text_pad", "seed")

    def __init__(self, prefix: torch.Tensor, ids: list[int], sampler: Sampler, max_new: int, eos: set[int],
                 stream: _ThinkerStream, text_eos: torch.Tensor, text_pad: torch.Tensor, seed: int):
        self.prefix = prefix  # [L + 2, E]: the thinker's prompt, the speaker's text bos, reply 0
        self.cache = None
        self.kv: RowKV | None = None
        self.sampler = sampler
        self.ids = ids  # what the repetition penalty reads: the prefix's codec ids, then the codes
        self.last = -1
        self.generated = 0
        self.max_new = max_new
        self.eos = eos
        self.stream = stream
        self.text_eos, self.text_pad = text_eos, text_pad
        self.seed = seed

    @property
    def reserved(self) -> int:
        return self.prefix.shape[0] + self.max_new


class Talker:
    """Codec codes from the thinker's stream, consumed while the thinker generates; the rows of
    every live request advance together, one forward per step. A row advances when the thinker's
    input for its step has arrived (or the thinker's reply ended: its text end, then padding); a
    row whose input is late skips the step without holding the others.

    Defaults are ``generate``'s talker settings (sampling with top_k 40, top_p 0.8, temperature
    0.9, repetition penalty 1.05; stop at codec pad or end); ``do_sample: false`` is greedy.
    ``max_batch_size``, ``kv_cache_tokens`` (reserved per request: prompt + 2 + most codes) and
    ``max_prefill_tokens`` bound the batch as for the thinker.
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "cpu",
                 max_new_tokens: int = 4096, do_sample: bool = True, top_k: int = 40, top_p: float = 0.8,
                 temperature: float = 0.9, repetition_penalty: float = 1.05,
                 eos_token_id: list[int] | None = None, codes_per_chunk: int = 16, source: str = "thinker",
                 max_batch_size: int = 64, kv_cache_tokens: int | None = 524288,
                 max_prefill_tokens: int | None = 512):
        self.path = resolve_model_path(model)
        self.device = torch.device(device)
        self.model = load_part(self.path, "talker", dtype=dtype, device=device)
        m = self.model
        use_row_attention(m, m.config)
        self.codec_bos, self.codec_pad, self.codec_mask = m.codec_bos_token, m.codec_pad_token, m.codec_mask_token
        # generate's default talker_eos_token_id is [8292, 8294]: the codec pad and end ids.
        self.eos = set(eos_token_id if eos_token_id is not None else [m.codec_pad_token, m.codec_eos_token])
        self.max_new_tokens = max_new_tokens
        self.sampling = {"do_sample": do_sample, "top_k": top_k, "top_p": top_p, "temperature": temperature,
                         "repetition_penalty": repetition_penalty}
        self.codes_per_chunk = max(1, int(codes_per_chunk))
        self.source = source
        self.codec_embed = m.get_input_embeddings()
        self.loop = DecodeLoop(self.step, max_batch_size=max_batch_size, memory_budget=kv_cache_tokens,
                               max_prefill_tokens=max_prefill_tokens, name="talker")

    # -- the step (worker thread) --------------------------------------------------------------
    def step(self, rows) -> list[Any]:
        with torch.inference_mode():
            results, outs = run_rows(rows, self._decode_rows, self.prefill)
            for i, lg in outs:
                state = rows[i].state
                try:
                    code = sample(state, lg, self.device)
                except Exception as exc:
                    results[i] = exc
                    continue
                state.generated += 1
                state.ids.append(code)
                if code in state.eos:
                    rows[i].finish()
                    results[i] = None
                    continue
                state.last = code
                if state.generated >= state.max_new:
                    rows[i].finish()
                results[i] = code
        return results

    def _decode_rows(self, rows) -> list[torch.Tensor]:
        logits = self.decode(rows)
        return [logits[j:j + 1] for j in range(len(rows))]

    def _reply(self, row) -> torch.Tensor:
        """The thinker input of this decode step: the fed reply, or past the reply's end its
        text end (first) then padding."""
        if row.input is not None:
            return row.input
        step = row.decoded + 1  # decode step k reads the thinker's reply k (reply 0 is in the prefix)
        return row.state.text_eos if step == row.state.stream.count else row.state.text_pad

    def decode(self, rows) -> torch.Tensor:
        """One forward for every decoding row: its last code + its thinker input, at its own position."""
        states = [row.state for row in rows]
        m = self.model
        codes = torch.tensor([s.last for s in states], dtype=torch.long, device=self.device)
        replies = torch.stack([self._reply(row).to(self.device) for row in rows])
        embeds = (self.codec_embed(codes) + replies)[:, None, :]
        pos = torch.tensor([s.kv.length for s in states], device=self.device).view(1, -1, 1).expand(3, -1, 1)
        cache = RowsCache([s.kv for s in states])
        # Qwen2_5OmniTalkerForConditionalGeneration.forward for inputs_embeds without a mask.
        out = m.model(inputs_embeds=m.thinker_to_talker_proj(embeds), position_ids=pos, cache=cache,
                      attention_mask={"full_attention": None}, use_cache=True, return_dict=True)
        cache.advance()
        return m.codec_head(out.last_hidden_state)[:, -1, :].float()

    def prefill(self, state: TalkerRow, start: int, end: int):
        from transformers import DynamicCache

        if start == 0 or state.cache is None:
            state.cache = DynamicCache(config=self.model.config)
        crop_to(state.cache, start)
        out = self.model(inputs_embeds=state.prefix[start:end][None], cache=state.cache, use_cache=True,
                         return_dict=True)
        if end < state.prefix.shape[0]:
            return NO_OUTPUT
        state.kv = RowKV(state.cache, state.reserved)
        state.cache = None
        return out.logits[:, -1, :]

    async def __call__(self, payload: dict, ctx) -> dict:
        from omni_core import PENDING

        if payload is PENDING:  # started on the thinker's first chunk (can_accept_stream_before_payload)
            payload = await ctx.payload()
        seed = request_seed(payload)
        max_new = int(payload.get("talker_max_new_tokens") or self.max_new_tokens)
        generator = make_generator(seed, self.device)
        sampling = dict(self.sampling)
        if payload.get("talker_do_sample") is not None:
            sampling["do_sample"] = bool(payload["talker_do_sample"])
        sampler = Sampler(**sampling, suppress_tokens=[self.codec_bos], generator=generator, device=self.device)
        stream = _ThinkerStream(ctx, self.source)
        reader = asyncio.create_task(stream.read())
        try:
            first = await stream.first()
            prompt, eos_e, pad_e = first["prompt"], first["text_eos"], first["text_pad"]
            reply0 = await stream.reply(0)
            if reply0 is None:  # one generated token: generate itself fails here; use the text end
                reply0 = eos_e
            prefix = torch.cat([prompt.to(self.device), first["text_bos"].to(self.device)[None],
                                reply0.to(self.device)[None]], dim=0)
            # Only the repetition penalty reads these ids (generate passes the embeddings).
            ids = [self.codec_mask] * prompt.shape[0] + [self.codec_pad, self.codec_bos]
            row = TalkerRow(prefix, ids, sampler, max_new, self.eos, stream, eos_e.to(self.device),
                            pad_e.to(self.device), seed)
            codes: list[int] = []
            pending: list[int] = []
            async with self.loop.join(row, prompt_tokens=prefix.shape[0], memory=row.reserved,
                                      needs_input=True) as seq:
                stream.attach(seq, self.device)
                async for code in seq:
                    if code is None:  # an end code
                        break
                    codes.append(code)
                    pending.append(code)
                    if len(pending) >= self.codes_per_chunk:
                        await ctx.emit(CodesChunk(pending).to_wire())
                        pending = []
            await reader  # the whole text reaches the caller before the last codes
            # The RNG state as bytes: a few bytes of msgpack, no relay transfer.
            await ctx.emit(CodesChunk(pending, final=True,
                                      rng_state=generator.get_state().numpy().tobytes()).to_wire())
            return {"codes": codes}
        finally:
            if not reader.done():
                reader.cancel()

    async def close(self) -> None:
        await self.loop.close()


class _ThinkerStream(StreamProgress):
    """Reads the thinker's stream for one talker call: forwards text at once, keeps the talker
    inputs. ``reply(j)`` is the thinker input for generated token j, or None past the last one."""

    def __init__(self, ctx, source: str):
        super().__init__(source)
        self.ctx = ctx
        self.head: dict | None = None
        self.replies: list[torch.Tensor] = []
        self.sink = None  # the talker row fed with replies 1, 2, ... once it joined the loop
        self.device: torch.device | None = None

    def attach(self, seq, device: torch.device) -> None:
        """Feed ``seq`` the replies after the first (those already here, then each as it comes)
        and close its inputs when the thinker's stream ends (or stop it if reading failed)."""
        self.device = device
        for reply in self.replies[1:]:
            seq.feed(reply.to(device))
        self.sink = seq
        if self.ended:
            self._end_sink()

    def _end_sink(self) -> None:
        if self.error is not None:
            self.sink.finish()  # the talker's call then raises the reader's error
        else:
            self.sink.close_inputs()

    @property
    def count(self) -> int:
        return len(self.replies)

    async def _read(self) -> None:
        expect = 0
        async for wire in self.ctx.stream_from(self.source):
            chunk = thinker_chunk(wire, HEAD_KEYS)
            if isinstance(chunk, ThinkerEnd):
                # The thinker's counts (prompt_tokens, completion_tokens, finish_reason) go on
                # with its last text, for token2wav's result.
                usage = {k: chunk.usage[k] for k in USAGE_KEYS if k in chunk.usage}
                if chunk.text:
                    await self.ctx.emit(TextChunk(chunk.text, [], usage).to_wire())
                elif usage:
                    await self.ctx.emit(usage)
                continue
            if chunk.step != expect:
                raise RuntimeError(f"the {self.source} stream is out of order: chunk {chunk.step} "
                                   f"arrived where {expect} was due")
            expect += 1
            if isinstance(chunk, ThinkerHead):
                self.head = {"prompt": chunk.prompt.clone(), **{k: chunk.extra[k].clone() for k in HEAD_KEYS}}
            else:
                self.replies.append(chunk.reply.clone())
                if self.sink is not None and len(self.replies) > 1:
                    self.sink.feed(self.replies[-1].to(self.device))
            self.changed.set()
            await self.ctx.emit(TextChunk(chunk.text, [chunk.token_id]).to_wire())
        if expect == 0:
            raise RuntimeError(f"the {self.source} stream ended before its first chunk")

    def _on_end(self) -> None:
        if self.sink is not None:
            self._end_sink()

    async def first(self) -> dict:
        await self.wait(lambda: self.head is not None)
        if self.head is None:
            raise RuntimeError(f"the {self.source} stream ended before its first chunk")
        return self.head

    async def reply(self, j: int) -> torch.Tensor | None:
        await self.wait(lambda: len(self.replies) > j)
        if self.error is not None:
            raise RuntimeError(f"reading the {self.source} stream failed: {self.error!r}") from self.error
        return self.replies[j] if len(self.replies) > j else None


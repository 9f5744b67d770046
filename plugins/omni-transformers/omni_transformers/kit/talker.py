"""The codec-LM talker skeleton: codec codes from the thinker's live stream, every live request of
the process in one forward per step (``omni_core.DecodeLoop``), one *frame* of codes per step.

A family subclasses :class:`CodecTalker` and fills its hooks:

- ``load_model(path, *, dtype, device)``: its talker part (a module whose attention the kit's row
  KV buffers can drive: ``use_row_attention`` is applied to it);
- ``setup(model)``: the codec ids it needs (``self.eos``: the end codes, ``self.suppress``:
  codes the sampler never draws);
- ``prefill_inputs(head, reply0)``: the talker's prompt from the thinker's step 0 (``head``: the
  prompt's conditioning ``head["prompt"]`` [L, H] and the family's ``head_keys`` tensors) and the
  conditioning of the thinker's first generated token: ``(prefix [P, E], ids)``, ``ids`` what the
  repetition penalty reads for the prefix; or None when there is nothing to speak (no frames);
- ``tail_input(state, step)``: the thinker input of a step past the thinker's reply (for example its
  text end, then padding);
- ``step_embeds(states, replies)``: the decode step's input [B, 1, E] from each row's last frame
  (``state.last``) and the thinker's conditioning of that step (``replies`` [B, H]);
- ``positions(states)``: the decode step's position ids (default: each row's length, one axis);
- ``forward_step(embeds, positions, cache)``: one forward of the decoding rows → logits [B, V] of
  the first codebook (``cache`` the rows' KV, a ``RowsCache``);
- ``forward_prefill(embeds, cache)``: the prefill's forward → logits [1, V] of its last position;
- ``frame(state, logits)``: one step → one frame of ``codebooks`` codes (default: the first
  codebook sampled with the row's sampler; a multi-codebook talker draws the others here, e.g.
  with a code predictor); ``frames(states, logits)``: the frames of all the rows of a step
  (default: with the default ``frame``, the first codebook of every row in one batched sampler
  call, ``kit.sampling.sample_rows``, the same codes as each row's sampler alone; with a family's
  own ``frame``, that on each; a code predictor batched across the rows overrides it);
- ``is_end(state, frame)``: whether a frame ends the row instead of being spoken (default: its
  first code is in ``self.eos``; a family whose end is, say, all codebooks 0 says so here).

The stage streams :class:`~omni_transformers.kit.chunks.CodesChunk` frames and returns
``{"codes": [...]}`` (frame-major). A chunk goes out when the frames so far reach
``first_codes_per_chunk`` (1), twice that, and so on (a vocoder can start on the first frame at
once), then every ``codes_per_chunk`` frames.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import torch
from omni_core.kits import NO_OUTPUT, DecodeLoop

from .batched import RowKV, RowsCache, crop_to, run_rows, sample, use_row_attention
from .chunks import CodesChunk, TextChunk, ThinkerEnd, ThinkerHead, thinker_chunk
from .sampling import Sampler, make_generator, resolve_model_path, sample_rows
from .streams import USAGE_KEYS, StreamProgress, request_seed
from .vocoder import FIRST_CHUNKS


class TalkerRow:
    """One request in the talker's decode loop: its prefix, cache, sampler and codes."""

    __slots__ = ("prefix", "cache", "kv", "sampler", "ids", "last", "generated", "max_new", "eos", "stream",
                 "head", "seed", "extra")

    def __init__(self, prefix: torch.Tensor, ids: list[int], sampler: Sampler, max_new: int, eos: set[int],
                 stream: ThinkerStream, head: dict, seed: int):
        self.prefix = prefix  # [P, E]: the talker's prompt
        self.cache = None
        self.kv: RowKV | None = None
        self.sampler = sampler
        self.ids = ids  # what the repetition penalty reads: the prefix's ids, then the first codebook's codes
        self.last: list[int] = []  # the last frame
        self.generated = 0
        self.max_new = max_new
        self.eos = eos
        self.stream = stream
        self.head = head  # the thinker's step 0 (on the talker's device)
        self.seed = seed
        self.extra: dict = {}  # what a family's hooks keep per row

    @property
    def reserved(self) -> int:
        return self.prefix.shape[0] + self.max_new


class CodecTalker:
    """Codec codes from the thinker's stream, consumed while the thinker generates; the rows of
    every live request advance together, one forward per step. A row advances when the thinker's
    input for its step has arrived (or the thinker's reply ended: ``tail_input``); a row whose
    input is late skips the step without holding the others.

    ``max_batch_size``, ``kv_cache_tokens`` (reserved per request: prompt + most frames) and
    ``max_prefill_tokens`` bound the batch as for the thinker; a chunk of frames goes out when the
    frames so far reach ``first_codes_per_chunk`` (1), then twice as many, and so on, then every
    ``codes_per_chunk`` frames (``first_codes_per_chunk`` = ``codes_per_chunk``: equal chunks);
    ``talker_max_new_tokens`` and ``talker_do_sample`` in a request override the stage's.
    ``yield_to_first_audio``: while a vocoder in this process makes a request's first chunk, a
    step waits for it up to that many seconds (0: never; default 0.25 on CPU, where the two share
    the interpreter lock, else 0; ``kit.vocoder.FirstChunkGate``)."""

    #: codes per frame (1: one codebook; 16 for a 16-codebook talker)
    codebooks = 1
    #: the family's extra tensors in the thinker's step 0 (the thinker's ``head_keys``)
    head_keys: tuple[str, ...] = ()

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "cpu",
                 max_new_tokens: int = 4096, do_sample: bool = True, top_k: int = 40, top_p: float = 0.8,
                 temperature: float = 0.9, repetition_penalty: float = 1.05,
                 eos_token_id: list[int] | None = None, codes_per_chunk: int = 16, source: str = "thinker",
                 max_batch_size: int = 64, kv_cache_tokens: int | None = 524288,
                 max_prefill_tokens: int | None = 512, first_codes_per_chunk: int = 1,
                 yield_to_first_audio: float | None = None):
        self.path = resolve_model_path(model)
        self.device = torch.device(device)
        self.model = self.load_model(self.path, dtype=dtype, device=device)
        use_row_attention(self.model, self.model.config)
        self.eos: set[int] = set()
        self.suppress: list[int] = []
        self.setup(self.model)
        if eos_token_id is not None:
            self.eos = set(eos_token_id)
        self.max_new_tokens = max_new_tokens
        self.sampling = {"do_sample": do_sample, "top_k": top_k, "top_p": top_p, "temperature": temperature,
                         "repetition_penalty": repetition_penalty}
        for name, value in (("codes_per_chunk", codes_per_chunk), ("first_codes_per_chunk", first_codes_per_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.codes_per_chunk = codes_per_chunk
        self.first_codes_per_chunk = min(first_codes_per_chunk, codes_per_chunk)
        if yield_to_first_audio is None:  # on CPU the stages of a process share the interpreter lock
            yield_to_first_audio = 0.25 if self.device.type == "cpu" else 0.0
        if isinstance(yield_to_first_audio, bool) or not isinstance(yield_to_first_audio, (int, float)) \
                or not 0 <= yield_to_first_audio <= 10:
            raise ValueError(f"yield_to_first_audio must be seconds between 0 and 10 (0: never), "
                             f"got {yield_to_first_audio!r}")
        self.yield_to_first_audio = float(yield_to_first_audio)
        self.source = source
        self.loop = DecodeLoop(self.step, max_batch_size=max_batch_size, memory_budget=kv_cache_tokens,
                               max_prefill_tokens=max_prefill_tokens, name="talker")

    # -- hooks --------------------------------------------------------------------------------
    def load_model(self, path, *, dtype: str, device: str):
        raise NotImplementedError(f"{type(self).__name__} must load its talker part (load_model)")

    def setup(self, model) -> None:
        """Set ``self.eos`` (end codes) and ``self.suppress`` (codes never drawn) from the model."""

    def prefill_inputs(self, head: dict, reply0: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
        raise NotImplementedError(f"{type(self).__name__} must build its prompt (prefill_inputs)")

    def tail_input(self, state: TalkerRow, step: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must say its input past the reply (tail_input)")

    def step_embeds(self, states: list[TalkerRow], replies: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must embed a step's input (step_embeds)")

    def positions(self, states: list[TalkerRow]) -> torch.Tensor:
        return torch.tensor([s.kv.length for s in states], device=self.device).view(-1, 1)

    def forward_step(self, embeds: torch.Tensor, positions: torch.Tensor, cache: RowsCache) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must run a decode step (forward_step)")

    def forward_prefill(self, embeds: torch.Tensor, cache) -> torch.Tensor:
        out = self.model(inputs_embeds=embeds, cache=cache, use_cache=True, return_dict=True)
        return out.logits[:, -1, :]

    def frame(self, state: TalkerRow, logits: torch.Tensor) -> list[int]:
        return [sample(state, logits, self.device)]

    def frames(self, states: list[TalkerRow], logits: list[torch.Tensor]) -> list[list[int] | Exception]:
        """One step's frames, one per row with an output, a row's failure its own (default: with the
        default ``frame``, one sampler call for all the rows, the same codes as row by row; with a
        family's own ``frame``, that row by row); a talker whose frame needs more forwards (a code
        predictor) runs them for all the rows at once here."""
        if type(self).frame is CodecTalker.frame and states:
            codes = sample_rows([s.sampler for s in states], [s.ids for s in states], torch.cat(logits))
            return [code if isinstance(code, Exception) else [code] for code in codes]
        made: list = []
        for state, lg in zip(states, logits, strict=True):
            try:
                made.append(self.frame(state, lg))
            except Exception as exc:
                made.append(exc)
        return made

    def chunk_ends(self) -> Iterator[int]:
        """The frame counts at which a chunk goes out: ``first_codes_per_chunk`` doubling while
        below ``codes_per_chunk``, then every ``codes_per_chunk``."""
        end = self.first_codes_per_chunk
        while end < self.codes_per_chunk:
            yield end
            end *= 2
        end = self.codes_per_chunk
        while True:
            yield end
            end += self.codes_per_chunk

    def is_end(self, state: TalkerRow, frame: list[int]) -> bool:
        return frame[0] in state.eos

    # -- the step (worker thread) --------------------------------------------------------------
    def step(self, rows) -> list[Any]:
        # A vocoder in this process making a request's first chunk goes first (kit.vocoder.FirstChunkGate).
        FIRST_CHUNKS.wait(self.yield_to_first_audio)
        with torch.inference_mode():
            results, outs = run_rows(rows, self._decode_rows, self.prefill)
            made = self.frames([rows[i].state for i, _ in outs], [lg for _, lg in outs]) if outs else []
            for (i, _), frame in zip(outs, made, strict=True):
                state = rows[i].state
                if isinstance(frame, Exception):
                    results[i] = frame
                    continue
                frame = [int(c) for c in frame]
                state.generated += 1
                state.ids.append(frame[0])
                if self.is_end(state, frame):
                    rows[i].finish()
                    results[i] = None
                    continue
                state.last = frame
                if state.generated >= state.max_new:
                    rows[i].finish()
                results[i] = frame
        return results

    def _decode_rows(self, rows) -> list[torch.Tensor]:
        logits = self.decode(rows)
        return [logits[j:j + 1] for j in range(len(rows))]

    def _reply(self, row) -> torch.Tensor:
        if row.input is not None:
            return row.input
        step = row.decoded + 1  # decode step k reads the thinker's reply k (reply 0 is in the prefix)
        return self.tail_input(row.state, step)

    def decode(self, rows) -> torch.Tensor:
        """One forward for every decoding row: its last frame + its thinker input, at its own position."""
        states = [row.state for row in rows]
        replies = torch.stack([self._reply(row).to(self.device) for row in rows])
        cache = RowsCache([s.kv for s in states])
        logits = self.forward_step(self.step_embeds(states, replies), self.positions(states), cache)
        cache.advance()
        return logits

    def prefill(self, state: TalkerRow, start: int, end: int):
        from transformers import DynamicCache

        if start == 0 or state.cache is None:
            state.cache = DynamicCache(config=self.model.config)
        crop_to(state.cache, start)
        logits = self.forward_prefill(state.prefix[start:end][None], state.cache)
        if end < state.prefix.shape[0]:
            return NO_OUTPUT
        state.kv = RowKV(state.cache, state.reserved)
        state.cache = None
        return logits

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
        sampler = Sampler(**sampling, suppress_tokens=list(self.suppress), generator=generator, device=self.device)
        stream = ThinkerStream(ctx, self.source, self.head_keys)
        reader = asyncio.create_task(stream.read())
        try:
            head = {k: v.to(self.device) for k, v in (await stream.first()).items()}
            reply0 = await stream.reply(0)
            inputs = self.prefill_inputs(head, None if reply0 is None else reply0.to(self.device))
            codes: list[int] = []
            pending: list[int] = []
            n = self.codebooks
            ends = self.chunk_ends()
            send_at = next(ends)
            if inputs is not None:  # None: nothing to speak (no frames)
                prefix, ids = inputs
                row = TalkerRow(prefix, ids, sampler, max_new, self.eos, stream, head, seed)
                async with self.loop.join(row, prompt_tokens=prefix.shape[0], memory=row.reserved,
                                          needs_input=True) as seq:
                    stream.attach(seq, self.device)
                    async for frame in seq:
                        if frame is None:  # an end code
                            break
                        codes.extend(frame)
                        pending.extend(frame)
                        if len(codes) >= send_at * n:
                            await ctx.emit(CodesChunk(pending, n).to_wire())
                            pending = []
                            send_at = next(ends)
            await reader  # the whole text reaches the caller before the last codes
            # The RNG state as bytes: a few bytes of msgpack, no relay transfer.
            await ctx.emit(CodesChunk(pending, n, final=True,
                                      rng_state=generator.get_state().numpy().tobytes()).to_wire())
            return {"codes": codes}
        finally:
            if not reader.done():
                reader.cancel()

    async def close(self) -> None:
        await self.loop.close()


class ThinkerStream(StreamProgress):
    """Reads the thinker's stream for one talker call: forwards text at once, keeps the talker
    inputs. ``reply(j)`` is the thinker input for generated token j, or None past the last one."""

    def __init__(self, ctx, source: str, head_keys: tuple[str, ...] = ()):
        super().__init__(source)
        self.ctx = ctx
        self.head_keys = head_keys
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
            chunk = thinker_chunk(wire, self.head_keys)
            if isinstance(chunk, ThinkerEnd):
                # The thinker's counts (prompt_tokens, completion_tokens, finish_reason) go on
                # with its last text, for the vocoder's result.
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
                self.head = {"prompt": chunk.prompt.clone(), **{k: chunk.extra[k].clone() for k in self.head_keys}}
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

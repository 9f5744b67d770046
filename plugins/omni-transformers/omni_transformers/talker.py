"""The talker stage: codec codes from the thinker's live stream."""

from __future__ import annotations

import asyncio

import torch

from .common import USAGE_KEYS, request_seed
from .models import Sampler, load_part, make_generator, resolve_model_path


class Talker:
    """Codec codes from the thinker's stream, consumed while the thinker generates.

    Defaults are ``generate``'s talker settings (sampling with top_k 40, top_p 0.8, temperature
    0.9, repetition penalty 1.05; stop at codec pad or end); ``do_sample: false`` is greedy.
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "cpu",
                 max_new_tokens: int = 4096, do_sample: bool = True, top_k: int = 40, top_p: float = 0.8,
                 temperature: float = 0.9, repetition_penalty: float = 1.05,
                 eos_token_id: list[int] | None = None, codes_per_chunk: int = 16, source: str = "thinker"):
        self.path = resolve_model_path(model)
        self.device = torch.device(device)
        self.model = load_part(self.path, "talker", dtype=dtype, device=device)
        m = self.model
        self.codec_bos, self.codec_pad, self.codec_mask = m.codec_bos_token, m.codec_pad_token, m.codec_mask_token
        # generate's default talker_eos_token_id is [8292, 8294]: the codec pad and end ids.
        self.eos = set(eos_token_id if eos_token_id is not None else [m.codec_pad_token, m.codec_eos_token])
        self.max_new_tokens = max_new_tokens
        self.sampling = {"do_sample": do_sample, "top_k": top_k, "top_p": top_p, "temperature": temperature,
                         "repetition_penalty": repetition_penalty}
        self.codes_per_chunk = max(1, int(codes_per_chunk))
        self.source = source
        self.codec_embed = m.get_input_embeddings()

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _forward(self, inputs_embeds: torch.Tensor, cache) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model(inputs_embeds=inputs_embeds.unsqueeze(0), cache=cache, use_cache=True, return_dict=True)
            return out.logits[:, -1, :]

    def _step_embeds(self, code: int, reply: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            ids = torch.tensor([code], dtype=torch.long, device=self.device)
            return self.codec_embed(ids) + reply.to(self.device)[None]

    async def __call__(self, payload: dict, ctx) -> dict:
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
            sequence = torch.tensor([[self.codec_mask] * prompt.shape[0] + [self.codec_pad, self.codec_bos]],
                                    dtype=torch.long, device=self.device)
            cache = self._new_cache()
            logits = await asyncio.to_thread(self._forward, prefix, cache)
            codes: list[int] = []
            pending: list[int] = []
            generated = 0
            step = 1
            while True:
                code = sampler(sequence, logits)
                generated += 1
                sequence = torch.cat([sequence, sequence.new_tensor([[code]])], dim=1)
                if code in self.eos:
                    break
                codes.append(code)
                pending.append(code)
                if len(pending) >= self.codes_per_chunk:
                    await ctx.emit({"codes": pending})
                    pending = []
                if generated >= max_new:
                    break
                reply = await stream.reply(step)
                if reply is None:  # past the thinker's reply: its text end, then padding
                    reply = eos_e if step == stream.count else pad_e
                embeds = await asyncio.to_thread(self._step_embeds, code, reply)
                logits = await asyncio.to_thread(self._forward, embeds, cache)
                step += 1
            await reader  # the whole text reaches the caller before the last codes
            # The RNG state as bytes: a few bytes of msgpack, no relay transfer.
            await ctx.emit({"codes": pending, "final": True, "rng_state": generator.get_state().numpy().tobytes()})
            return {"codes": codes}
        finally:
            if not reader.done():
                reader.cancel()


class _ThinkerStream:
    """Reads the thinker's stream for one talker call: forwards text at once, keeps the talker
    inputs. ``reply(j)`` is the thinker input for generated token j, or None past the last one."""

    def __init__(self, ctx, source: str):
        self.ctx, self.source = ctx, source
        self.head: dict | None = None
        self.replies: list[torch.Tensor] = []
        self.ended = False
        self.changed = asyncio.Event()
        self.error: BaseException | None = None

    @property
    def count(self) -> int:
        return len(self.replies)

    async def read(self) -> None:
        expect = 0
        try:
            async for chunk in self.ctx.stream_from(self.source):
                if chunk.get("final"):
                    # The thinker's counts (prompt_tokens, completion_tokens, finish_reason) go on
                    # with its last text, for token2wav's result.
                    usage = {k: chunk[k] for k in USAGE_KEYS if k in chunk}
                    if chunk.get("text"):
                        await self.ctx.emit({"text": chunk["text"], "token_ids": [], **usage})
                    elif usage:
                        await self.ctx.emit(usage)
                    continue
                if chunk.get("step") != expect:
                    raise RuntimeError(f"the {self.source} stream is out of order: chunk {chunk.get('step')} "
                                       f"arrived where {expect} was due")
                expect += 1
                if chunk["step"] == 0:
                    self.head = {k: chunk[k].clone() for k in ("prompt", "text_bos", "text_eos", "text_pad")}
                else:
                    self.replies.append(chunk["reply"].clone())
                self.changed.set()
                await self.ctx.emit({"text": chunk["text"], "token_ids": [chunk["token_id"]]})
            if expect == 0:
                raise RuntimeError(f"the {self.source} stream ended before its first chunk")
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.ended = True
            self.changed.set()

    async def _wait(self, ready) -> None:
        while not ready():
            if self.error is not None:
                raise RuntimeError(f"reading the {self.source} stream failed: {self.error!r}") from self.error
            if self.ended:
                return
            self.changed.clear()
            await self.changed.wait()

    async def first(self) -> dict:
        await self._wait(lambda: self.head is not None)
        if self.head is None:
            raise RuntimeError(f"the {self.source} stream ended before its first chunk")
        return self.head

    async def reply(self, j: int) -> torch.Tensor | None:
        await self._wait(lambda: len(self.replies) > j)
        if self.error is not None:
            raise RuntimeError(f"reading the {self.source} stream failed: {self.error!r}") from self.error
        return self.replies[j] if len(self.replies) > j else None


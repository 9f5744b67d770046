"""Qwen2.5-Omni as omni stages: processor → thinker ==> talker ==> token2wav.

Each stage reproduces its part of ``Qwen2_5OmniForConditionalGeneration.generate(...,
return_audio=True)`` for one request (the same forward calls, logits processors and stop rules),
with everything per request: KV caches, explicit position ids (never ``rope_deltas`` on the
module), RNG (a ``torch.Generator`` seeded from the request's ``seed``). Model steps run in
worker threads, so concurrent requests interleave step by step and the event loop stays free.

Streams (docs/models.md lists every key):

- thinker → talker: chunk 0 ``{"step": 0, "token_id", "text", "prompt" [L, H], "text_bos",
  "text_eos", "text_pad" [H]}``, then per decoding step k ``{"step": k, "token_id", "text",
  "reply" [H]}`` (the thinker's input embedding + last hidden state of the token it just fed),
  then ``{"final": true, "text"}`` (text held back by incremental detokenisation).
- talker → token2wav: ``{"text", "token_ids"}`` as the thinker's text arrives, ``{"codes": [...]}``
  every ``codes_per_chunk`` codes, then ``{"codes": [...], "final": true, "rng_state"}``.
- token2wav → caller: the text chunks, then ``{"audio", "sample_rate"}``; its result is
  ``{"text", "token_ids", "codes", "audio", "sample_rate"}``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import torch

from .models import (
    Sampler,
    TextDecoder,
    load_part,
    load_speakers,
    make_generator,
    resolve_model_path,
    speaker_params,
    torch_dtype,
)

DEFAULT_SPEAKER = "Chelsie"
# The system prompt Qwen2.5-Omni needs to answer with speech (from its model card).
DEFAULT_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving auditory and "
    "visual inputs, as well as generating text and speech."
)


def _sample_rate(path: Path, default: int = 24000) -> int:
    meta = path / "omni_transformers.json"
    if meta.is_file():
        return int(json.loads(meta.read_text()).get("sample_rate", default))
    return default


def _omni_config(path: Path):
    """The whole checkpoint's config, or None for a folder holding one part."""
    import transformers

    if json.loads((path / "config.json").read_text()).get("model_type") != "qwen2_5_omni":
        return None
    return transformers.Qwen2_5OmniConfig.from_pretrained(path, local_files_only=True)


def _seed(payload: dict) -> int:
    seed = payload.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    return seed


class Processor:
    """Inputs → model inputs. ``{"text": str}`` (put through the tokenizer's chat template, with the
    system prompt Qwen2.5-Omni needs for speech) or ``{"input_ids": [int, ...]}`` (used as given),
    plus optional ``max_new_tokens``, ``speaker``, ``seed``, ``system_prompt``, ``talker_max_new_tokens``,
    ``talker_do_sample`` and ``wav_path``."""

    def __init__(self, model: str | None = None, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
                 chat_template: bool = True):
        from transformers import AutoTokenizer

        self.path = resolve_model_path(model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        self.system_prompt = system_prompt
        self.chat_template = chat_template and self.tokenizer.chat_template is not None

    def encode(self, text: str, system_prompt: str | None) -> list[int]:
        if not self.chat_template:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": text})
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def __call__(self, payload: Any, ctx) -> dict:
        if not isinstance(payload, dict):
            raise TypeError(f"inputs must be a mapping like {{'text': 'hello'}}, got {type(payload).__name__}")
        for key in ("audio", "audios", "image", "images", "video", "videos"):
            if key in payload:
                raise ValueError(f"input {key!r} is not supported yet: give 'text' or 'input_ids'")
        if "input_ids" in payload:
            ids = payload["input_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
                raise ValueError("input_ids must be a non-empty list of ints")
        elif isinstance(payload.get("text"), str):
            ids = self.encode(payload["text"], payload.get("system_prompt", self.system_prompt))
        else:
            raise ValueError("inputs need 'text' (a string) or 'input_ids' (a list of ints)")
        out = {"input_ids": [int(i) for i in ids], "seed": _seed(payload),
               "speaker": payload.get("speaker", DEFAULT_SPEAKER)}
        if payload.get("max_new_tokens") is not None:
            out["max_new_tokens"] = int(payload["max_new_tokens"])
        if payload.get("talker_max_new_tokens") is not None:
            out["talker_max_new_tokens"] = int(payload["talker_max_new_tokens"])
        if payload.get("talker_do_sample") is not None:
            out["talker_do_sample"] = bool(payload["talker_do_sample"])
        if "wav_path" in payload:
            out["wav_path"] = payload["wav_path"]
        return out


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
            config = _omni_config(self.path)
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
                          generator=make_generator(_seed(payload), self.device), device=self.device)
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
        seed = _seed(payload)
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
                    if chunk.get("text"):
                        await self.ctx.emit({"text": chunk["text"], "token_ids": []})
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


class Token2Wav:
    """Codes → waveform (DiT flow matching + BigVGAN), one chunk once the talker's codes are all in
    (the sliding-window DiT is not split here: chunked synthesis would not equal ``generate``).
    Forwards the text chunks to the caller as they come; returns the whole result."""

    def __init__(self, model: str | None = None, device: str = "cpu", dtype: str = "float32", num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0, sample_rate: int | None = None,
                 wav_path: str | None = None, source: str = "talker"):
        self.path = resolve_model_path(model)
        self.device = torch.device(device)
        if torch_dtype(dtype, torch.float32) != torch.float32:
            raise ValueError("token2wav runs in float32 (as transformers runs it); set dtype: float32")
        self.model = load_part(self.path, "token2wav", device=device)
        self.speakers = load_speakers(self.path)
        self.options = {"num_steps": num_steps, "guidance_scale": guidance_scale, "sway_coefficient": sway_coefficient}
        self.sample_rate = sample_rate or _sample_rate(self.path)
        self.wav_path = wav_path
        self.source = source

    def _write_wav(self, path: str, audio: torch.Tensor) -> str:
        """16-bit mono PCM, written next to ``path`` then renamed (concurrent writers never mix)."""
        import os
        import tempfile
        import wave

        target = Path(path).expanduser().resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        pcm = (audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes()
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as fh, wave.open(fh, "wb") as out:
                out.setnchannels(1)
                out.setsampwidth(2)
                out.setframerate(self.sample_rate)
                out.writeframes(pcm)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return str(target)

    def _synthesize(self, codes: list[int], speaker: dict, generator: torch.Generator) -> torch.Tensor:
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        with torch.inference_mode():
            dit = self.model.code2wav_dit_model
            code = torch.tensor([codes], dtype=torch.long, device=self.device)
            cond = speaker["cond"].to(self.device).float().expand(1, -1)
            ref_mel = speaker["ref_mel"].to(self.device).float().expand(1, -1, -1)
            # Qwen2_5OmniToken2WavDiTModel.sample, with the initial noise from this request's generator.
            duration = code.shape[1] * dit.repeats
            if duration > dit.config.max_position_embeddings:
                raise ValueError(f"{len(codes)} codes make a mel of {duration} frames, more than the DiT's "
                                 f"max_position_embeddings ({dit.config.max_position_embeddings})")
            noise = torch.randn([1, duration, dit.mel_dim], dtype=ref_mel.dtype, device=self.device,
                                generator=generator)
            cond = cond.unsqueeze(1).repeat(1, duration, 1)
            guidance = self.options["guidance_scale"]

            def ode_function(time_step, hidden_states):
                if guidance < 1e-5:
                    return dit(hidden_states=hidden_states, speaker_embedding=cond, condition_vector=ref_mel,
                               quantized_code=code, time_step=time_step, drop_audio_conditioning=False,
                               drop_code=False, apply_cfg=False)
                out = dit(hidden_states=hidden_states, quantized_code=code, speaker_embedding=cond,
                          condition_vector=ref_mel, time_step=time_step, apply_cfg=True)
                guided, null = torch.chunk(out, 2, dim=0)
                return guided + (guided - null) * guidance

            times = torch.linspace(0, 1, self.options["num_steps"], device=self.device, dtype=cond.dtype)
            sway = self.options["sway_coefficient"]
            if sway is not None:
                times += sway * (torch.cos(torch.pi / 2 * times) - 1 + times)
            trajectory = RungeKutta4ODESolver(function=ode_function, initial_value=noise).integrate(times)
            mel = trajectory[-1].permute(0, 2, 1)
            return self.model.code2wav_bigvgan_model(mel).reshape(-1).float().cpu()

    async def __call__(self, payload: dict, ctx) -> dict:
        speaker = speaker_params(self.speakers, payload.get("speaker", DEFAULT_SPEAKER))
        generator = make_generator(_seed(payload), self.device)
        text: list[str] = []
        token_ids: list[int] = []
        codes: list[int] = []
        finished = False
        async for chunk in ctx.stream_from(self.source):
            if "text" in chunk:
                text.append(chunk["text"])
                token_ids.extend(chunk["token_ids"])
                await ctx.emit({"text": chunk["text"], "token_ids": list(chunk["token_ids"])})
            if "codes" in chunk:
                codes.extend(int(c) for c in chunk["codes"])
            if chunk.get("final"):
                finished = True
                if chunk.get("rng_state") is not None:  # continue the talker's RNG, as generate's global one
                    generator.set_state(torch.frombuffer(bytearray(chunk["rng_state"]), dtype=torch.uint8))
        if not finished:
            raise RuntimeError(f"the {self.source} stream ended without its final chunk")
        if codes:
            audio = await asyncio.to_thread(self._synthesize, codes, speaker, generator)
        else:  # the talker ended at once; generate would fail on an empty code sequence
            audio = torch.zeros(0)
        await ctx.emit({"audio": audio, "sample_rate": self.sample_rate})
        result = {"text": "".join(text), "token_ids": token_ids, "codes": codes, "audio": audio,
                  "sample_rate": self.sample_rate}
        wav_path = payload.get("wav_path", self.wav_path)
        if wav_path:
            result["wav_path"] = await asyncio.to_thread(self._write_wav, str(wav_path), audio)
        return result

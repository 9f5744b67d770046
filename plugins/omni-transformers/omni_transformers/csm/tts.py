"""CSM's stages: text in, speech out.

- :class:`Processor`: ``{"text", "voice"?}`` → the prompt (the chat template's ``[voice]text`` turn) and the
  request's generation settings, checked (an unknown voice is an ``InvalidInput`` naming the voices);
- :class:`Talker`: the prompt → frames of ``num_codebooks`` codes on the decode loop (:mod:`.loop`: the backbone's
  codebook 0 for every live request in one forward with per-row KV, the depth decoder's other codebooks for all of
  them in one call), each row's codes chosen by its own samplers and generator, its frames streamed to the vocoder
  as they come; a row ends at its end frame (all codebooks but the last 0: not spoken) or its ``max_new_tokens``;
- :class:`MimiVocoder`: the frames → 24 kHz audio as they arrive (``kit.vocoder.StreamingVocoder``): Mimi keeps no
  convolution state across calls, so each chunk is decoded again with ``lookback_frames`` frames of left context
  and only its own frames' samples kept.

The stages of one process share one loaded checkpoint (:class:`CsmModel`).

Per-request settings never leak: transformers' CSM ``generate`` writes its ``depth_decoder_*`` arguments into the
depth decoder's shared generation config (after one sampled request, later greedy ones sample). The talker never
calls it: the settings live in each row's samplers.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from omni_core.errors import InvalidInput

from ..kit.chunks import CodesChunk
from ..kit.engines import EngineRegistry
from ..kit.sampling import Sampler, make_generator, resolve_model_path, torch_dtype
from ..kit.streams import request_seed
from ..kit.talker import TalkerRow
from ..kit.vocoder import ChunkSchedule, StreamingVocoder
from .loop import CsmFrames

#: A request's generation settings (``depth_decoder_*``: the depth decoder's) and their checks.
SETTINGS = ("do_sample", "temperature", "top_k", "top_p", "depth_decoder_do_sample", "depth_decoder_temperature",
            "depth_decoder_top_k", "depth_decoder_top_p")
DEFAULT_VOICES = ("0", "1")


def _setting(name: str, value: Any) -> Any:
    plain = name.removeprefix("depth_decoder_")
    if plain == "do_sample":
        if not isinstance(value, bool):
            raise InvalidInput(f"{name} must be true or false, got {value!r}", field=name)
    elif plain == "top_k":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidInput(f"{name} must be an integer >= 0, got {value!r}", field=name)
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 < value <= 1 if plain == "top_p" else 0 <= value <= 2):
        bound = "in (0, 1]" if plain == "top_p" else "from 0 to 2"
        raise InvalidInput(f"{name} must be a number {bound}, got {value!r}", field=name)
    return value


class Processor:
    """``{"text", "voice"?, "max_new_tokens"?, "seed"?, <SETTINGS>...}`` → ``{"input_ids", "settings",
    "max_new_tokens", "seed"}``. ``voices``: the speaker ids requests may name (CSM's are ``"0"``, ``"1"``...)."""

    def __init__(self, model: str | None = None, voices: list[str] | None = None, default_voice: str = "0",
                 max_input_chars: int = 4096):
        from transformers import AutoProcessor

        self.path = resolve_model_path(model)
        self.processor = AutoProcessor.from_pretrained(self.path, local_files_only=True)
        self.voices = [str(v) for v in (voices or DEFAULT_VOICES)]
        if default_voice not in self.voices:
            raise ValueError(f"default_voice {default_voice!r} is not one of voices ({', '.join(self.voices)})")
        self.default_voice = default_voice
        self.max_input_chars = max_input_chars

    async def __call__(self, payload: dict, ctx) -> dict:
        text = payload.get("text")
        if not isinstance(text, str) or not text.strip():
            raise InvalidInput("text is required: the text to speak (a non-empty string)", field="text")
        if len(text) > self.max_input_chars:
            raise InvalidInput(f"text is {len(text)} characters; at most {self.max_input_chars}", field="text")
        voice = payload.get("voice", self.default_voice)
        voice = str(voice) if isinstance(voice, int) and not isinstance(voice, bool) else voice
        if voice not in self.voices:
            raise InvalidInput(f"voice {voice!r} is not one of this model's speakers: {', '.join(self.voices)}",
                               field="voice")
        settings = {name: _setting(name, payload[name]) for name in SETTINGS if payload.get(name) is not None}
        max_new = payload.get("max_new_tokens")
        if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1):
            raise InvalidInput(f"max_new_tokens (frames) must be a positive integer, got {max_new!r}",
                               field="max_new_tokens")
        conversation = [{"role": voice, "content": [{"type": "text", "text": text}]}]
        ids = self.processor.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                                 return_tensors="pt")["input_ids"][0].tolist()
        return {"input_ids": ids, "settings": settings, "max_new_tokens": max_new,
                "seed": request_seed(payload)}


class CsmModel:
    """One loaded CSM checkpoint (backbone, depth decoder, Mimi), shared by the CSM stages of a process through the
    kit's :class:`~omni_transformers.kit.engines.EngineRegistry`: the talker runs the backbone and depth decoder, the
    vocoder Mimi, and the checkpoint is read once."""

    def __init__(self, path, dtype: str, device: str):
        from transformers import CsmForConditionalGeneration

        want = torch_dtype(dtype)
        self.model = CsmForConditionalGeneration.from_pretrained(
            path, local_files_only=True, dtype=want if want is not None else torch.float32).to(device).eval()

    @staticmethod
    def acquire(path, dtype: str, device: str) -> tuple[tuple, CsmModel]:
        """``(key, shared model)``; give the key back to ``EngineRegistry.process().release`` when done."""
        key = (CsmModel, str(path.resolve()), dtype, str(torch.device(device)))
        return key, EngineRegistry.process().acquire(key, lambda: CsmModel(path, dtype, device))

    async def close(self) -> None:
        """Nothing to stop: the last holder's release drops the model."""


class Talker(CsmFrames):
    """CSM's backbone and depth decoder on the kit's talker (:mod:`.loop`): the prompt → frames of codes, streamed
    to ``vocoder`` in ``CodesChunk`` chunks of ``codes_per_chunk`` frames; returns ``{"codes", "prompt_tokens",
    "completion_tokens", "finish_reason"}``.

    The checkpoint's generation config decides (as in ``generate``: CSM's samples); a request's ``do_sample``,
    ``temperature``, ``top_k``, ``top_p`` and their ``depth_decoder_*`` forms override it for that request alone,
    and its ``seed`` seeds its own generator: a request draws the same codes alone or beside others.
    ``max_batch_size``: the most rows in the loop; ``max_new_tokens``: the most frames (null: the checkpoint's);
    ``max_prefill_tokens``: the most prompt tokens one step runs."""

    def __init__(self, model: str | None = None, dtype: str = "float32", device: str = "cpu",
                 max_batch_size: int = 8, max_new_tokens: int | None = None, codes_per_chunk: int = 1,
                 max_prefill_tokens: int | None = 512):
        codes_per_chunk = max(1, int(codes_per_chunk))
        super().__init__(model, dtype=dtype, device=device, max_new_tokens=max_new_tokens or 0,
                         codes_per_chunk=codes_per_chunk, first_codes_per_chunk=codes_per_chunk,
                         max_batch_size=max_batch_size, kv_cache_tokens=None, max_prefill_tokens=max_prefill_tokens,
                         yield_to_first_audio=0)
        self.generation_config = self.model.generation_config
        self.depth_settings = self.model.depth_decoder.generation_config  # read, never written
        self.max_new_tokens = max_new_tokens or self.generation_config.max_new_tokens

    def load_model(self, path, *, dtype: str, device: str):
        self.model_key, shared = CsmModel.acquire(path, dtype, device)
        return shared.model

    def sampler(self, settings: dict, prefix: str, config, generator: torch.Generator) -> Sampler:
        """The sampler of the backbone (``prefix`` "") or the depth decoder (``"depth_decoder_"``): the
        checkpoint's settings with the request's over them."""
        def get(name: str) -> Any:
            value = settings.get(prefix + name)
            return getattr(config, name, None) if value is None else value

        return Sampler(do_sample=bool(get("do_sample")), temperature=get("temperature"), top_k=get("top_k"),
                       top_p=get("top_p"), generator=generator, device=self.device)

    async def __call__(self, payload: dict, ctx) -> dict:
        ids = payload.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise InvalidInput("the talker's payload needs 'input_ids' (the CSM processor's output)",
                               field="input_ids")
        settings = dict(payload.get("settings") or {})
        seed = request_seed(payload)
        generator = make_generator(seed, self.device)
        with torch.inference_mode():  # the prompt's text embeddings, the backbone's prefill input
            prefix = self.model.embed_text_tokens(torch.tensor([ids], device=self.device))[0]
        row = TalkerRow(prefix, list(ids), self.sampler(settings, "", self.generation_config, generator),
                        payload.get("max_new_tokens") or self.max_new_tokens, set(), None, {}, seed)
        row.extra["depth"] = self.sampler(settings, "depth_decoder_", self.depth_settings, generator)
        codes: list[list[int]] = []
        pending: list[int] = []
        ended = False
        async with self.loop.join(row, prompt_tokens=len(ids), memory=row.reserved) as seq:
            async for frame in seq:
                if frame is None:  # the end frame
                    ended = True
                    break
                codes.append(frame)
                pending.extend(frame)
                if len(pending) >= self.codes_per_chunk * self.codebooks:
                    await ctx.emit(CodesChunk(pending, self.codebooks).to_wire())
                    pending = []
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(codes),
                 "finish_reason": "stop" if ended else "length"}
        await ctx.emit(CodesChunk(pending, self.codebooks, final=True).to_wire())
        await ctx.emit(usage)
        return {"codes": codes, **usage}

    async def close(self) -> None:
        await super().close()
        await EngineRegistry.process().release(self.model_key)


# -- the vocoder ------------------------------------------------------------------------------------


@attrs.define
class MimiWindow:
    """A chunk's window: frames ``[begin, end)`` decoded, of which ``[start, end)`` are the chunk's."""

    synthesis: Any
    codes: torch.Tensor
    begin: int
    start: int
    end: int


class MimiSynthesis:
    """One request's chunked decode: chunks from the stage's schedule, each decoded with its left context."""

    def __init__(self, stage: MimiVocoder):
        self.stage = stage
        self.schedule = stage.schedule
        self.done = 0
        self.size = self.schedule.first

    def ready(self, n: int, final: bool) -> bool:
        return n > self.done and (final or n - self.done >= self.size)

    def plan(self, frames: list, final: bool) -> MimiWindow | None:
        n = len(frames)
        if n <= self.done:
            return None
        end = min(n, self.done + self.size)  # never more than the schedule's size: the chunks depend on the
        # frames alone, not on how many arrived before the talker ended
        begin = self.schedule.window_start(self.done)
        codes = torch.tensor(frames[begin:end], dtype=torch.long).T[None]  # [1, codebooks, frames]
        window = MimiWindow(self, codes, begin, self.done, end)
        self.done = end
        self.size = self.schedule.next(self.size)
        return window

    def finish(self, window: MimiWindow, audio: torch.Tensor) -> torch.Tensor:
        hop = self.stage.hop
        return audio[(window.start - window.begin) * hop:(window.end - window.begin) * hop].float().cpu()


class MimiVocoder(StreamingVocoder):
    """Mimi: CSM's frames → 24 kHz audio, streamed. The first chunk after ``first_chunk_frames`` frames, each next
    ``chunk_growth`` times larger up to ``max_chunk_frames``; each decoded again with ``lookback_frames`` frames of
    left context (Mimi has no convolution state to carry; docs/models.md gives the error against a whole decode)."""

    def __init__(self, model: str | None = None, device: str = "cpu", dtype: str = "float32",
                 first_chunk_frames: int = 2, chunk_growth: float = 2.0, max_chunk_frames: int = 16,
                 lookback_frames: int = 25, **kwargs):
        super().__init__(model, device=device, dtype=dtype, sample_rate=24000, relay_text=False, **kwargs)
        self.codebooks = self.model.config.num_quantizers
        self.sample_rate = self.model.config.sampling_rate
        self.hop = int(round(self.sample_rate / self.model.config.frame_rate))
        self.schedule = ChunkSchedule(first_chunk_frames, chunk_growth, max_chunk_frames, 0, lookback_frames,
                                      names=("first_chunk_frames", "chunk_growth", "max_chunk_frames", "lookahead",
                                             "lookback_frames"))

    def load_model(self, path, *, dtype: str, device: str):
        self.model_key, shared = CsmModel.acquire(path, dtype, device)  # the talker's, in its process
        return shared.model.codec_model

    async def close(self) -> None:
        await super().close()
        await EngineRegistry.process().release(self.model_key)

    def new_synthesis(self, speaker: Any, generator: torch.Generator) -> MimiSynthesis:
        return MimiSynthesis(self)

    def batch_key(self, window: MimiWindow) -> int:
        return window.codes.shape[-1]  # windows of one length decode in one call

    def run_windows(self, windows: list[MimiWindow]) -> list[torch.Tensor]:
        codes = torch.cat([w.codes for w in windows]).to(self.device)
        audio = self.model.decode(codes).audio_values  # [B, 1, samples]
        return list(audio[:, 0])

    def synthesize(self, frames: list, speaker: Any, generator: torch.Generator) -> torch.Tensor:
        codes = torch.tensor(frames, dtype=torch.long).T[None].to(self.device)
        with torch.inference_mode():
            return self.model.decode(codes).audio_values.reshape(-1).float().cpu()

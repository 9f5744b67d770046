"""CSM's stages: text in, speech out.

- :class:`Processor`: ``{"text", "voice"?}`` → the prompt (the chat template's ``[voice]text`` turn) and the
  request's generation settings, checked (an unknown voice is an ``InvalidInput`` naming the voices);
- :class:`Talker`: the prompt → frames of ``num_codebooks`` codes (the backbone's codebook 0, the depth decoder's
  others), concurrent requests in one ``generate`` per micro-batch group (requests with equal settings; a sampled
  request runs alone, seeded), each row's frames streamed to the vocoder as they come; the end frame (all codebooks
  but the last 0) ends the row and is not spoken;
- :class:`MimiVocoder`: the frames → 24 kHz audio as they arrive (``kit.vocoder.StreamingVocoder``): Mimi keeps no
  convolution state across calls, so each chunk is decoded again with ``lookback_frames`` frames of left context
  and only its own frames' samples kept.

Per-request settings never leak: transformers' CSM ``generate`` writes its ``depth_decoder_*`` arguments into the
depth decoder's shared generation config, so after a sampled request a greedy one would sample. The talker gives
every ``generate`` a copy of the checkpoint's configs and puts the depth decoder's own back after each call.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import attrs
import torch
from omni_core.errors import InvalidInput
from omni_core.kits import MicroBatcher

from ..kit.chunks import CodesChunk
from ..kit.sampling import resolve_model_path, torch_dtype
from ..kit.streams import request_seed
from ..kit.vocoder import ChunkSchedule, StreamingVocoder

#: A request's generation settings (``depth_decoder_*``: the depth decoder's) and their checks.
SETTINGS = ("do_sample", "temperature", "top_k", "top_p", "depth_decoder_do_sample", "depth_decoder_temperature",
            "depth_decoder_top_k", "depth_decoder_top_p")
DEFAULT_VOICES = ("0", "1")
_DONE = object()


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


@attrs.define(eq=False)
class Utterance:
    """One request in a batch: its prompt and settings, and the queue its frames go to."""

    input_ids: list[int]
    settings: dict
    max_new: int | None
    seed: int
    loop: asyncio.AbstractEventLoop
    frames: asyncio.Queue = attrs.field(factory=asyncio.Queue)

    @property
    def sampled(self) -> bool:
        return any(v for k, v in self.settings.items() if k.endswith("do_sample"))

    @property
    def group(self) -> tuple:
        """Utterances of one group share a ``generate`` call (a sampled one runs alone, with its own seed)."""
        return tuple(sorted(self.settings.items())), self.max_new, id(self) if self.sampled else None

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.frames.put_nowait, item)


class FrameStreamer:
    """A CSM ``generate`` streamer handing each row's frames to its utterance, up to its end frame."""

    def __init__(self, rows: list[Utterance], eos: int):
        self.rows = rows
        self.eos = eos
        self.prompt_seen = False
        self.done = [False] * len(rows)

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate's first put is the text prompt
            self.prompt_seen = True
            return
        for i, frame in enumerate(value.tolist()):
            if self.done[i]:
                continue
            if all(c == self.eos for c in frame[:-1]):  # the end frame: not audio
                self.done[i] = True
                continue
            self.rows[i].put([int(c) for c in frame])

    def end(self) -> None:
        pass


class Talker:
    """CSM's backbone and depth decoder: the prompt → frames of codes, streamed to ``vocoder`` in
    ``CodesChunk`` chunks of ``codes_per_chunk`` frames; returns ``{"codes", "prompt_tokens",
    "completion_tokens", "finish_reason"}``.

    The checkpoint's generation config decides (as in ``generate``: CSM's samples); a request's ``do_sample``,
    ``temperature``, ``top_k``, ``top_p`` and their ``depth_decoder_*`` forms override it for that request alone.
    ``max_batch_size`` / ``max_wait``: the micro-batcher; ``max_new_tokens``: the most frames (null: the
    checkpoint's)."""

    def __init__(self, model: str | None = None, dtype: str = "float32", device: str = "cpu",
                 max_batch_size: int = 8, max_wait: float = 0.01, max_new_tokens: int | None = None,
                 codes_per_chunk: int = 1):
        from transformers import CsmForConditionalGeneration

        self.path = resolve_model_path(model)
        self.device = torch.device(device)
        want = torch_dtype(dtype)
        self.model = CsmForConditionalGeneration.from_pretrained(
            self.path, local_files_only=True, dtype=want if want is not None else "auto").to(self.device).eval()
        self.model.codec_model = None  # the vocoder stage decodes; this one never does
        self.generation_config = copy.deepcopy(self.model.generation_config)
        self.depth_config = copy.deepcopy(self.model.depth_decoder.generation_config)
        self.codebooks = self.model.config.num_codebooks
        self.eos = self.model.config.codebook_eos_token_id
        self.pad = self.model.config.pad_token_id
        self.max_new_tokens = max_new_tokens or self.generation_config.max_new_tokens
        self.codes_per_chunk = max(1, int(codes_per_chunk))
        self.batcher = MicroBatcher(self._batch, max_batch_size=max_batch_size, max_wait=max_wait, name="csm")

    async def __call__(self, payload: dict, ctx) -> dict:
        ids = payload.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise InvalidInput("the talker's payload needs 'input_ids' (the CSM processor's output)",
                               field="input_ids")
        row = Utterance(ids, dict(payload.get("settings") or {}), payload.get("max_new_tokens") or self.max_new_tokens,
                        request_seed(payload), asyncio.get_running_loop())
        job = asyncio.ensure_future(self.batcher.submit(row))
        job.add_done_callback(lambda _: row.frames.put_nowait(_DONE))
        codes: list[list[int]] = []
        pending: list[int] = []
        try:
            while (frame := await row.frames.get()) is not _DONE:
                codes.append(frame)
                pending.extend(frame)
                if len(pending) >= self.codes_per_chunk * self.codebooks:
                    await ctx.emit(CodesChunk(pending, self.codebooks).to_wire())
                    pending = []
            ended = await job
        finally:
            job.cancel()
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(codes),
                 "finish_reason": "stop" if ended else "length"}
        await ctx.emit(CodesChunk(pending, self.codebooks, final=True).to_wire())
        await ctx.emit(usage)
        return {"codes": codes, **usage}

    # -- the batch (a worker thread) ----------------------------------------------------------------
    def generate(self, rows: list[Utterance]) -> list[bool]:
        """One ``generate`` over utterances of one group; whether each row ended (its end frame came)."""
        first = rows[0]
        width = max(len(r.input_ids) for r in rows)
        ids = torch.tensor([[self.pad] * (width - len(r.input_ids)) + r.input_ids for r in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(r.input_ids)) + [1] * len(r.input_ids) for r in rows],
                            device=self.device)
        config = copy.deepcopy(self.generation_config)
        config.update(**{k: v for k, v in first.settings.items() if not k.startswith("depth_decoder_")})
        config.max_new_tokens = first.max_new
        depth = {k: v for k, v in first.settings.items() if k.startswith("depth_decoder_")}
        streamer = FrameStreamer(rows, self.eos)
        self.model.depth_decoder.generation_config = copy.deepcopy(self.depth_config)
        try:
            if first.sampled:
                with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
                    torch.manual_seed(first.seed)
                    self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                        streamer=streamer, **depth)
            else:
                self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config, streamer=streamer,
                                    **depth)
        finally:  # what generate wrote into the depth decoder's config stays with this call
            self.model.depth_decoder.generation_config = copy.deepcopy(self.depth_config)
        return list(streamer.done)

    def _batch(self, rows: list[Utterance]) -> list[Any]:
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(row.group, []).append(i)
        results: list[Any] = [None] * len(rows)
        with torch.inference_mode():
            for members in groups.values():
                try:
                    for i, ended in zip(members, self.generate([rows[i] for i in members]), strict=True):
                        results[i] = ended
                except Exception as exc:  # this group's failure alone
                    for i in members:
                        results[i] = exc
        return results

    async def close(self) -> None:
        await self.batcher.close()


# -- the vocoder ------------------------------------------------------------------------------------


def load_mimi(path, *, dtype: str, device: str):
    """Mimi from a CSM checkpoint: the whole model is loaded (transformers maps the checkpoint's names onto the
    modules) and all but its ``codec_model`` dropped at once."""
    from transformers import CsmForConditionalGeneration

    want = torch_dtype(dtype)
    model = CsmForConditionalGeneration.from_pretrained(path, local_files_only=True,
                                                        dtype=want if want is not None else torch.float32)
    return model.codec_model.to(device).eval()


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
        return load_mimi(path, dtype=dtype, device=device)

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

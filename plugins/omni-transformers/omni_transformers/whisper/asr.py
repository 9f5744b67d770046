"""Whisper's ASR stage: audio in, text out, concurrent requests transcribed in one batch.

Concurrent calls go to a micro-batcher (``omni_core.kits.MicroBatcher``): each batch's clips get their log-mel
features together (each padded to Whisper's 30 s window, so a clip's features are the same alone or in a batch)
and one ``generate`` per group of requests with the same settings (language, prompt, temperature): the encoder
runs once over the group, the decoder one step for every row of it. A row's tokens go to its caller as they are
made (a text chunk per token); the result holds the whole text, the token ids, the language and the usage.

Per request: ``audio`` (a 1-D float tensor with ``sample_rate``, a file path or an encoded file's bytes; at most
30 s: a longer clip is refused, not cut), ``language`` (a code such as ``en`` or a name such as ``english``;
absent: detected per clip), ``prompt`` (text the transcript continues), ``temperature`` (0: greedy; above 0: sampled
with the request's ``seed``, alone), ``max_new_tokens``. The model's own generation config is never changed: each
``generate`` gets its own copy.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import attrs
import torch
from omni_core.errors import InvalidInput
from omni_core.kits import MicroBatcher

from ..kit.chunks import TextChunk
from ..kit.media import load_audio
from ..kit.sampling import TextDecoder, resolve_model_path, torch_dtype
from ..kit.streams import request_seed

RATE = 16000
_DONE = object()


@attrs.define(eq=False)
class Clip:
    """One request in a batch: its samples and settings, and the queue its tokens go to."""

    samples: Any
    language: str | None
    prompt: str | None
    temperature: float
    seed: int
    max_new: int | None
    loop: asyncio.AbstractEventLoop
    tokens: asyncio.Queue = attrs.field(factory=asyncio.Queue)

    @property
    def group(self) -> tuple:
        """Clips of one group share a ``generate`` call (a sampled clip runs alone, with its own seed)."""
        alone = id(self) if self.temperature > 0 else None
        return self.language, self.prompt, self.temperature, self.max_new, alone

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.tokens.put_nowait, item)


class RowStreamer:
    """A ``generate`` streamer handing each row's new token to its clip (until the row's end of text)."""

    def __init__(self, clips: list[Clip], eos: int):
        self.clips = clips
        self.eos = eos
        self.prompt_seen = False
        self.done = [False] * len(clips)

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate's first put is the decoder prompt
            self.prompt_seen = True
            return
        for i, token in enumerate(value.reshape(-1).tolist()):
            if self.done[i]:
                continue
            if token == self.eos:
                self.done[i] = True
                continue
            self.clips[i].put(int(token))

    def end(self) -> None:
        pass


class Transcriber:
    """Whisper ASR: ``{"audio", "sample_rate"?, "language"?, "prompt"?, "temperature"?}`` → text chunks as the
    tokens come, then ``{"text", "token_ids", "language", "duration"}``.

    ``max_batch_size`` / ``max_wait``: the micro-batcher (clips waiting together, the longest wait for others);
    ``max_new_tokens``: the default cap of a transcript (null: the checkpoint's generation config)."""

    def __init__(self, model: str | None = None, dtype: str = "float32", device: str = "cpu",
                 max_batch_size: int = 16, max_wait: float = 0.01, max_new_tokens: int | None = None):
        from transformers import WhisperForConditionalGeneration, WhisperProcessor
        from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

        self.path = resolve_model_path(model)
        self.device = torch.device(device)
        want = torch_dtype(dtype)
        self.processor = WhisperProcessor.from_pretrained(self.path, local_files_only=True)
        self.model = WhisperForConditionalGeneration.from_pretrained(
            self.path, local_files_only=True, dtype=want if want is not None else "auto").to(self.device).eval()
        self.generation_config = copy.deepcopy(self.model.generation_config)
        self.tokenizer = self.processor.tokenizer
        self.eos = self.generation_config.eos_token_id
        self.max_new_tokens = max_new_tokens
        self.chunk_seconds = self.processor.feature_extractor.chunk_length
        lang_ids = getattr(self.generation_config, "lang_to_id", None) or {}
        self.languages = {tok[2:-2]: tok for tok in lang_ids}  # "en" -> "<|en|>"
        self.names = {name: code for name, code in TO_LANGUAGE_CODE.items() if code in self.languages}
        self.language_of_id = {i: LANGUAGES.get(tok[2:-2], tok[2:-2]) for tok, i in lang_ids.items()}
        gen = self.generation_config
        # the decoder prompt's tokens after <|startoftranscript|>: language, task, <|notimestamps|>
        self.prompt_ids = {*lang_ids.values(), *(getattr(gen, "task_to_id", None) or {}).values(),
                           gen.no_timestamps_token_id}
        self.batcher = MicroBatcher(self._batch, max_batch_size=max_batch_size, max_wait=max_wait,
                                    name="whisper")

    # -- the request -------------------------------------------------------------------------------
    def _language(self, value: Any) -> str | None:
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise InvalidInput(f"language must be a string such as 'en', got {value!r}", field="language")
        code = value.lower()
        code = self.names.get(code, code)
        if code not in self.languages:
            known = ", ".join(sorted(self.languages))
            raise InvalidInput(f"language {value!r} is not one this model knows; give a code: {known}",
                               field="language")
        return code

    def clip(self, payload: dict, ctx: Any) -> Clip:
        origin = getattr(ctx, "from_network", None)
        samples = load_audio(payload.get("audio"), "audio", sample_rate=payload.get("sample_rate"),
                             target_rate=RATE, origin=origin)
        if samples.size > self.chunk_seconds * RATE:
            raise InvalidInput(f"audio: the clip is {samples.size / RATE:.2f} s long; Whisper transcribes at most "
                               f"{self.chunk_seconds} s at once (long-form transcription is not served): split it",
                               field="audio")
        prompt = payload.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidInput(f"prompt must be a string, got {type(prompt).__name__}", field="prompt")
        temperature = payload.get("temperature", 0.0) or 0.0
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            raise InvalidInput(f"temperature must be a number from 0 to 2, got {temperature!r}", field="temperature")
        max_new = payload.get("max_new_tokens", self.max_new_tokens)
        if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1):
            raise InvalidInput(f"max_new_tokens must be a positive integer, got {max_new!r}", field="max_new_tokens")
        return Clip(samples, self._language(payload.get("language")), prompt or None, float(temperature),
                    request_seed(payload), max_new, asyncio.get_running_loop())

    async def __call__(self, payload: dict, ctx) -> dict:
        clip = self.clip(payload, ctx)
        decoder = TextDecoder(self.tokenizer)
        job = asyncio.ensure_future(self.batcher.submit(clip))
        job.add_done_callback(lambda _: clip.tokens.put_nowait(_DONE))
        try:
            while (token := await clip.tokens.get()) is not _DONE:
                if text := decoder.push(token):
                    await ctx.emit(TextChunk(text, [token]).to_wire())
            sequence = await job
        finally:
            job.cancel()
        if tail := decoder.flush():
            await ctx.emit(TextChunk(tail).to_wire())
        tokens, language = self.generated(sequence)
        return {"text": self.tokenizer.decode(tokens, skip_special_tokens=True), "token_ids": tokens,
                "language": language, "duration": clip.samples.size / RATE}

    def generated(self, sequence: list[int]) -> tuple[list[int], str | None]:
        """A ``generate`` row's transcript tokens (what follows the decoder prompt, up to the end of text) and
        its language (the name of the prompt's language token)."""
        sot = self.generation_config.decoder_start_token_id
        start = max((i for i, t in enumerate(sequence) if t == sot), default=-1) + 1
        language = self.language_of_id.get(sequence[start]) if start < len(sequence) else None
        while start < len(sequence) and sequence[start] in self.prompt_ids:
            start += 1
        out = []
        for token in sequence[start:]:
            if token == self.eos:
                break
            out.append(token)
        return out, language

    # -- the batch (a worker thread) --------------------------------------------------------------
    def features(self, clips: list[Clip]) -> torch.Tensor:
        """Log-mel features of the clips, each padded to the 30 s window (so alone or batched, the same)."""
        out = self.processor.feature_extractor([c.samples for c in clips], sampling_rate=RATE, return_tensors="pt")
        return out.input_features.to(self.device, self.model.dtype)

    def generate(self, clips: list[Clip]) -> list[list[int]]:
        """One ``generate`` over clips of one group: each row's full sequence (decoder prompt included)."""
        first = clips[0]
        config = copy.deepcopy(self.generation_config)  # generate writes language/task into the config it is given
        kwargs: dict[str, Any] = {"generation_config": config, "task": "transcribe",
                                  "streamer": RowStreamer(clips, self.eos), "return_dict_in_generate": True}
        if first.language is not None:
            kwargs["language"] = first.language
        if first.prompt is not None:
            kwargs["prompt_ids"] = self.processor.get_prompt_ids(first.prompt, return_tensors="pt").to(self.device)
        if first.max_new is not None:
            kwargs["max_new_tokens"] = first.max_new
        features = self.features(clips)
        if first.temperature > 0:
            with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
                torch.manual_seed(first.seed)
                out = self.model.generate(features, do_sample=True, temperature=first.temperature, **kwargs)
        else:
            out = self.model.generate(features, do_sample=False, **kwargs)
        return [row.tolist() for row in out.sequences]

    def _batch(self, clips: list[Clip]) -> list[Any]:
        groups: dict[tuple, list[int]] = {}
        for i, clip in enumerate(clips):
            groups.setdefault(clip.group, []).append(i)
        results: list[Any] = [None] * len(clips)
        with torch.inference_mode():
            for rows in groups.values():
                try:
                    for i, sequence in zip(rows, self.generate([clips[i] for i in rows]), strict=True):
                        results[i] = sequence
                except Exception as exc:  # this group's failure alone
                    for i in rows:
                        results[i] = exc
        return results

    async def close(self) -> None:
        await self.batcher.close()

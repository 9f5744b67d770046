"""Whisper's ASR stage: audio in, text out, concurrent requests transcribed together.

- The encoder is micro-batched (``omni_core.kits.MicroBatcher``): the clips waiting together get their log-mel
  features (each padded to Whisper's 30 s window, so a clip's features are the same alone or batched) and one
  encoder forward.
- The decoder runs on the decode loop (``omni_core.kits.DecodeLoop``, :mod:`.loop`): every live transcription
  advances by one token per step with its own KV; a request joins between two steps, whatever the others' settings,
  and leaves when its text ends. Its tokens go to its caller as they are made (a text chunk per token); the result
  holds the whole text, the token ids, the language and the duration.

Per request: ``audio`` (a 1-D float tensor with ``sample_rate``, a file path or an encoded file's bytes; at most
30 s: a longer clip is refused, not cut), ``language`` (a code such as ``en`` or a name such as ``english``;
absent: detected per clip as ``generate`` detects it), ``prompt`` (text the transcript continues), ``temperature``
(0: greedy; above 0: sampled from the request's own generator, ``seed``), ``max_new_tokens``, ``timestamps``
(true: Whisper's timestamp tokens are decoded, as ``generate(return_timestamps=True)`` does, and the result's
``segments`` are ``[{start, end, text}]``).
"""

from __future__ import annotations

from typing import Any

import torch
from omni_core.errors import InvalidInput
from omni_core.kits import DecodeLoop, MicroBatcher

from ..kit.batched import use_row_attention
from ..kit.chunks import TextChunk
from ..kit.media import load_audio
from ..kit.sampling import Sampler, TextDecoder, make_generator, resolve_model_path, torch_dtype
from ..kit.streams import request_seed
from .loop import DecodeRow, WhisperDecoding

RATE = 16000


class Transcriber:
    """Whisper ASR: ``{"audio", "sample_rate"?, "language"?, "prompt"?, "temperature"?}`` → text chunks as the
    tokens come, then ``{"text", "token_ids", "language", "duration"}``.

    ``max_batch_size``: the most clips in one encoder batch and the most rows in the decode loop; ``max_wait``: how
    long a clip waits for others before its encoder batch; ``max_new_tokens``: the default cap of a transcript
    (null: the checkpoint's generation config)."""

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
        use_row_attention(self.model, self.model.config)
        gen = self.generation_config = self.model.generation_config
        self.tokenizer = self.processor.tokenizer
        self.eos = gen.eos_token_id
        self.max_new_tokens = max_new_tokens or gen.max_new_tokens or self.model.config.max_target_positions // 2
        self.chunk_seconds = self.processor.feature_extractor.chunk_length
        lang_ids = getattr(gen, "lang_to_id", None) or {}
        self.lang_ids = {tok[2:-2]: i for tok, i in lang_ids.items()}  # "en" -> id of <|en|>
        self.names = {name: code for name, code in TO_LANGUAGE_CODE.items() if code in self.lang_ids}
        self.language_of_id = {i: LANGUAGES.get(tok[2:-2], tok[2:-2]) for tok, i in lang_ids.items()}
        # The decoder prompt generate builds: <|startoftranscript|>, the language, the task, <|notimestamps|>.
        task = (getattr(gen, "task_to_id", None) or {}).get("transcribe")
        self.init = [gen.decoder_start_token_id] + ([-1] if lang_ids else []) + ([task] if task is not None else [])
        self.init_timestamps = list(self.init)  # with timestamps the prompt ends at the task
        self.init.append(gen.no_timestamps_token_id)
        self.decoding = WhisperDecoding(self.model, gen, language_slot=1 if lang_ids else None)
        self.encoder = MicroBatcher(self._encode, max_batch_size=max_batch_size, max_wait=max_wait,
                                    name="whisper-encoder")
        self.loop = DecodeLoop(self.decoding.step, max_batch_size=max_batch_size, name="whisper")

    # -- the request -------------------------------------------------------------------------------
    def _language(self, value: Any) -> str | None:
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise InvalidInput(f"language must be a string such as 'en', got {value!r}", field="language")
        code = value.lower()
        code = self.names.get(code, code)
        if code not in self.lang_ids:
            known = ", ".join(sorted(self.lang_ids))
            raise InvalidInput(f"language {value!r} is not one this model knows; give a code: {known}",
                               field="language")
        return code

    def request(self, payload: dict, ctx: Any) -> tuple[Any, list[int], bool, Sampler, int, Any]:
        """The request's samples, decoder prompt, whether to detect the language, sampler, token cap and timestamp
        rules (None without timestamps)."""
        origin = getattr(ctx, "from_network", None)
        samples = load_audio(payload.get("audio"), "audio", sample_rate=payload.get("sample_rate"),
                             target_rate=RATE, origin=origin)
        if samples.size > self.chunk_seconds * RATE:
            raise InvalidInput(f"audio: the clip is {samples.size / RATE:.2f} s long; Whisper transcribes at most "
                               f"{self.chunk_seconds} s at once (long-form transcription is not served): split it",
                               field="audio")
        text = payload.get("prompt")
        if text is not None and not isinstance(text, str):
            raise InvalidInput(f"prompt must be a string, got {type(text).__name__}", field="prompt")
        temperature = payload.get("temperature", 0.0) or 0.0
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            raise InvalidInput(f"temperature must be a number from 0 to 2, got {temperature!r}", field="temperature")
        max_new = payload.get("max_new_tokens") or self.max_new_tokens
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise InvalidInput(f"max_new_tokens must be a positive integer, got {max_new!r}", field="max_new_tokens")
        timestamps = payload.get("timestamps", False)
        if not isinstance(timestamps, bool):
            raise InvalidInput(f"timestamps must be true or false, got {timestamps!r}", field="timestamps")
        language = self._language(payload.get("language"))
        prompt = list(self.init_timestamps if timestamps else self.init)
        if language is not None:
            prompt[1] = self.lang_ids[language]
        if text:
            prompt = self.processor.get_prompt_ids(text).tolist() + prompt
        sampler = Sampler(do_sample=temperature > 0, temperature=temperature or None,
                          generator=make_generator(request_seed(payload), self.device), device=self.device)
        stamps = None
        if timestamps:
            from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

            stamps = WhisperTimeStampLogitsProcessor(self.generation_config, begin_index=len(prompt))
        return samples, prompt, language is None and -1 in prompt, sampler, max_new, stamps

    async def __call__(self, payload: dict, ctx) -> dict:
        samples, prompt, detect, sampler, max_new, stamps = self.request(payload, ctx)
        encoded = await self.encoder.submit(samples)
        state = DecodeRow(encoded, prompt, detect, sampler, max_new, stamps)
        decoder = TextDecoder(self.tokenizer)
        async with self.loop.join(state, prompt_tokens=len(prompt), memory=state.reserved) as seq:
            async for token in seq:
                if token != self.eos and (text := decoder.push(token)):
                    await ctx.emit(TextChunk(text, [token]).to_wire())
        if tail := decoder.flush():
            await ctx.emit(TextChunk(tail).to_wire())
        tokens = [t for t in state.tokens if t != self.eos]
        language = self.language_of_id.get(state.prompt[1]) if self.decoding.language_slot is not None else None
        result = {"text": self.tokenizer.decode(tokens, skip_special_tokens=True), "token_ids": tokens,
                  "language": language, "duration": samples.size / RATE}
        if stamps is not None:
            result["segments"] = self.segments(tokens)
        return result

    def segments(self, tokens: list[int]) -> list[dict]:
        """``[{start, end, text}]`` (seconds) from a transcript's timestamp tokens, as the tokenizer reads them."""
        offsets = self.tokenizer.decode(tokens, output_offsets=True)["offsets"]
        return [{"start": float(o["timestamp"][0]), "end": float(o["timestamp"][1]), "text": o["text"]}
                for o in offsets if o["timestamp"][1] is not None]

    # -- the encoder batch (a worker thread) ------------------------------------------------------------
    def _encode(self, clips: list) -> list[torch.Tensor]:
        """Each clip's encoder states [1, 1500, d] (features padded to the 30 s window, one forward for all)."""
        features = self.processor.feature_extractor(clips, sampling_rate=RATE, return_tensors="pt").input_features
        with torch.inference_mode():
            states = self.model.model.encoder(features.to(self.device, self.model.dtype)).last_hidden_state
        return [states[i:i + 1] for i in range(len(clips))]

    async def close(self) -> None:
        await self.encoder.close()
        await self.loop.close()

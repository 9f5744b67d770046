"""The demo's own stages: preprocess, thinker, talker and vocoder (the encoders are the generic
``contrib.torch_module`` stage running :mod:`omni_contrib_stages.demo.models`).

See ``docs/demo.md`` for the graph and what travels on each edge.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import tempfile
import time
import wave
from collections.abc import Mapping
from typing import Any

import torch
from torch.nn import functional as F

from omni_core.errors import InvalidInput
from omni_core.files import local_path

from .models import PATTERN, VOCAB, Synth, TalkerLM, ThinkerLM, VocoderNet, to_pcm16

#: The sample rate of the input audio the preprocess stage makes or accepts.
INPUT_SAMPLE_RATE = 16000

#: The inputs error messages show: what works from anywhere (a wav_path is a server path, refused over the network).
EXAMPLE = '{"text": "hello omni", "max_tokens": 5}'


def _seeded(seed: int, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _bad_input(message: str, field: str | None = None) -> InvalidInput:
    return InvalidInput(f"{message}; the demo takes inputs like {EXAMPLE}", field=field)


def _file_name(request_id: str) -> str:
    """``request_id`` as a file name: characters other than letters, digits, ``.``, ``_`` and
    ``-`` become ``_`` (and a leading dot), plus a hash of the id when anything changed, so two
    ids never share a file."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", request_id)[:100]
    name = "_" + name[1:] if name.startswith(".") else name
    if name != request_id:
        name += "-" + hashlib.sha256(request_id.encode()).hexdigest()[:12]
    return name


# -- preprocess ---------------------------------------------------------------------------------


class Preprocess:
    """Checks the inputs and prepares each branch's part of a split payload::

        {"audio":  {"features": [frames, n_features]},      # for audio_encoder
         "image":  {"pixels": [3, image_size, image_size]},  # for image_encoder
         "speech": {"wav_path": "/abs/path.wav" | None,      # for talker (then vocoder)
                    "stream_audio": False},
         "shared": {"text", "text_ids", "max_tokens"},       # every branch gets these
         "_to": [...]}                                       # only when "speak": false

    Inputs: ``text`` (required), ``max_tokens`` (words to write, default 13 = one sentence),
    ``wav_path`` (the WAV file the vocoder writes, relative to the directory omni runs in; a server
    path, so a request over the network may name one only where ``serve.allow_local_files``
    allows it, see :mod:`omni_core.files`; default: none, unless the stage's ``wav_dir`` argument
    names a folder, then ``<wav_dir>/<request id>.wav``; null: no file), ``speak``
    (default true; false skips the talker and vocoder by routing to ``without_speech`` only),
    ``stream_audio`` (default false; true makes the vocoder stream its audio to the caller as
    ``{"index", "pcm16", "sample_rate"}`` chunks, as ``omni serve``'s OpenAI API asks it to),
    ``audio`` (optional list of samples at 16 kHz; default: a tone made from the text) and
    ``image`` (optional ``[h][w]`` or ``[h][w][3]`` list of numbers in 0..1; default: a pattern
    made from the text).
    """

    def __init__(self, n_features: int = 64, image_size: int = 32, audio_seconds: float = 1.0,
                 wav_dir: str | None = None, max_tokens_limit: int = 64,
                 without_speech: list[str] | None = None):
        self.n_features = n_features
        self.image_size = image_size
        self.audio_seconds = audio_seconds
        self.wav_dir = wav_dir
        self.max_tokens_limit = max_tokens_limit
        self.without_speech = list(without_speech) if without_speech else None

    def __call__(self, inputs: Any, ctx: Any) -> dict[str, Any]:
        if not isinstance(inputs, Mapping):
            raise _bad_input(f"expected a JSON object, got {type(inputs).__name__}")
        unknown = sorted(set(inputs) - {"text", "max_tokens", "wav_path", "speak", "stream_audio", "audio", "image"})
        if unknown:
            raise _bad_input(f"unknown input key(s) {unknown}; known: text, max_tokens, wav_path, speak, stream_audio, audio, image",
                             unknown[0])
        text = inputs.get("text")
        if not isinstance(text, str) or not text.strip():
            raise _bad_input("'text' must be a non-empty string", "text")
        max_tokens = inputs.get("max_tokens", 13)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= self.max_tokens_limit:
            raise _bad_input(f"'max_tokens' must be an integer from 1 to {self.max_tokens_limit}, got {max_tokens!r}",
                             "max_tokens")
        if "wav_path" in inputs:  # the caller's file: a server path, under the local-file rule
            wav_path = inputs["wav_path"]
            if wav_path is not None and (not isinstance(wav_path, str) or not wav_path):
                raise _bad_input(f"'wav_path' must be a file name or null (no file), got {wav_path!r}", "wav_path")
            if wav_path is not None:
                wav_path = str(local_path(ctx, wav_path, "wav_path", write=True))
        else:  # the operator's folder (none by default: no file)
            wav_path = None if self.wav_dir is None else os.path.join(self.wav_dir, _file_name(ctx.request_id) + ".wav")
        speak = inputs.get("speak", True)
        if not isinstance(speak, bool):
            raise _bad_input(f"'speak' must be true or false, got {speak!r}", "speak")
        stream_audio = inputs.get("stream_audio", False)
        if not isinstance(stream_audio, bool):
            raise _bad_input(f"'stream_audio' must be true or false, got {stream_audio!r}", "stream_audio")
        text_ids = list(text.encode("utf-8"))[:512]
        audio = self._audio(inputs.get("audio"), text_ids)
        payload: dict[str, Any] = {
            "audio": {"features": self._features(audio)},
            "image": {"pixels": self._image(inputs.get("image"), text_ids)},
            "speech": {"wav_path": None if wav_path is None else os.path.abspath(os.path.expanduser(wav_path)),
                       "stream_audio": stream_audio},
            "shared": {"text": text, "text_ids": text_ids, "max_tokens": max_tokens},
        }
        if not speak:
            if self.without_speech is None:
                raise _bad_input("'speak': false needs the preprocess stage's 'without_speech' argument in the config",
                                 "speak")
            payload["_to"] = self.without_speech
        return payload

    def _audio(self, audio: Any, text_ids: list[int]) -> torch.Tensor:
        if audio is not None:
            try:
                wave_ = torch.as_tensor(audio, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError):
                raise _bad_input("'audio' must be a list of numbers (samples at 16 kHz)", "audio") from None
            if wave_.dim() != 1 or wave_.numel() < 400:
                raise _bad_input(f"'audio' must be a flat list of at least 400 samples, got shape {tuple(wave_.shape)}",
                                 "audio")
            return wave_
        # A chord whose notes come from the text: different texts sound different.
        t = torch.arange(int(self.audio_seconds * INPUT_SAMPLE_RATE), dtype=torch.float32) / INPUT_SAMPLE_RATE
        notes = [220.0 * 2 ** ((b % 24) / 12) for b in text_ids[:3]] or [220.0]
        return sum(torch.sin(2 * math.pi * f * t) for f in notes) / len(notes)

    def _features(self, audio: torch.Tensor) -> torch.Tensor:
        """Log band energies: ``[frames, n_features]`` (25 ms windows, 10 ms hop)."""
        spec = torch.stft(audio, n_fft=400, hop_length=160, window=torch.hann_window(400), return_complex=True).abs()
        bands = F.adaptive_avg_pool1d(spec.T.unsqueeze(0), self.n_features).squeeze(0)
        return torch.log1p(bands)

    def _image(self, image: Any, text_ids: list[int]) -> torch.Tensor:
        size = self.image_size
        if image is not None:
            try:
                pixels = torch.as_tensor(image, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError):
                raise _bad_input("'image' must be a nested list of numbers ([h][w] or [h][w][3])", "image") from None
            if pixels.dim() == 2:
                pixels = pixels.unsqueeze(-1).expand(-1, -1, 3)
            if pixels.dim() != 3 or pixels.shape[-1] != 3 or 0 in pixels.shape:
                raise _bad_input(f"'image' must be [h][w] or [h][w][3] with h and w at least 1, got shape "
                                 f"{tuple(pixels.shape)}", "image")
            pixels = pixels.permute(2, 0, 1).unsqueeze(0)
            return F.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False).squeeze(0)
        # Stripes whose angle and colours come from the text.
        seed = sum(text_ids) or 1
        y, x = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32), indexing="ij")
        angle = (seed % 360) * math.pi / 180
        stripes = torch.sin((x * math.cos(angle) + y * math.sin(angle)) * (1 + seed % 5) / 4)
        colours = torch.tensor([(seed >> k) % 7 / 6 for k in (0, 3, 6)], dtype=torch.float32)
        return (0.5 + 0.5 * stripes).unsqueeze(0) * colours.view(3, 1, 1)


# -- thinker --------------------------------------------------------------------------------------


class Thinker:
    """Writes ``max_tokens`` words, emitting each one as it is chosen::

        chunk:  {"index": i, "token_id": id, "text": word}
        result: {"text": "the quiet river ... .", "token_ids": [...],
                 "prompt_tokens": n, "completion_tokens": m, "finish_reason": "stop" | "length"}

    ``prompt_tokens`` counts what the model read: the encoders' prefix rows plus the prompt's
    bytes; ``completion_tokens`` the words written. A sentence is 13 words (the grammar's
    pattern): an answer that ends on a whole sentence ends with ``stop``, one that ``max_tokens``
    cut in the middle of a sentence with ``length``.

    A plain (sync) stage: it runs in a worker thread and streams with ``ctx.emit_threadsafe``.
    ``token_delay`` adds that many seconds per token, as a larger model would take, so the
    stream can be watched; the text does not depend on it.
    """

    def __init__(self, dim: int = 32, seed: int = 13, token_delay: float = 0.0, no_repeat: int = 8, device: str = "cpu"):
        self.model = _seeded(seed, lambda: ThinkerLM(dim)).to(device).eval()
        self.device = device
        self.token_delay = token_delay
        self.no_repeat = no_repeat

    def __call__(self, payload: dict[str, Any], ctx: Any) -> dict[str, Any]:
        embeds = payload["embeds"].to(self.device, torch.float32)
        text_ids = torch.tensor(payload["text_ids"], dtype=torch.long, device=self.device)
        words, ids = [], []
        with torch.inference_mode():
            for index, token in enumerate(self.model.generate(embeds, text_ids, payload["max_tokens"], no_repeat=self.no_repeat)):
                if ctx.aborted:
                    break
                if self.token_delay:
                    time.sleep(self.token_delay)
                ids.append(token)
                words.append(VOCAB[token])
                ctx.emit_threadsafe({"index": index, "token_id": token, "text": VOCAB[token]})
        return {"text": " ".join(words) + ".", "token_ids": ids,
                "prompt_tokens": int(embeds.shape[0]) + len(payload["text_ids"]), "completion_tokens": len(ids),
                "finish_reason": "stop" if ids and len(ids) % len(PATTERN) == 0 else "length"}


# -- talker ---------------------------------------------------------------------------------------


class Talker:
    """Reads the thinker's tokens as they stream in and emits codec frames for each::

        chunk:  {"index": i, "codes": int64 [frames_per_token, codebooks], "stream_audio": bool}
        result: {"wav_path": ..., "tokens": n, "frames": m, "stream_audio": bool}
                                                                   (the vocoder's payload)

    Its payload (``{"wav_path", "stream_audio"}`` plus the shared inputs) comes early, straight
    from preprocess, so it speaks while the thinker is still writing. Each chunk tells the vocoder,
    whose own payload comes only when the talker is done, whether to stream its audio.
    """

    def __init__(self, source: str = "thinker", dim: int = 32, codebooks: int = 4, codebook_size: int = 64,
                 frames_per_token: int = 4, seed: int = 14, device: str = "cpu"):
        self.source = source
        self.device = device
        self.model = _seeded(seed, lambda: TalkerLM(dim, codebooks, codebook_size, frames_per_token)).to(device).eval()

    async def __call__(self, payload: dict[str, Any], ctx: Any) -> dict[str, Any]:
        payload = await ctx.payload()  # from preprocess: here before the first word, in practice
        stream_audio = bool(payload.get("stream_audio", False))
        state = self.model.initial_state().to(self.device)
        tokens = frames = 0
        async for chunk in ctx.stream_from(self.source):
            with torch.inference_mode():
                codes, state = self.model.speak(int(chunk["token_id"]), state)
            codes = codes.cpu().clone()
            await ctx.emit({"index": tokens, "codes": codes, "stream_audio": stream_audio})
            tokens += 1
            frames += codes.shape[0]
        return {"wav_path": payload["wav_path"], "tokens": tokens, "frames": frames, "stream_audio": stream_audio}


# -- vocoder --------------------------------------------------------------------------------------


class Vocoder:
    """Turns the talker's codec frames into audio as they stream in, emitting each frame's
    audio at once when the frames ask for it (``stream_audio``), and writes a WAV file (mono,
    16-bit PCM) at ``wav_path`` (none when it is null)::

        chunk:  {"index": i, "pcm16": bytes, "sample_rate": 24000}     (only with stream_audio)
        result: {"wav_path": "/abs/path.wav", "sample_rate": 24000, "duration": 2.7,
                 "samples": ..., "frames": ...}

    Its call starts on the talker's first frames (``can_accept_stream_before_payload``); its
    payload, the talker's result with the file name, comes when the talker is done, and the file
    is written then, under a temporary name renamed when complete, so a reader never sees half a
    file and an aborted request leaves nothing behind.
    """

    def __init__(self, source: str = "talker", sample_rate: int = 24000, hop: int = 1200, dim: int = 32,
                 codebooks: int = 4, codebook_size: int = 64, harmonics: int = 4, seed: int = 15, device: str = "cpu"):
        self.source = source
        self.sample_rate = sample_rate
        self.hop = hop
        self.device = device
        self.model = _seeded(seed, lambda: VocoderNet(dim, codebooks, codebook_size, harmonics)).to(device).eval()

    async def __call__(self, payload: Any, ctx: Any) -> dict[str, Any]:
        synth = Synth(self.sample_rate, self.hop)
        audio = bytearray()
        frames = index = 0
        async for chunk in ctx.stream_from(self.source):  # from the talker's first frames on
            codes = chunk["codes"].to(self.device)
            with torch.inference_mode():
                params = self.model(codes).cpu()
            pcm = to_pcm16(synth.frames(params))
            audio += pcm
            frames += codes.shape[0]
            if chunk.get("stream_audio"):
                await ctx.emit({"index": index, "pcm16": pcm, "sample_rate": self.sample_rate})
                index += 1
        payload = await ctx.payload()  # the talker's result: it came with the end of its frames
        tail = to_pcm16(synth.tail())
        audio += tail
        if payload.get("stream_audio"):
            await ctx.emit({"index": index, "pcm16": tail, "sample_rate": self.sample_rate})
        path = payload["wav_path"]
        if path is not None:
            path = os.path.abspath(path)
            self._write(path, audio)
        return {
            "wav_path": path,
            "sample_rate": self.sample_rate,
            "duration": synth.samples / self.sample_rate,
            "samples": synth.samples,
            "frames": frames,
        }

    def _write(self, path: str, audio: bytes) -> None:
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".partial", dir=folder)
        try:
            with os.fdopen(fd, "wb") as raw, wave.open(raw, "wb") as out:
                out.setnchannels(1)
                out.setsampwidth(2)
                out.setframerate(self.sample_rate)
                out.writeframes(audio)
            os.chmod(partial, 0o644)
            os.replace(partial, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise

"""The token2wav stage: codec codes -> waveform (DiT flow matching + BigVGAN), synthesised in chunks
as the talker's codes arrive.

The chunk schedule (``first_chunk_codes``, then chunks ``chunk_growth`` times larger, at most
``max_chunk_codes``) and the context each chunk is computed with follow the model's structure:

- The DiT attends block-wise (``block_size`` mel frames): a layer with look-back / look-ahead
  sees one block before / after its own. A chunk's mel comes from the ODE run over a window that
  starts ``lookback_codes`` before the chunk and ends ``lookahead_codes`` after it, both aligned to
  DiT blocks, so every frame of the chunk sees the blocks the unchunked run would show it at each
  evaluation nearby. (The ODE's 4 × (num_steps − 1) evaluations compound the look-ahead, so the
  far future still reaches a frame a little: the chunks equal the unchunked synthesis within a
  measured bound, not bit for bit; see docs/models.md.)
- The initial noise of a window is the slice of the noise the unchunked synthesis draws (a CPU
  generator's ``randn`` of n frames is the prefix of a longer draw, but for its last 16 values,
  which only the final chunk uses, drawn exactly).
- BigVGAN is convolutional: each chunk is vocoded with ``vocoder_context`` mel frames on each side
  (its receptive field, measured when the stage starts) and trimmed to its own samples, so the
  vocoder adds no error of its own.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import attrs
import torch
from omni_core.files import local_path
from omni_core.kits import MicroBatcher

from ..kit.chunks import ChunkError, CodesChunk, TextChunk, codes_chunk
from ..kit.sampling import make_generator, resolve_model_path, torch_dtype
from .common import DEFAULT_SPEAKER, USAGE_KEYS, StreamProgress, request_seed, sample_rate_of
from .parts import load_part, load_speakers, speaker_params


def vocoder_receptive_field(vocoder, mel_dim: int, hop: int, device, start: int = 16, limit: int = 1024) -> int:
    """How many mel frames on either side of a frame change BigVGAN's output for it: a one-frame
    change in the middle of a random mel, and the span of samples it moves (grown until the span
    stays inside the probe)."""
    probe = start
    generator = torch.Generator().manual_seed(0)
    while probe <= limit:
        length = 2 * probe + 1
        mel = torch.randn(1, mel_dim, length, generator=generator).to(device) * 0.5 - 4
        bumped = mel.clone()
        bumped[..., probe] += 1.0
        with torch.inference_mode():
            moved = (vocoder(mel).reshape(-1) != vocoder(bumped).reshape(-1)).nonzero().reshape(-1)
        if moved.numel() == 0:
            return 0
        first, last = int(moved[0]) // hop, int(moved[-1]) // hop
        reach = max(probe - first, last - probe)
        if first > 0 and last < length - 1:
            return reach + 1
        probe *= 2
    raise RuntimeError(f"BigVGAN's receptive field is wider than {limit} mel frames on each side")


#: The stated bound between streamed chunks (concatenated) and the unchunked synthesis of the same
#: codes with the same noise: relative RMS error and Pearson correlation (measured on the tiny
#: checkpoint with the default schedule: about 1e-6 and 1.0; docs/models.md).
STREAM_MAX_RELATIVE_ERROR = 1e-4
STREAM_MIN_CORRELATION = 0.9999


#: Chunks of concurrent requests share the DiT's forward; a row of a batched matrix product may differ
#: from the lone one in the last bits of float32, so a request's waveform beside others equals its
#: waveform alone within this relative RMS error (the tests compare concurrent with sequential so).
BATCHED_MAX_RELATIVE_ERROR = 1e-5


def stream_error(streamed: torch.Tensor, unchunked: torch.Tensor) -> tuple[float, float]:
    """(relative RMS error, correlation) of a streamed waveform against the unchunked one."""
    if streamed.shape != unchunked.shape:
        raise ValueError(f"the streamed audio has {streamed.numel()} samples, the unchunked {unchunked.numel()}")
    a, b = streamed.double(), unchunked.double()
    if b.numel() == 0:
        return 0.0, 1.0
    rel = float((a - b).norm() / b.norm().clamp_min(1e-30))
    corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1]) if b.numel() > 1 else 1.0
    return rel, corr


class Token2Wav:
    """Codes → waveform (DiT flow matching + BigVGAN), streamed: ``{"audio", "sample_rate"}`` chunks
    as the talker's codes arrive (``stream: false``: one chunk once the codes are all in, equal to
    ``generate``'s). Forwards the text chunks to the caller as they come; returns the whole result.

    Chunk schedule: the first chunk holds ``first_chunk_codes`` codes and is synthesised once
    ``lookahead_codes`` more have arrived; each next chunk is ``chunk_growth`` times larger, up to
    ``max_chunk_codes``; when the talker ends, the rest comes as one chunk. Chunk boundaries and
    context are rounded up to whole DiT blocks."""

    def __init__(self, model: str | None = None, device: str = "cpu", dtype: str = "float32", num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0, sample_rate: int | None = None,
                 wav_path: str | None = None, source: str = "talker", stream: bool = True,
                 first_chunk_codes: int = 4, chunk_growth: float = 2.0, max_chunk_codes: int = 256,
                 lookahead_codes: int = 8, lookback_codes: int = 8, vocoder_context: int | None = None,
                 max_batch_size: int = 16, max_wait: float = 0.002, stage_name: str = "token2wav"):
        self.path = resolve_model_path(model)
        self.device = torch.device(device)
        if torch_dtype(dtype, torch.float32) != torch.float32:
            raise ValueError("token2wav runs in float32 (as transformers runs it); set dtype: float32")
        self.model = load_part(self.path, "token2wav", device=device)
        self.speakers = load_speakers(self.path)
        self.options = {"num_steps": num_steps, "guidance_scale": guidance_scale, "sway_coefficient": sway_coefficient}
        self.sample_rate = sample_rate or sample_rate_of(self.path)
        self.wav_path = wav_path
        self.source = source
        self.stream = stream
        dit = self.model.code2wav_dit_model
        self.repeats = dit.repeats
        # Chunk boundaries fall on DiT block boundaries: `align` codes make whole blocks.
        self.align = math.lcm(dit.block_size, dit.repeats) // dit.repeats
        for name, value in (("first_chunk_codes", first_chunk_codes), ("max_chunk_codes", max_chunk_codes)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in (("lookahead_codes", lookahead_codes), ("lookback_codes", lookback_codes)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not chunk_growth >= 1:
            raise ValueError(f"chunk_growth must be at least 1, got {chunk_growth!r}")
        self.first_chunk_codes = self._aligned(first_chunk_codes)
        self.max_chunk_codes = max(self.first_chunk_codes, self._aligned(max_chunk_codes))
        self.chunk_growth = float(chunk_growth)
        self.lookahead_codes = self._aligned(lookahead_codes)
        self.lookback_codes = self._aligned(lookback_codes)
        vocoder = self.model.code2wav_bigvgan_model
        self.hop = math.prod(vocoder.config.upsample_rates)
        if vocoder_context is None:
            vocoder_context = vocoder_receptive_field(vocoder, vocoder.config.mel_dim, self.hop, self.device)
        self.vocoder_context = int(vocoder_context)
        # Chunks of concurrent requests share the DiT's forward (windows of one length together).
        self.batcher = MicroBatcher(self._chunks, max_batch_size=max_batch_size, max_wait=max_wait, name=stage_name)

    def _aligned(self, codes: int) -> int:
        return -(-codes // self.align) * self.align

    def chunk_schedule(self, total: int | None = None) -> list[int]:
        """The chunk sizes in codes (for ``total`` codes, the last one what is left)."""
        sizes, size, done = [], self.first_chunk_codes, 0
        while total is None and len(sizes) < 8 or total is not None and done < total:
            sizes.append(size if total is None else min(size, total - done))
            done += sizes[-1]
            size = min(self.max_chunk_codes, self._aligned(int(size * self.chunk_growth)))
        return sizes

    # -- model steps (worker threads) ---------------------------------------------------
    def _mel(self, codes: list[list[int]], noise: torch.Tensor, speakers: list[dict]) -> torch.Tensor:
        """Qwen2_5OmniToken2WavDiTModel.sample on each row of ``codes`` (B rows of one length) from
        the initial ``noise`` [B, frames, mel], each with its speaker: the mel [B, frames, mel]."""
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        dit = self.model.code2wav_dit_model
        code = torch.tensor(codes, dtype=torch.long, device=self.device)
        noise = noise.to(self.device)
        cond = torch.stack([s["cond"].to(self.device).float().reshape(-1) for s in speakers])
        ref_mel = torch.cat([s["ref_mel"].to(self.device).float().reshape(1, *s["ref_mel"].shape[-2:])
                             for s in speakers])
        cond = cond.unsqueeze(1).repeat(1, noise.shape[1], 1)
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
        return trajectory[-1]

    def _mel_many(self, windows: list[_Window]) -> list[torch.Tensor]:
        """The mel [frames, mel dim] of each window: windows of one length and one reference mel
        shape run through the ODE together (their rows are computed as each alone would be)."""
        groups: dict[tuple, list[int]] = {}
        for i, w in enumerate(windows):
            ref = w.synthesis.speaker["ref_mel"]
            groups.setdefault((len(w.codes), tuple(ref.shape)), []).append(i)
        mels: list[torch.Tensor | None] = [None] * len(windows)
        for members in groups.values():
            batch = [windows[i] for i in members]
            speakers = [w.synthesis.speaker for w in batch]
            mel = self._mel([w.codes for w in batch], torch.stack([w.noise for w in batch]), speakers)
            for row, i in enumerate(members):
                mels[i] = mel[row].float()
        return mels

    def _chunks(self, items: list[tuple[ChunkedSynthesis, list[int], bool]]) -> list[torch.Tensor | Exception]:
        """The next chunk of each request (the micro-batcher's function: a worker thread)."""
        with torch.inference_mode():
            windows: list = []
            for synthesis, codes, final in items:
                try:
                    windows.append(synthesis.plan(codes, final))
                except Exception as exc:  # this request's failure alone
                    windows.append(exc)
            ready = [w for w in windows if isinstance(w, _Window)]
            mels = dict(zip(map(id, ready), self._mel_many(ready), strict=True)) if ready else {}
            out: list = []
            for w in windows:
                if w is None:
                    out.append(torch.zeros(0))
                elif isinstance(w, Exception):
                    out.append(w)
                else:
                    try:
                        out.append(w.synthesis.finish(w, mels[id(w)]))
                    except Exception as exc:
                        out.append(exc)
            return out

    async def close(self) -> None:
        await self.batcher.close()

    def _check_length(self, n_codes: int) -> None:
        dit = self.model.code2wav_dit_model
        if n_codes * dit.repeats > dit.config.max_position_embeddings:
            raise ValueError(f"{n_codes} codes make a mel of {n_codes * dit.repeats} frames, more than the DiT's "
                             f"max_position_embeddings ({dit.config.max_position_embeddings})")

    def _synthesize(self, codes: list[int], speaker: dict, generator: torch.Generator) -> torch.Tensor:
        """The whole waveform at once, as ``Qwen2_5OmniToken2WavModel.forward`` (the noise from ``generator``)."""
        self._check_length(len(codes))
        with torch.inference_mode():
            dit = self.model.code2wav_dit_model
            noise = torch.randn([1, len(codes) * dit.repeats, dit.mel_dim], dtype=torch.float32, device=self.device,
                                generator=generator)
            mel = self._mel([codes], noise, [speaker]).permute(0, 2, 1)
            return self.model.code2wav_bigvgan_model(mel).reshape(-1).float().cpu()

    async def __call__(self, payload: dict, ctx) -> dict:
        from omni_core import PENDING

        received = _Received(ctx, self.source)
        reader = asyncio.create_task(received.read())  # text goes on to the caller before the payload is here
        chunks: list[torch.Tensor] = []
        wav: WavWriter | None = None

        async def emit(audio: torch.Tensor) -> None:
            chunks.append(audio)
            if wav is not None:
                await asyncio.to_thread(wav.write, audio)
            await ctx.emit({"audio": audio, "sample_rate": self.sample_rate})

        try:
            if payload is PENDING:  # started on the talker's first chunk (can_accept_stream_before_payload)
                payload = await ctx.payload()
            speaker = speaker_params(self.speakers, payload.get("speaker", DEFAULT_SPEAKER))
            generator = make_generator(request_seed(payload), self.device)
            if "wav_path" in payload:  # the request's file (the operator's wav_path otherwise)
                wav_path = payload["wav_path"] and str(local_path(ctx, payload["wav_path"], "wav_path", write=True))
            else:
                wav_path = self.wav_path
            if wav_path:
                wav = WavWriter(str(wav_path), self.sample_rate)
            if self.stream:
                synthesis = ChunkedSynthesis(self, speaker, generator)
                while True:
                    await received.wait(lambda: synthesis.ready(len(received.codes), received.finished))
                    if synthesis.ready(len(received.codes), received.finished):
                        codes, final = list(received.codes), received.finished
                        audio = await self.batcher.submit((synthesis, codes, final))
                        if audio.numel():
                            await emit(audio)
                    elif received.finished:
                        break
            await reader
            if not self.stream:
                if received.rng_state is not None:  # continue the talker's RNG, as generate's global one
                    generator.set_state(received.rng_state)
                await emit(await asyncio.to_thread(self._synthesize, received.codes, speaker, generator)
                           if received.codes else torch.zeros(0))  # generate fails on an empty code sequence
            if not chunks:  # the talker ended at once
                await emit(torch.zeros(0))
            if wav is not None:
                wav_path = await asyncio.to_thread(wav.close)
                wav = None
        finally:
            if not reader.done():
                reader.cancel()
            if wav is not None:
                wav.abort()
        audio = torch.cat(chunks)
        result = {"text": "".join(received.text), "token_ids": received.token_ids, "codes": received.codes,
                  "audio": audio, "sample_rate": self.sample_rate}
        for key in USAGE_KEYS:
            if key in received.extra:
                result[key] = received.extra[key]
        if wav_path:
            result["wav_path"] = wav_path
        return result


class _Received(StreamProgress):
    """What the talker's stream brought so far, read in a task of its own: forwards text to the
    caller at once, keeps the codes; ``wait(ready)`` returns when ``ready()`` holds or the stream
    ended."""

    def __init__(self, ctx, source: str):
        super().__init__(source)
        self.ctx = ctx
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.codes: list[int] = []
        self.extra: dict = {}
        self.finished = False
        self.rng_state: torch.Tensor | None = None

    async def _read(self) -> None:
        async for wire in self.ctx.stream_from(self.source):
            chunk = codes_chunk(wire)
            if isinstance(chunk, CodesChunk):
                if chunk.codebooks != 1:
                    raise ChunkError(f"token2wav takes one code per frame, got frames of {chunk.codebooks}")
                self.codes.extend(int(c) for c in chunk.codes)
                if chunk.final:
                    self.finished = True
                    if chunk.rng_state is not None:
                        self.rng_state = torch.frombuffer(bytearray(chunk.rng_state), dtype=torch.uint8)
            else:
                if "text" in wire:
                    self.text.append(chunk.text)
                    self.token_ids.extend(chunk.token_ids)
                    await self.ctx.emit(TextChunk(chunk.text, chunk.token_ids).to_wire())
                self.extra.update({k: chunk.usage[k] for k in USAGE_KEYS if k in chunk.usage})
            self.changed.set()
        if not self.finished:
            raise RuntimeError(f"the {self.source} stream ended without its final chunk")


@attrs.define
class _Window:
    """One chunk to make: the DiT window's codes and initial noise [frames, mel dim], where the
    window starts and the chunk's own codes ``[start, end)``."""

    synthesis: ChunkedSynthesis
    codes: list[int]
    noise: torch.Tensor
    window_start: int
    start: int
    end: int
    scheduled: bool
    final: bool


class ChunkedSynthesis:
    """One request's streamed synthesis: ``ready(n, final)`` says whether the next chunk can be
    made from ``n`` codes, ``next_chunk(codes, final)`` makes it (a worker thread)."""

    def __init__(self, stage: Token2Wav, speaker: dict, generator: torch.Generator):
        self.stage = stage
        self.speaker = speaker
        self.noise_state = generator.get_state()
        self.noise = torch.zeros(0)  # a prefix of the noise draw (frames x mel), grown as needed
        dit = stage.model.code2wav_dit_model
        self.mel_dim = dit.mel_dim
        self.margin = -(-16 // (dit.repeats * dit.mel_dim))  # codes holding 16 noise values
        self.done = 0  # codes whose audio was made
        self.size = stage.first_chunk_codes
        self.mel = torch.zeros(0, self.mel_dim)  # the mel of the codes done (frames x mel)
        self.finished = False

    def _scheduled(self, n: int) -> bool:
        """Whether ``n`` codes hold the next scheduled chunk, its look-ahead and the codes of 16 noise values more: the
        noise of a window then never reaches the last 16 values of the final draw, so a chunk does
        not depend on whether the talker had ended when it was made."""
        return n >= self.done + self.size + self.stage.lookahead_codes + self.margin

    def ready(self, n: int, final: bool) -> bool:
        if self.finished:
            return False
        return final or self._scheduled(n)

    def _noise(self, frames: int, total: int | None) -> torch.Tensor:
        """The first ``frames`` frames of the noise; ``total``: the whole draw's length when known."""
        generator = torch.Generator(device=self.stage.device)
        generator.set_state(self.noise_state)
        if total is not None:  # the final draw: exactly what the unchunked synthesis draws
            return torch.randn([total, self.mel_dim], generator=generator, device=self.stage.device)[:frames]
        if self.noise.shape[0] < frames + 16:  # a longer draw: equal to the final one but for its last 16 values
            length = max(2 * self.noise.shape[0], frames + 16, 256)
            self.noise = torch.randn([length, self.mel_dim], generator=generator, device=self.stage.device)
        return self.noise[:frames]

    def plan(self, codes: list[int], final: bool) -> _Window | None:
        """The next chunk's DiT window (None: nothing is left, the synthesis is finished)."""
        stage = self.stage
        rep, n = stage.repeats, len(codes)
        start = self.done
        scheduled = self._scheduled(n)
        end = start + self.size if scheduled else n  # after the talker's end: the rest, once none is scheduled
        window_end = end + stage.lookahead_codes if scheduled else n
        stage._check_length(window_end)
        if end <= start:
            self.finished = final
            return None
        window_start = max(0, start - stage.lookback_codes)
        noise = self._noise(window_end * rep, n * rep if final else None)[window_start * rep:]
        return _Window(self, codes[window_start:window_end], noise, window_start, start, end, scheduled, final)

    def finish(self, window: _Window, mel: torch.Tensor) -> torch.Tensor:
        """The chunk's audio from its window's mel [frames, mel dim]: vocoded with the receptive
        field's context on each side, trimmed to the chunk's own samples."""
        stage = self.stage
        rep = stage.repeats
        first, last = window.start * rep, window.end * rep  # this chunk's mel frames
        offset = window.window_start * rep
        ctx = stage.vocoder_context
        left = self.mel[max(0, first - ctx):first]
        right_end = min(offset + mel.shape[0], last + ctx)
        own = mel[first - offset:right_end - offset]
        vocoded = torch.cat([left.to(own.device), own]).T[None]
        wave = stage.model.code2wav_bigvgan_model(vocoded).reshape(-1).float().cpu()
        skip = left.shape[0] * stage.hop
        audio = wave[skip:skip + (last - first) * stage.hop] if window.scheduled else wave[skip:]
        self.mel = torch.cat([self.mel, own[:last - first].cpu()])
        self.done = window.end
        self.size = min(stage.max_chunk_codes, stage._aligned(int(self.size * stage.chunk_growth)))
        self.finished = window.final and not window.scheduled
        return audio.contiguous()

    def next_chunk(self, codes: list[int], final: bool) -> torch.Tensor:
        """The next chunk's audio, computed alone (empty when nothing is left)."""
        return self.stage._chunks([(self, codes, final)])[0]


class WavWriter:
    """A 16-bit mono WAV written chunk by chunk: the first chunk goes to a new file beside
    ``path`` that is then renamed onto ``path``, and every later chunk is appended to it with the
    header brought up to date, so ``path`` is a whole WAV of the audio so far at every moment (a
    player can open it while the request runs). Concurrent requests naming one path never mix:
    each writes its own file, the last rename wins."""

    def __init__(self, path: str, sample_rate: int):
        self.target = Path(path).expanduser().resolve()
        self.sample_rate = sample_rate
        self._file = self._wave = None
        self._tmp: str | None = None

    def write(self, audio: torch.Tensor) -> None:
        import os
        import tempfile
        import wave

        pcm = (audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes()
        if self._wave is None:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            fd, self._tmp = tempfile.mkstemp(prefix=f".{self.target.name}.", dir=self.target.parent)
            self._file = os.fdopen(fd, "wb")  # noqa: SIM115 - open across chunks, closed in close()
            self._wave = wave.open(self._file, "wb")  # noqa: SIM115
            self._wave.setnchannels(1)
            self._wave.setsampwidth(2)
            self._wave.setframerate(self.sample_rate)
            self._wave.writeframes(pcm)  # the header is patched on every write with new frames
            self._file.flush()
            os.replace(self._tmp, self.target)
            self._tmp = None
        else:
            self._wave.writeframes(pcm)
            self._file.flush()

    def close(self) -> str:
        """Finish the file (an empty WAV if no chunk came) and return its path."""
        if self._wave is None:
            self.write(torch.zeros(0))
        self._wave.close()
        self._file.close()
        self._wave = None
        return str(self.target)

    def abort(self) -> None:
        """Close without finishing: the temporary file of a request that failed before its first
        chunk is removed."""
        for thing in (self._wave, self._file):
            try:
                if thing is not None:
                    thing.close()
            except Exception:  # noqa: BLE001 - best effort on a failed request
                pass
        if self._tmp is not None:
            Path(self._tmp).unlink(missing_ok=True)

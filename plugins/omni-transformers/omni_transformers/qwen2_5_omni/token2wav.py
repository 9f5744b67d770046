"""The token2wav stage: codec codes -> waveform (DiT flow matching + BigVGAN), synthesised in chunks
as the talker's codes arrive, in one of two modes (``mode``): ``exact`` (the schedule below, every
boundary on DiT blocks: equal to the unchunked synthesis within ``STREAM_MAX_RELATIVE_ERROR``) or
``fast`` (chunks of 1, 4, 16 ... codes, less look-ahead, windows still starting on DiT blocks: the
first audio after 4 codes, within the measured ``FAST_*`` bounds; docs/models.md).

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

import contextlib
import math
import threading
from collections.abc import Iterator

import attrs
import torch

from ..kit.sampling import torch_dtype
from ..kit.vocoder import (  # noqa: F401
    ChunkSchedule,
    StreamingVocoder,
    WavWriter,
    receptive_field,
    stream_difference,
    stream_error,
)
from .common import DEFAULT_SPEAKER, sample_rate_of
from .parts import load_part, load_speakers, speaker_params

#: The stated bound between streamed chunks (concatenated) and the unchunked synthesis of the same
#: codes with the same noise: relative RMS error and Pearson correlation (measured on the tiny
#: checkpoint with the default schedule: about 1e-6 and 1.0; docs/models.md).
STREAM_MAX_RELATIVE_ERROR = 1e-4
STREAM_MIN_CORRELATION = 0.9999


#: Each mode's chunk schedule in codes (``first_chunk_codes``, ``chunk_growth``, ``max_chunk_codes``,
#: ``lookahead_codes``, ``lookback_codes`` given to the stage override it).
SCHEDULES = {
    "exact": {"first": 4, "growth": 2.0, "largest": 256, "lookahead": 8, "lookback": 8},
    "fast": {"first": 1, "growth": 4.0, "largest": 256, "lookahead": 2, "lookback": 8},
}

#: fast mode's stated bound against the unchunked synthesis (relative RMS error, i.e. an SNR of at
#: least 46 dB, and correlation): measured on the tiny checkpoints at most 1.2e-3 (SNR 58 dB and up,
#: docs/models.md); the tests hold it to these.
FAST_MAX_RELATIVE_ERROR = 5e-3
FAST_MIN_CORRELATION = 0.9999

#: Chunks of concurrent requests share the DiT's forward; a row of a batched matrix product may differ
#: from the lone one in the last bits of float32, so a request's waveform beside others equals its
#: waveform alone within this relative RMS error (the tests compare concurrent with sequential so).
BATCHED_MAX_RELATIVE_ERROR = 1e-5


class Token2Wav(StreamingVocoder):
    """Codes → waveform (DiT flow matching + BigVGAN), streamed: ``{"audio", "sample_rate"}`` chunks
    as the talker's codes arrive (``stream: false``: one chunk once the codes are all in, equal to
    ``generate``'s). Forwards the text chunks to the caller as they come; returns the whole result.

    Chunk schedule (``mode``'s preset in :data:`SCHEDULES`, each value overridable): the first
    chunk holds ``first_chunk_codes`` codes and is synthesised once ``lookahead_codes`` more have
    arrived; each next chunk is ``chunk_growth`` times larger, up to ``max_chunk_codes``; when the
    talker ends, the rest comes as one chunk. ``exact``: chunk boundaries and context rounded up
    to whole DiT blocks; ``fast``: boundaries anywhere, each window starting on a block.
    ``first_chunk_priority`` / ``max_passed_over``: the batcher serves first chunks before later
    ones, a later chunk at most that many batches late (``kit.vocoder.ChunkBatcher``)."""

    def __init__(self, model: str | None = None, device: str = "cpu", dtype: str = "float32", num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0, sample_rate: int | None = None,
                 wav_path: str | None = None, source: str = "talker", stream: bool = True,
                 first_chunk_codes: int | None = None, chunk_growth: float | None = None,
                 max_chunk_codes: int | None = None, lookahead_codes: int | None = None,
                 lookback_codes: int | None = None, vocoder_context: int | None = None,
                 max_batch_size: int = 16, max_wait: float = 0.002, stage_name: str = "token2wav",
                 relay_text: bool = True, mode: str = "exact", first_chunk_priority: bool = True,
                 max_passed_over: int = 4):
        if torch_dtype(dtype, torch.float32) != torch.float32:
            raise ValueError("token2wav runs in float32 (as transformers runs it); set dtype: float32")
        super().__init__(model, device=device, dtype=dtype, sample_rate=sample_rate or 24000, wav_path=wav_path,
                         source=source, stream=stream, max_batch_size=max_batch_size, max_wait=max_wait,
                         stage_name=stage_name, relay_text=relay_text, mode=mode,
                         first_chunk_priority=first_chunk_priority, max_passed_over=max_passed_over)
        self.sample_rate = sample_rate or sample_rate_of(self.path)
        self.speakers = load_speakers(self.path)
        self.options = {"num_steps": num_steps, "guidance_scale": guidance_scale, "sway_coefficient": sway_coefficient}
        dit = self.model.code2wav_dit_model
        self.repeats = dit.repeats
        # Chunk boundaries fall on DiT block boundaries: `align` codes make whole blocks.
        self.schedule = ChunkSchedule.for_mode(mode, math.lcm(dit.block_size, dit.repeats) // dit.repeats, SCHEDULES,
                                               first=first_chunk_codes, growth=chunk_growth, largest=max_chunk_codes,
                                               lookahead=lookahead_codes, lookback=lookback_codes)
        self.speaker_encoder = SpeakerEncoderOnce(dit.input_embed.spk_encoder)
        self.block_mask = CompactBlockDiff(dit)
        vocoder = self.model.code2wav_bigvgan_model
        self.hop = math.prod(vocoder.config.upsample_rates)
        if vocoder_context is None:
            vocoder_context = receptive_field(vocoder, vocoder.config.mel_dim, self.hop, self.device)
        self.vocoder_context = int(vocoder_context)

    def load_model(self, path, *, dtype: str, device: str):
        return load_part(path, "token2wav", device=device)

    def speaker(self, payload: dict) -> dict:
        return speaker_params(self.speakers, payload.get("speaker", DEFAULT_SPEAKER))

    def new_synthesis(self, speaker: dict, generator: torch.Generator) -> ChunkedSynthesis:
        return ChunkedSynthesis(self, speaker, generator)

    def batch_key(self, window: _Window) -> tuple:
        """Windows of one length and one reference-mel shape run in one ODE."""
        return len(window.codes), tuple(window.synthesis.speaker["ref_mel"].shape)

    def chunk_schedule(self, total: int | None = None) -> list[int]:
        """The chunk sizes in codes (for ``total`` codes, the last one what is left)."""
        return self.schedule.sizes(total)

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
        with self.speaker_encoder.once():
            trajectory = RungeKutta4ODESolver(function=ode_function, initial_value=noise).integrate(times)
        return trajectory[-1]

    def run_windows(self, windows: list[_Window]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each window's chunk before trimming: (its own mel [frames, mel dim], the waveform vocoded
        from it with its context). Windows of one length and one reference mel shape run through the
        ODE together, and the vocoder inputs of one length through BigVGAN together (their rows are
        computed as each alone would be)."""
        groups: dict[tuple, list[int]] = {}
        for i, w in enumerate(windows):
            ref = w.synthesis.speaker["ref_mel"]
            groups.setdefault((len(w.codes), tuple(ref.shape)), []).append(i)
        mels: list = [None] * len(windows)
        for members in groups.values():
            batch = [windows[i] for i in members]
            speakers = [w.synthesis.speaker for w in batch]
            mel = self._mel([w.codes for w in batch], torch.stack([w.noise for w in batch]), speakers)
            for row, i in enumerate(members):
                mels[i] = mel[row].float()
        inputs = [w.synthesis.vocoder_input(w, mel) for w, mel in zip(windows, mels, strict=True)]
        waves = self._vocode([vocoded for vocoded, _ in inputs])
        return [(own, wave) for (_, own), wave in zip(inputs, waves, strict=True)]

    def _vocode(self, mels: list[torch.Tensor]) -> list[torch.Tensor]:
        """BigVGAN on each mel [frames, mel dim] → its waveform; mels of one length in one call."""
        groups: dict[int, list[int]] = {}
        for i, mel in enumerate(mels):
            groups.setdefault(mel.shape[0], []).append(i)
        waves: list = [None] * len(mels)
        for members in groups.values():
            batch = torch.stack([mels[i] for i in members]).transpose(1, 2)
            out = self.model.code2wav_bigvgan_model(batch).reshape(len(members), -1).float().cpu()
            for row, i in enumerate(members):
                waves[i] = out[row]
        return waves

    def _check_length(self, n_codes: int) -> None:
        dit = self.model.code2wav_dit_model
        if n_codes * dit.repeats > dit.config.max_position_embeddings:
            raise ValueError(f"{n_codes} codes make a mel of {n_codes * dit.repeats} frames, more than the DiT's "
                             f"max_position_embeddings ({dit.config.max_position_embeddings})")

    def synthesize(self, codes: list[int], speaker: dict, generator: torch.Generator) -> torch.Tensor:
        """The whole waveform at once, as ``Qwen2_5OmniToken2WavModel.forward`` (the noise from ``generator``)."""
        self._check_length(len(codes))
        with torch.inference_mode():
            dit = self.model.code2wav_dit_model
            noise = torch.randn([1, len(codes) * dit.repeats, dit.mel_dim], dtype=torch.float32, device=self.device,
                                generator=generator)
            mel = self._mel([codes], noise, [speaker]).permute(0, 2, 1)
            return self.model.code2wav_bigvgan_model(mel).reshape(-1).float().cpu()


class SpeakerEncoderOnce:
    """The DiT's speaker encoder (an ECAPA-TDNN over the reference mel) computed once per ODE run
    instead of at each of its 4 × (num_steps − 1) evaluations: the DiT's forward encodes the same
    reference mels every time, whatever the time step. Inside :meth:`once` (per thread) the
    encoder's first output is kept and given back for the rest; outside it the encoder runs as
    before. The output is the same tensor the encoder gives (bit for bit); on this CPU the encoder
    was more than half a small window's DiT run (docs/models.md)."""

    def __init__(self, encoder: torch.nn.Module):
        self.encode = encoder.forward
        self.kept = threading.local()
        encoder.forward = self  # an instance attribute: the module's weights and state dict unchanged

    def __call__(self, reference: torch.Tensor) -> torch.Tensor:
        kept = getattr(self.kept, "outputs", None)
        if kept is None:
            return self.encode(reference)
        if reference.shape not in kept:
            kept[reference.shape] = self.encode(reference)
        return kept[reference.shape]

    @contextlib.contextmanager
    def once(self) -> Iterator[None]:
        """Around one ODE run: its reference mels are encoded once."""
        self.kept.outputs = {}
        try:
            yield
        finally:
            self.kept.outputs = None


class CompactBlockDiff:
    """The DiT's block differences as one [1, 1, T, T] matrix the batch and heads broadcast over.
    transformers expands them to [batch, heads, T, T], so every layer of every one of the ODE's
    evaluations compares that whole tensor twice and SDPA converts the mask it makes: on this CPU
    most of a large window's DiT run. The same mask broadcast gives the same output bit for bit
    (tested); a window of 74 codes for 16 requests took 0.5 × the time (docs/models.md)."""

    def __init__(self, dit: torch.nn.Module):
        self.block_size = dit.block_size
        self.full = dit._create_block_diff
        dit._create_block_diff = self  # an instance attribute: the module's weights and state dict unchanged

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        blocks = torch.arange(hidden_states.shape[1], device=hidden_states.device) // self.block_size
        return (blocks.unsqueeze(0) - blocks.unsqueeze(1))[None, None]


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
        self.size = stage.schedule.first
        self.mel = torch.zeros(0, self.mel_dim)  # the mel of the codes done (frames x mel)
        self.finished = False

    def _scheduled(self, n: int) -> bool:
        """Whether ``n`` codes hold the next scheduled chunk, its look-ahead and the codes of 16 noise values more: the
        noise of a window then never reaches the last 16 values of the final draw, so a chunk does
        not depend on whether the talker had ended when it was made."""
        return n >= self.done + self.size + self.stage.schedule.lookahead + self.margin

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
        window_end = end + stage.schedule.lookahead if scheduled else n
        stage._check_length(window_end)
        if end <= start:
            self.finished = final
            return None
        window_start = stage.schedule.window_start(start)
        noise = self._noise(window_end * rep, n * rep if final else None)[window_start * rep:]
        return _Window(self, codes[window_start:window_end], noise, window_start, start, end, scheduled, final)

    def vocoder_input(self, window: _Window, mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What BigVGAN vocodes for the chunk from its window's mel [frames, mel dim]: the chunk's
        own mel frames with the receptive field's context on each side (the left from the chunks
        before), and the own frames with their right context."""
        rep, ctx = self.stage.repeats, self.stage.vocoder_context
        first, last = window.start * rep, window.end * rep  # this chunk's mel frames
        offset = window.window_start * rep
        left = self.mel[max(0, first - ctx):first]
        right_end = min(offset + mel.shape[0], last + ctx)
        own = mel[first - offset:right_end - offset]
        return torch.cat([left.to(own.device), own]), own

    def finish(self, window: _Window, out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The chunk's audio from its own mel and the waveform vocoded with its context
        (:meth:`Token2Wav.run_windows`), trimmed to the chunk's own samples."""
        stage = self.stage
        own, wave = out
        first, last = window.start * stage.repeats, window.end * stage.repeats
        skip = min(first, stage.vocoder_context) * stage.hop  # the left context's samples
        audio = wave[skip:skip + (last - first) * stage.hop] if window.scheduled else wave[skip:]
        self.mel = torch.cat([self.mel, own[:last - first].cpu()])
        self.done = window.end
        self.size = stage.schedule.next(self.size)
        self.finished = window.final and not window.scheduled
        return audio.contiguous()

    def next_chunk(self, codes: list[int], final: bool) -> torch.Tensor:
        """The next chunk's audio, computed alone (empty when nothing is left)."""
        return self.stage.next_chunk(self, codes, final)

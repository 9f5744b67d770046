"""Qwen3-Omni's code2wav on the kit's streaming vocoder: frames of 16 codes -> 24 kHz waveform, in chunks as
the talker's frames arrive, the chunks of concurrent requests in one forward.

code2wav averages a frame's 16 code embeddings, runs a causal transformer with a sliding window and a causal
conv decoder (1920 samples a frame). Its transposed convolutions look one frame ahead: a forward over n
frames gives n * 1920 - 555 samples, the last 555 of frame n-1 waiting for frame n. So a chunk of frames
[a, b) is computed over the window [a - lookback, b) and emits the samples [a * 1920 - 555, b * 1920 - 555):
it makes again the 555 samples the chunk before could not finish, and the joined chunks have exactly the
length of the whole decode (transformers' own ``chunked_decode`` drops those samples at every join).

``mode: exact`` (the default): the window's left context covers the transformer's reach (``num_hidden_layers``
x ``sliding_window`` frames) and the convolutions' few frames, so every chunk equals the whole decode within
``STREAM_MAX_ABS_ERROR`` (float32). ``mode: fast`` makes its first chunk after one frame, with 25 frames of
left context (transformers' ``chunked_decode``'s): faster, approximate within ``FAST_MAX_ABS_ERROR`` on the
tiny checkpoint (whose attention barely couples frames; the real model's error is larger, not measured here).
"""

from __future__ import annotations

import attrs
import torch

from ..kit.sampling import torch_dtype
from ..kit.vocoder import ChunkSchedule, StreamingVocoder
from .thinker import omni_config

#: The bound between the joined streamed chunks (exact mode) and code2wav over all the frames at once:
#: the largest absolute difference of a sample (measured ~1e-6 on the tiny checkpoint; docs/models.md).
STREAM_MAX_ABS_ERROR = 1e-4
#: fast mode's bound on the tiny checkpoint (measured ~4e-6 there).
FAST_MAX_ABS_ERROR = 1e-3
#: Frames of left context beyond the transformer's reach, for the causal convolutions (a few frames each).
CONV_CONTEXT_FRAMES = 8
#: Each mode's chunk schedule in frames (``first_chunk_frames``, ``chunk_growth``, ``max_chunk_frames``,
#: ``lookback_frames``; each overridable). exact: left context over the transformer's whole reach (None:
#: ``num_hidden_layers`` x ``sliding_window`` + ``conv_context_frames``), so every chunk equals the whole
#: decode; fast: transformers' ``chunked_decode`` left context (25), less to compute per chunk. Both make
#: their first chunk after one frame: a chunk's boundaries change nothing in exact mode (the left context is
#: what keeps it exact), and a first chunk of 1 frame instead of 4 brought first audio from 96 to 43 ms of a
#: 725 ms request on the tiny checkpoint, at the same CPU per request (docs/models.md).
SCHEDULES = {
    "exact": {"first": 1, "growth": 2.0, "largest": 64, "lookahead": 0, "lookback": None},
    "fast": {"first": 1, "growth": 2.0, "largest": 64, "lookahead": 0, "lookback": 25},
}


def load_code2wav(path, *, dtype: str | None = "float32", device: str = "cpu"):
    """code2wav of a whole ``qwen3_omni_moe`` checkpoint (only its weights are read), in eval mode."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = omni_config(path)
    if not config.enable_audio_output:
        raise ValueError(f"{path} has no code2wav (enable_audio_output: false)")
    model = transformers.Qwen3OmniMoeCode2Wav.from_pretrained(
        path, config=config.code2wav_config, key_mapping={r"^code2wav\.": ""}, local_files_only=True,
        dtype=torch_dtype(dtype, torch.float32))
    return model.to(device).eval()


class Code2Wav(StreamingVocoder):
    """Frames of 16 codes → waveform, streamed: ``{"audio", "sample_rate"}`` chunks as the talker's frames
    arrive (``stream: false``: one chunk once they are all in, equal to ``code2wav`` of all the frames).

    Chunk schedule (``mode``'s preset in :data:`SCHEDULES`, each value overridable): the first chunk holds
    ``first_chunk_frames`` frames, each next one ``chunk_growth`` times more, up to ``max_chunk_frames``;
    when the talker ends, the rest comes as one chunk. Each chunk is computed with ``lookback_frames`` frames
    of left context (``exact``: the transformer's whole reach, see the module; ``fast``: 25)."""

    codebooks = 16

    def __init__(self, model: str | None = None, device: str = "cpu", dtype: str = "float32",
                 wav_path: str | None = None, source: str = "talker", stream: bool = True,
                 mode: str = "exact", first_chunk_frames: int | None = None, chunk_growth: float | None = None,
                 max_chunk_frames: int | None = None, lookback_frames: int | None = None,
                 conv_context_frames: int = CONV_CONTEXT_FRAMES, max_batch_size: int = 16, max_wait: float = 0.002,
                 stage_name: str = "code2wav", relay_text: bool = True, first_chunk_priority: bool = True,
                 max_passed_over: int = 4):
        super().__init__(model, device=device, dtype=dtype, sample_rate=24000, wav_path=wav_path, source=source,
                         stream=stream, max_batch_size=max_batch_size, max_wait=max_wait, stage_name=stage_name,
                         relay_text=relay_text, mode=mode, first_chunk_priority=first_chunk_priority,
                         max_passed_over=max_passed_over)
        config = self.model.config
        self.hop = int(self.model.total_upsample)
        preset = dict(SCHEDULES[mode])
        if preset["lookback"] is None:
            preset["lookback"] = config.num_hidden_layers * config.sliding_window + conv_context_frames
        given = {"first": first_chunk_frames, "growth": chunk_growth, "largest": max_chunk_frames,
                 "lookback": lookback_frames}
        values = {**preset, **{k: v for k, v in given.items() if v is not None}}
        for name, value in (("lookback_frames", values["lookback"]), ("conv_context_frames", conv_context_frames)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1 (the frame before a chunk makes its first "
                                 f"samples), got {value!r}")
        self.conv_context = min(conv_context_frames, values["lookback"])
        self.schedule = ChunkSchedule(values["first"], values["growth"], values["largest"], 0, values["lookback"],
                                      names=("first_chunk_frames", "chunk_growth", "max_chunk_frames",
                                             "lookahead", "lookback_frames"))
        # What a forward over n frames holds back of its last frame: measured on one frame.
        with torch.inference_mode():
            probe = torch.zeros(1, self.codebooks, 1, dtype=torch.long, device=self.device)
            self.held_back = self.hop - int(self.model(probe).shape[-1])

    def load_model(self, path, *, dtype: str, device: str):
        return load_code2wav(path, dtype=dtype, device=device)

    def new_synthesis(self, speaker, generator: torch.Generator) -> CodeSynthesis:
        return CodeSynthesis(self)

    def decode(self, frames: list[list[int]]) -> torch.Tensor:
        """code2wav over all ``frames`` at once: the waveform (1-D float32, n * 1920 - 555 samples)."""
        if not frames:
            return torch.zeros(0)
        codes = torch.tensor(frames, dtype=torch.long, device=self.device).T[None]
        return self.model(codes).reshape(-1).float().cpu()

    def synthesize(self, frames: list, speaker, generator: torch.Generator) -> torch.Tensor:
        with torch.inference_mode():
            return self.decode(frames)

    def batch_key(self, window: _Window) -> tuple[int, int]:
        """Windows of one shape (frames, conv context) run as one batch."""
        return len(window.frames), window.conv_start - window.window_start

    def run_windows(self, windows: list[_Window]) -> list[torch.Tensor]:
        """The waveform of each window from its conv start on (``Qwen3OmniMoeCode2Wav.forward`` in two: the
        transformer over the whole window, the convolutions over its last frames only); windows of one shape
        run as one batch."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i, w in enumerate(windows):
            groups.setdefault(self.batch_key(w), []).append(i)
        outs: list = [None] * len(windows)
        model = self.model
        for (_, skip), members in groups.items():
            codes = torch.tensor([windows[i].frames for i in members], dtype=torch.long, device=self.device)
            hidden = model.code_embedding(codes.transpose(1, 2) + model.code_offset).mean(1)
            hidden = model.pre_transformer(inputs_embeds=hidden).last_hidden_state[:, skip:].permute(0, 2, 1)
            for blocks in model.upsample:
                for block in blocks:
                    hidden = block(hidden)
            for block in model.decoder:
                hidden = block(hidden)
            wav = hidden.clamp(min=-1, max=1).float().cpu()
            for row, i in enumerate(members):
                outs[i] = wav[row].reshape(-1)
        return outs


@attrs.define
class _Window:
    """One chunk to make: the frames of its window, where the window starts, the chunk's frames [start, end)."""

    synthesis: CodeSynthesis
    frames: list
    window_start: int
    conv_start: int
    start: int
    end: int
    last: bool


class CodeSynthesis:
    """One request's streamed code2wav: ``ready(n, final)``, ``plan(frames, final)``, ``finish(window, wav)``."""

    def __init__(self, stage: Code2Wav):
        self.stage = stage
        self.done = 0  # frames whose samples were emitted (all but the last 555 of the last one)
        self.size = stage.schedule.first
        self.finished = False

    def ready(self, n: int, final: bool) -> bool:
        return not self.finished and (final or n >= self.done + self.size)

    def plan(self, frames: list, final: bool) -> _Window | None:
        n, start = len(frames), self.done
        end = start + self.size if n >= start + self.size else n
        if end <= start:
            self.finished = final
            return None
        window_start = max(0, start - self.stage.schedule.lookback)
        conv_start = max(window_start, start - self.stage.conv_context)
        return _Window(self, frames[window_start:end], window_start, conv_start, start, end, final and end == n)

    def finish(self, window: _Window, wav: torch.Tensor) -> torch.Tensor:
        hop, back = self.stage.hop, self.stage.held_back
        first = max(0, window.start * hop - back) - window.conv_start * hop
        audio = wav[first:]
        self.done = window.end
        self.size = self.stage.schedule.next(self.size)
        self.finished = window.last
        return audio.contiguous()

    def next_chunk(self, frames: list, final: bool) -> torch.Tensor:
        """The next chunk's audio, computed alone (empty when nothing is left)."""
        return self.stage.next_chunk(self, frames, final)

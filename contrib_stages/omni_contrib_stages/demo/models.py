"""The demo's models: small torch modules shaped like the parts of an omni model.

They are untrained; their weights come from fixed seeds, so every run gives the same output. The
thinker writes words from a small vocabulary following a fixed sentence pattern, so its text is
readable; the talker turns each word into codec frames; the vocoder turns frames into a waveform.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

#: The thinker's vocabulary, by part of speech (every word starts with a consonant, so "a" fits).
WORDS: dict[str, tuple[str, ...]] = {
    "det": ("the", "a", "this", "one"),
    "adj": ("quiet", "bright", "small", "gentle", "silver", "distant", "warm", "hidden", "green", "slow"),
    "noun": ("river", "signal", "voice", "lantern", "garden", "mountain", "city", "song", "window",
             "machine", "forest", "bridge"),
    "verb": ("sings", "waits", "moves", "listens", "glows", "turns", "drifts", "speaks", "returns", "wanders"),
    "prep": ("over", "under", "near", "beyond", "through", "beside", "toward", "behind"),
    "conj": ("and", "while", "because", "so"),
    "adv": ("softly", "slowly", "again", "together", "today", "gently", "tonight", "still"),
}

#: Every word, in one list: a token id is an index into it.
VOCAB: tuple[str, ...] = tuple(word for words in WORDS.values() for word in words)

#: The part of speech of each position (repeating): 13 tokens make one sentence.
PATTERN: tuple[str, ...] = ("det", "adj", "noun", "verb", "prep", "det", "adj", "noun", "conj", "det", "noun", "verb", "adv")

_CATEGORY_IDS: dict[str, list[int]] = {}
for _index, _word in enumerate(VOCAB):
    for _category, _words in WORDS.items():
        if _word in _words:
            _CATEGORY_IDS.setdefault(_category, []).append(_index)


def allowed_ids(position: int) -> list[int]:
    """Token ids the thinker may write at ``position``."""
    return _CATEGORY_IDS[PATTERN[position % len(PATTERN)]]


# -- encoders (run by the generic contrib.torch_module stage, batched) ---------------------------------


class AudioEncoder(nn.Module):
    """``[batch, frames, n_features]`` spectral features → ``[batch, ceil(frames / pool), dim]``."""

    def __init__(self, n_features: int = 64, dim: int = 32, pool: int = 4):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(n_features, dim), nn.GELU(), nn.Linear(dim, dim))
        self.pool = pool

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.proj(features)
        return F.avg_pool1d(x.transpose(1, 2), self.pool, ceil_mode=True).transpose(1, 2)


class ImageEncoder(nn.Module):
    """``[batch, channels, height, width]`` pixels → ``[batch, patches, dim]`` (non-overlapping
    ``patch`` × ``patch`` squares)."""

    def __init__(self, channels: int = 3, patch: int = 8, dim: int = 32):
        super().__init__()
        self.patches = nn.Conv2d(channels, dim, patch, stride=patch)
        self.norm = nn.LayerNorm(dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.norm(self.patches(pixels).flatten(2).transpose(1, 2))


# -- thinker ----------------------------------------------------------------------------------------


class ThinkerLM(nn.Module):
    """A recurrent language model over :data:`VOCAB`, conditioned on the multimodal prefix (the
    encoders' embeddings) and on the prompt's UTF-8 bytes (read by a small GRU)."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.bytes = nn.Embedding(256, dim)
        self.reader = nn.GRU(dim, dim, batch_first=True)
        self.words = nn.Embedding(len(VOCAB), dim)
        self.context = nn.Linear(2 * dim, dim)
        self.cell = nn.GRUCell(dim, dim)
        self.head = nn.Linear(dim, len(VOCAB))
        self.bias = nn.Linear(dim, len(VOCAB))
        with torch.no_grad():  # untrained: larger weights let the inputs steer the greedy choice
            for layer, gain in ((self.context, 2.0), (self.bias, 3.0)):
                layer.weight.mul_(gain)
                layer.bias.mul_(gain)

    def condition(self, embeds: torch.Tensor, text_ids: torch.Tensor) -> torch.Tensor:
        """The conditioning vector ``[dim]`` from the prefix ``[n, dim]`` and the prompt bytes
        ``[t]``, each normalised so that neither drowns the other."""
        dim = embeds.shape[-1]
        prefix = F.layer_norm(embeds.mean(0), (dim,))
        _, last = self.reader(self.bytes(text_ids).unsqueeze(0))
        prompt = F.layer_norm(last.reshape(dim), (dim,))
        return torch.tanh(self.context(torch.cat([prefix, prompt])))

    def generate(self, embeds: torch.Tensor, text_ids: torch.Tensor, count: int, *, no_repeat: int = 8):
        """Yield ``count`` token ids: greedy, restricted to the pattern's part of speech, never
        repeating a word of the last ``no_repeat`` tokens. The conditioning vector feeds every
        step, as a cross-attention context would."""
        cond = self.condition(embeds, text_ids)
        state = cond
        recent: list[int] = []
        for position in range(count):
            logits = self.head(state) + self.bias(cond)
            candidates = [i for i in allowed_ids(position) if i not in recent[-no_repeat:]] or allowed_ids(position)
            token = candidates[int(torch.argmax(logits[candidates]))]
            recent.append(token)
            yield token
            state = self.cell((self.words.weight[token] + cond).unsqueeze(0), state.unsqueeze(0)).squeeze(0)


# -- talker and vocoder -------------------------------------------------------------------------------


class TalkerLM(nn.Module):
    """Turns each thinker token into ``frames_per_token`` codec frames of ``codebooks`` codes."""

    def __init__(self, dim: int = 32, codebooks: int = 4, codebook_size: int = 64, frames_per_token: int = 4):
        super().__init__()
        self.codebooks = codebooks
        self.codebook_size = codebook_size
        self.frames_per_token = frames_per_token
        self.words = nn.Embedding(len(VOCAB), dim)
        self.codes = nn.Embedding(codebooks * codebook_size, dim)
        self.cell = nn.GRUCell(dim, dim)
        self.head = nn.Linear(dim, codebooks * codebook_size)
        self.register_buffer("offsets", torch.arange(codebooks) * codebook_size, persistent=False)
        self.dim = dim

    def initial_state(self) -> torch.Tensor:
        return torch.zeros(self.dim)

    def speak(self, token_id: int, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes [frames_per_token, codebooks] int64, new state)`` for one token."""
        word = self.words.weight[token_id]
        x = word
        frames = []
        for _ in range(self.frames_per_token):
            state = self.cell(x.unsqueeze(0), state.unsqueeze(0)).squeeze(0)
            codes = self.head(state).view(self.codebooks, self.codebook_size).argmax(-1)
            frames.append(codes)
            x = word + self.codes(codes + self.offsets).mean(0)
        return torch.stack(frames), state


class VocoderNet(nn.Module):
    """Codec frames ``[n, codebooks]`` → synthesis parameters ``[n, 2 + harmonics]``: pitch,
    loudness and the weights of the harmonics."""

    def __init__(self, dim: int = 32, codebooks: int = 4, codebook_size: int = 64, harmonics: int = 4):
        super().__init__()
        self.codes = nn.Embedding(codebooks * codebook_size, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, 2 + harmonics))
        self.register_buffer("offsets", torch.arange(codebooks) * codebook_size, persistent=False)
        self.harmonics = harmonics

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.codes(codes + self.offsets).sum(1))


class Synth:
    """Additive synthesis with continuous phase, one instance per request (its state carries from
    chunk to chunk, so chunk boundaries make no clicks). Each call of :meth:`frames` gets one
    token's frames and shapes them like a syllable: louder in the middle, softer at the edges."""

    EDGE = 0.2  # loudness at the edges of a syllable, relative to its middle

    def __init__(self, sample_rate: int, hop: int):
        self.sample_rate = sample_rate
        self.hop = hop
        self.phase = 0.0
        self.f0: float | None = None
        self.amp = 0.0
        self.weights: torch.Tensor | None = None
        self.samples = 0

    def _wave(self, freq: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        phase = self.phase + 2 * math.pi * torch.cumsum(freq, 0) / self.sample_rate
        self.phase = float(phase[-1] % (2 * math.pi))
        harmonics = torch.arange(1, len(weights) + 1, dtype=torch.float64)
        return (weights.unsqueeze(1) * torch.sin(harmonics.unsqueeze(1) * phase.unsqueeze(0))).sum(0)

    def frames(self, params: torch.Tensor) -> torch.Tensor:
        """Audio ``[len(params) * hop]`` in [-1, 1] for one token's frames' parameters."""
        out = []
        ramp = torch.arange(1, self.hop + 1, dtype=torch.float64) / self.hop
        for row in params.to(torch.float64):
            f0 = 110.0 * 2.0 ** (2.0 * torch.sigmoid(row[0]).item())  # 110 Hz .. 440 Hz
            amp = 0.15 + 0.35 * torch.sigmoid(row[1]).item()
            weights = torch.softmax(row[2:], 0)
            start_f0 = f0 if self.f0 is None else self.f0
            freq = start_f0 + (f0 - start_f0) * ramp
            loud = self.amp + (amp - self.amp) * ramp
            out.append(loud * self._wave(freq, weights))
            self.f0, self.amp, self.weights = f0, amp, weights
        if not out:
            return torch.zeros(0, dtype=torch.float64)
        audio = torch.cat(out)
        position = (torch.arange(audio.numel(), dtype=torch.float64) + 0.5) / audio.numel()
        audio = audio * (self.EDGE + (1 - self.EDGE) * torch.sin(math.pi * position).sqrt())
        self.samples += audio.numel()
        return audio

    def tail(self) -> torch.Tensor:
        """One hop fading the last sound out (so the file does not end with a click)."""
        if self.f0 is None:
            return torch.zeros(0, dtype=torch.float64)
        fade = self.EDGE * (1.0 - torch.arange(1, self.hop + 1, dtype=torch.float64) / self.hop)
        audio = self.amp * fade * self._wave(torch.full((self.hop,), self.f0, dtype=torch.float64), self.weights)
        self.samples += audio.numel()
        return audio


def to_pcm16(audio: torch.Tensor) -> bytes:
    """Float audio in [-1, 1] → little-endian signed 16-bit PCM bytes."""
    pcm = (audio.clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
    return pcm.numpy().astype("<i2").tobytes()

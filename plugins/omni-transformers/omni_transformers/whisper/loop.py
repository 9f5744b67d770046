"""Whisper's decoder on the decode loop: every live transcription advances by one token in one forward, each row
with its own self-attention KV (the kit's row buffers) and its own cross-attention KV over its clip's encoder
states; a request joins between two steps and leaves when its text ends.

The step drives the decoder's layers itself (token and position embeddings, the layers, the output head) with a
cache per step that transformers' ``WhisperAttention`` reads as an ``EncoderDecoderCache``: the self-attention side
is the kit's ``RowsCache`` (each row's keys at its own length, attention row by row), the cross-attention side the
rows' encoder keys and values stacked (every clip is 1,500 encoder positions). The prompt (``<|startofprev|>``
prompt, ``<|startoftranscript|>``, language, task, ``<|notimestamps|>``) runs through the decoder as transformers
runs it, after the language is detected as ``generate`` detects it when the request names none.
"""

from __future__ import annotations

from typing import Any

import torch
from omni_core.kits import NO_OUTPUT
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from ..kit.batched import RowKV, RowsCache, crop_to, run_rows
from ..kit.sampling import Sampler


class _Stacked:
    """The cross-attention side of a step's cache: per layer, the rows' encoder keys and values stacked."""

    class _Layer:
        __slots__ = ("keys", "values")

        def __init__(self, keys: torch.Tensor, values: torch.Tensor):
            self.keys, self.values = keys, values

    def __init__(self, rows: list[DecodeRow], layers: int):
        self.layers = [self._Layer(torch.cat([r.cross_keys[i] for r in rows]), torch.cat([r.cross_values[i] for r in rows]))
                       for i in range(layers)]

    def __bool__(self) -> bool:
        return True


class StepCache(EncoderDecoderCache):
    """What ``WhisperAttention`` reads in a batched decode step (self: ``RowsCache``; cross: :class:`_Stacked`)."""

    def __init__(self, rows: RowsCache, cross: _Stacked, layers: int):  # noqa: D107 - no parent state is used
        self.self_attention_cache = rows
        self.cross_attention_cache = cross
        self.is_updated = dict.fromkeys(range(layers), True)


class DecodeRow:
    """One transcription in the loop: its encoder states, prompt, caches, sampler and tokens."""

    __slots__ = ("encoder", "prompt", "detect", "cache", "kv", "cross_keys", "cross_values", "sampler", "tokens",
                 "max_new", "ids", "stamps")

    def __init__(self, encoder: torch.Tensor, prompt: list[int], detect: bool, sampler: Sampler, max_new: int,
                 stamps: Any = None):
        self.encoder = encoder  # [1, 1500, d]
        self.prompt = prompt  # the decoder prompt (the language slot filled in prefill when ``detect``)
        self.detect = detect
        self.cache: EncoderDecoderCache | None = None
        self.kv: RowKV | None = None
        self.cross_keys: list[torch.Tensor] = []
        self.cross_values: list[torch.Tensor] = []
        self.sampler = sampler
        self.tokens: list[int] = []
        self.max_new = max_new
        self.ids: list[int] = []
        self.stamps = stamps  # with timestamps: transformers' WhisperTimeStampLogitsProcessor for this row

    @property
    def reserved(self) -> int:
        return len(self.prompt) + self.max_new


class WhisperDecoding:
    """The model part of the decode loop's step for Whisper (a worker thread): ``step(rows)``."""

    def __init__(self, model, generation_config, language_slot: int | None):
        self.model = model
        self.decoder = model.model.decoder
        self.layers = len(self.decoder.layers)
        self.config = generation_config
        self.eos = generation_config.eos_token_id
        self.lang_ids = list((getattr(generation_config, "lang_to_id", None) or {}).values())
        self.language_slot = language_slot
        self.suppress = list(generation_config.suppress_tokens or [])
        self.begin_suppress = list(generation_config.begin_suppress_tokens or [])
        self.decoder_config = self._decoder_cache_config()
        # the last step's rows (held, so their identity is theirs) and their stacked cross KV
        self._stacked: tuple[list[DecodeRow], _Stacked] | None = None

    def _decoder_cache_config(self):
        import copy

        config = copy.deepcopy(self.model.config)
        config.num_hidden_layers = config.decoder_layers
        return config

    def step(self, rows) -> list[Any]:
        with torch.inference_mode():
            results, outs = run_rows(rows, self.decode, self.prefill)
            for i, logits in outs:
                state = rows[i].state
                try:
                    token = self.choose(state, logits)
                except Exception as exc:
                    results[i] = exc
                    continue
                state.tokens.append(token)
                state.ids.append(token)
                done = token == self.eos or len(state.tokens) >= state.max_new
                if done:
                    rows[i].finish()
                    self._stacked = None  # the rows change: nothing of a finished row is held
                results[i] = token
        return results

    def choose(self, state: DecodeRow, logits: torch.Tensor) -> int:
        """The row's next token from its logits [1, V] as ``generate`` chooses it: the suppressed tokens (and, at
        the first generated position, the begin-suppressed ones) never, the timestamp rules when it asked for
        timestamps, then the row's sampler."""
        scores = logits.float().clone()
        if self.suppress:
            scores[:, self.suppress] = -torch.inf
        if not state.tokens and self.begin_suppress:
            scores[:, self.begin_suppress] = -torch.inf
        ids = torch.tensor([state.ids])
        if state.stamps is not None:  # after the suppressions, as in generate's list of processors
            scores = state.stamps(ids, scores)
        return state.sampler(ids, scores)

    def decode(self, rows) -> list[torch.Tensor]:
        """One forward for every decoding row: its last token at its own position."""
        states = [row.state for row in rows]
        device = states[0].encoder.device
        ids = torch.tensor([s.tokens[-1] for s in states], device=device)
        positions = torch.tensor([s.kv.length for s in states], device=device)
        hidden = (self.decoder.embed_tokens(ids) + self.decoder.embed_positions.weight[positions])[:, None, :]
        rows_cache = RowsCache([s.kv for s in states])
        last = self._stacked[0] if self._stacked is not None else []
        if len(last) != len(states) or any(a is not b for a, b in zip(last, states, strict=True)):
            self._stacked = (states, _Stacked(states, self.layers))  # stacked again only when the rows change
        cache = StepCache(rows_cache, self._stacked[1], self.layers)
        dummy = states[0].encoder  # the layers run cross-attention when given encoder states; the cache holds them
        for layer in self.decoder.layers:
            hidden = layer(hidden, attention_mask=None, encoder_hidden_states=dummy, cache=cache, use_cache=True)
        logits = self.model.proj_out(self.decoder.layer_norm(hidden))[:, -1, :]
        rows_cache.advance()
        return [logits[j:j + 1] for j in range(len(rows))]

    def prefill(self, state: DecodeRow, start: int, end: int):
        """Prompt tokens [start, end) of one row (the language detected first, when asked); after the last, the
        first logits."""
        if start == 0 or state.cache is None:
            if state.detect and self.language_slot is not None:
                state.prompt[self.language_slot] = self.detect_language(state)
                state.detect = False
            state.cache = EncoderDecoderCache(DynamicCache(config=self.decoder_config),
                                              DynamicCache(config=self.decoder_config))
        crop_to(state.cache.self_attention_cache, start)  # a chunk run again starts from the same cache
        ids = torch.tensor([state.prompt[start:end]], device=state.encoder.device)
        position_ids = torch.arange(start, end, device=ids.device)[None]
        out = self.decoder(input_ids=ids, encoder_hidden_states=state.encoder, cache=state.cache,
                           position_ids=position_ids, use_cache=True)
        if end < len(state.prompt):
            return NO_OUTPUT
        cross = state.cache.cross_attention_cache
        state.cross_keys = [layer.keys for layer in cross.layers]
        state.cross_values = [layer.values for layer in cross.layers]
        state.kv = RowKV(state.cache.self_attention_cache, state.reserved)
        state.cache = None
        state.ids = list(state.prompt)
        return self.model.proj_out(out.last_hidden_state[:, -1:, :])[:, -1, :]

    def detect_language(self, state: DecodeRow) -> int:
        """``generate``'s language detection: the decoder's first logits after ``<|startoftranscript|>``, the
        best language token."""
        ids = torch.tensor([[self.config.decoder_start_token_id]], device=state.encoder.device)
        out = self.decoder(input_ids=ids, encoder_hidden_states=state.encoder, use_cache=False)
        logits = self.model.proj_out(out.last_hidden_state)[:, -1]
        mask = torch.ones_like(logits[0], dtype=torch.bool)
        mask[self.lang_ids] = False
        logits[:, mask] = -torch.inf
        return int(logits.argmax(-1)[0])

"""Chunk schedules (kit/vocoder.py ChunkSchedule) and token2wav's two modes on the tiny checkpoint:
the ramp, alignment and look-ahead of each mode, and each mode's streamed waveform against the
unchunked synthesis of the same codes (exact: STREAM_MAX_RELATIVE_ERROR; fast: its stated
FAST_* bound), whatever the codes' arrival."""

from __future__ import annotations

import contextlib

import pytest
import torch

from omni_transformers.kit.checks import check_vocoder
from omni_transformers.kit.sampling import make_generator
from omni_transformers.kit.vocoder import ChunkSchedule, stream_difference
from omni_transformers.qwen2_5_omni.parts import speaker_params
from omni_transformers.qwen2_5_omni.token2wav import (
    FAST_MAX_RELATIVE_ERROR,
    FAST_MIN_CORRELATION,
    SCHEDULES,
    STREAM_MAX_RELATIVE_ERROR,
    STREAM_MIN_CORRELATION,
    ChunkedSynthesis,
    Token2Wav,
)

pytestmark = pytest.mark.timeout(300)


def test_a_schedule_ramps_from_its_first_chunk_up_to_its_largest():
    ramp = ChunkSchedule(1, 2, 16, lookahead=2, lookback=8)
    assert ramp.sizes() == [1, 2, 4, 8, 16, 16, 16, 16]
    assert ramp.sizes(40) == [1, 2, 4, 8, 16, 9] and ramp.first_ready(margin=1) == 4
    aligned = ChunkSchedule(1, 2, 256, lookahead=8, lookback=8, align=4)
    assert aligned.sizes()[:4] == [4, 8, 16, 32] and aligned.first_ready(1) == 13
    assert [aligned.window_start(s) for s in (0, 4, 12, 28)] == [0, 0, 4, 20]
    cut_anywhere = ChunkSchedule(1, 2, 256, lookahead=2, lookback=8, window_align=4)
    assert [cut_anywhere.window_start(s) for s in (0, 1, 3, 7, 15, 31)] == [0, 0, 0, 0, 4, 20]


def test_modes_take_their_presets_with_the_given_values_over_them():
    presets = {"exact": {"first": 4, "growth": 2.0, "largest": 64, "lookahead": 8, "lookback": 8},
               "fast": {"first": 1, "growth": 2.0, "largest": 64, "lookahead": 2, "lookback": 8}}
    exact = ChunkSchedule.for_mode("exact", 4, presets)
    assert (exact.first, exact.lookahead, exact.align, exact.window_align) == (4, 8, 4, 4)
    fast = ChunkSchedule.for_mode("fast", 4, presets)
    assert (fast.first, fast.lookahead, fast.align, fast.window_align) == (1, 2, 1, 4)
    assert fast.sizes()[:5] == [1, 2, 4, 8, 16]
    given = ChunkSchedule.for_mode("fast", 4, presets, first=3, lookahead=None, growth=3)
    assert given.sizes()[:3] == [3, 9, 27] and given.lookahead == 2
    assert ChunkSchedule.for_mode("exact", 4, presets, first=1).first == 4  # rounded up to a block
    with pytest.raises(ValueError, match="mode must be one of exact, fast, got 'quick'"):
        ChunkSchedule.for_mode("quick", 4, presets)
    with pytest.raises(ValueError, match="first_chunk_codes must be a positive int, got 0"):
        ChunkSchedule.for_mode("fast", 4, presets, first=0)
    with pytest.raises(ValueError, match="lookahead_codes must be an int >= 0"):
        ChunkSchedule.for_mode("fast", 4, presets, lookahead=-1)


def test_stream_difference_says_max_abs_and_snr():
    a = torch.linspace(-1, 1, 100)
    same = stream_difference(a.clone(), a)
    assert same["max_abs"] == 0 and same["snr_db"] == float("inf") and same["relative_error"] == 0
    b = a.clone()
    b[10] += 0.01
    d = stream_difference(b, a)
    assert d["max_abs"] == pytest.approx(0.01, rel=1e-4)
    assert d["snr_db"] == pytest.approx(10 * torch.log10(a.double().square().sum() / 1e-4).item(), rel=1e-3)


@pytest.fixture(scope="module")
def stages(tiny_model):
    exact = Token2Wav(str(tiny_model))
    fast = Token2Wav(str(tiny_model), mode="fast", vocoder_context=exact.vocoder_context)
    return {"exact": exact, "fast": fast}


def stream_in(stage, codes, arrivals, seed=3):
    syn = ChunkedSynthesis(stage, speaker_params(stage.speakers, "Chelsie"), make_generator(seed))
    parts, first_at = [], None
    for k in arrivals:
        while syn.ready(k, k == len(codes)):
            first_at = k if first_at is None else first_at
            parts.append(syn.next_chunk(codes[:k], k == len(codes)))
    return parts, first_at


def test_exact_mode_is_the_default_and_keeps_its_schedule(stages):
    exact = stages["exact"]
    assert exact.mode == "exact" and exact.chunk_schedule()[:4] == [4, 8, 16, 32]
    assert exact.schedule.lookahead == 8 and exact.schedule.align == 4


@pytest.mark.parametrize("n", [1, 5, 7, 64, 150])
def test_each_modes_chunks_are_within_its_bound_of_the_unchunked_synthesis(stages, n):
    codes = torch.randint(0, 8000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    exact, fast = stages["exact"], stages["fast"]
    unchunked = exact.synthesize(codes, speaker_params(exact.speakers, "Chelsie"), make_generator(3))
    for mode, max_rel, min_corr in (("exact", STREAM_MAX_RELATIVE_ERROR, STREAM_MIN_CORRELATION),
                                    ("fast", FAST_MAX_RELATIVE_ERROR, FAST_MIN_CORRELATION)):
        one_by_one, first_at = stream_in(stages[mode], codes, range(1, n + 1))
        at_once, _ = stream_in(stages[mode], codes, [n])
        streamed = torch.cat(one_by_one)
        d = stream_difference(streamed, unchunked)
        assert d["relative_error"] <= max_rel and d["correlation"] >= min_corr, (mode, d)
        assert torch.equal(torch.cat(at_once), streamed)  # the codes' arrival changes nothing
        if mode == "fast" and n >= 64:
            # a ramp from one code, the first chunk once 1 + look-ahead 2 + 1 (the noise's margin) are in
            sizes = [len(c) // fast.hop // fast.repeats for c in one_by_one]
            assert sizes[:3] == [1, 4, 16] and sum(sizes) == n and first_at == 4
            assert fast.schedule.first_ready(1) == 4 < exact.schedule.first_ready(1) == 13


def test_the_fast_preset_is_what_the_docs_measured():
    assert SCHEDULES["fast"] == {"first": 1, "growth": 4.0, "largest": 256, "lookahead": 2, "lookback": 8}
    assert SCHEDULES["exact"] == {"first": 4, "growth": 2.0, "largest": 256, "lookahead": 8, "lookback": 8}


def test_a_bad_mode_is_named_before_anything_loads(tiny_model):
    assert list(check_vocoder({"model": str(tiny_model), "mode": "fast"}, env={})) == []
    (issue,) = check_vocoder({"model": str(tiny_model), "mode": "quick"}, env={})
    assert issue.path == "mode" and issue.message == "mode must be one of exact, fast, got 'quick'"
    with pytest.raises(ValueError, match="mode must be one of exact, fast, got 'quick'"):
        Token2Wav(str(tiny_model), mode="quick")


def test_the_speaker_encoder_runs_once_per_ode_run_and_changes_no_bit(stages, monkeypatch):
    stage = stages["exact"]
    codes = torch.randint(0, 8000, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    speaker = speaker_params(stage.speakers, "Chelsie")
    encoder, calls = stage.speaker_encoder, []

    def counted(reference):
        calls.append(reference.shape)
        return encode(reference)

    encode = encoder.encode
    monkeypatch.setattr(encoder, "encode", counted)
    once = stage.synthesize(codes, speaker, make_generator(3))
    assert len(calls) == 1  # of 4 x (num_steps - 1) = 36 evaluations
    monkeypatch.setattr(encoder, "once", contextlib.nullcontext)  # every evaluation encodes, as transformers does
    every = stage.synthesize(codes, speaker, make_generator(3))
    assert len(calls) == 1 + 4 * (stage.options["num_steps"] - 1)
    assert torch.equal(once, every)


def test_the_compact_block_mask_changes_no_bit(stages, monkeypatch):
    stage = stages["exact"]
    dit = stage.model.code2wav_dit_model
    codes = torch.randint(0, 8000, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    speaker = speaker_params(stage.speakers, "Ethan")
    compact = stage.synthesize(codes, speaker, make_generator(4))  # guided and unguided rows: a batch of 2
    assert dit._create_block_diff is stage.block_mask
    monkeypatch.setattr(dit, "_create_block_diff", stage.block_mask.full)  # [batch, heads, T, T], as transformers
    assert torch.equal(stage.synthesize(codes, speaker, make_generator(4)), compact)

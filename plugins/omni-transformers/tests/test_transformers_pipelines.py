"""The shipped pipelines against transformers' own ``generate(..., return_audio=True)``: token ids
and codec codes exactly, the waveform within float tolerance (the same noise: the request's seed
as ``torch.manual_seed``), for several inputs, both pipelines, greedy and sampled talker; then
20 concurrent requests against their sequential results, and the stream's shape."""

from __future__ import annotations

import asyncio

import pytest
import torch
from omni_core import Pipeline, load_config
from omni_core.plugins import load_plugins
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture

from omni_transformers.kit.streams import USAGE_KEYS
from omni_transformers.qwen2_5_omni.token2wav import (
    BATCHED_MAX_RELATIVE_ERROR,
    FAST_MAX_RELATIVE_ERROR,
    FAST_MIN_CORRELATION,
    STREAM_MAX_RELATIVE_ERROR,
    STREAM_MIN_CORRELATION,
    stream_error,
)

#: token2wav's stated bound against the unchunked synthesis, per mode (the shipped pipelines: fast)
BOUNDS = {"exact": (STREAM_MAX_RELATIVE_ERROR, STREAM_MIN_CORRELATION),
          "fast": (FAST_MAX_RELATIVE_ERROR, FAST_MIN_CORRELATION)}

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("no_leaks")]

PROMPT_A = [257, 117, 115, 101, 114, 10, 104, 101, 108, 108, 111, 258, 10, 257, 97, 10]
PROMPT_B = [257] + list(range(99, 112)) + [258, 10, 257, 97, 10]

# (pipeline inputs, generate keyword arguments). generate's talker samples by default, as the
# pipelines' talker does; the thinker is greedy in both (the checkpoint's generation config).
CASES = [
    ({"input_ids": PROMPT_A, "max_new_tokens": 8, "seed": 0, "talker_max_new_tokens": 40}, {}),
    ({"input_ids": PROMPT_B, "max_new_tokens": 12, "seed": 5, "talker_max_new_tokens": 48, "speaker": "Ethan"}, {}),
    ({"text": "hello", "max_new_tokens": 5, "seed": 3, "talker_max_new_tokens": 32}, {}),
    ({"input_ids": PROMPT_B[:9], "max_new_tokens": 2, "seed": 9, "talker_max_new_tokens": 24}, {}),
]
GREEDY_CASES = [
    ({"input_ids": PROMPT_A, "max_new_tokens": 10, "seed": 1, "talker_max_new_tokens": 64, "talker_do_sample": False},
     {"talker_do_sample": False}),
    ({"text": "omni", "max_new_tokens": 6, "seed": 2, "talker_max_new_tokens": 48, "talker_do_sample": False}, {"talker_do_sample": False}),
]


def arun(coro, timeout: float = 500):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def chat_ids(model_dir, text: str) -> list[int]:
    """What the processor does with text: the chat template with Qwen2.5-Omni's system prompt."""
    from transformers import AutoTokenizer

    from omni_transformers.stages import DEFAULT_SYSTEM_PROMPT

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template([{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                                   {"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def expected(reference, model_dir, inputs: dict, generate_kwargs: dict) -> dict:
    ids = inputs["input_ids"] if "input_ids" in inputs else chat_ids(model_dir, inputs["text"])
    return reference(ids, inputs["max_new_tokens"], seed=inputs.get("seed", 0),
                     speaker=inputs.get("speaker", "Chelsie"),
                     talker_max_new_tokens=inputs.get("talker_max_new_tokens", 4096), **generate_kwargs)


def assert_equal_to_generate(result: dict, want: dict, mode: str = "fast") -> None:
    """Token ids and codes equal to generate's; the streamed waveform within token2wav's stated
    bound for ``mode`` of the unchunked synthesis of those codes (generate's own audio when the
    talker is greedy)."""
    assert set(result) >= {"text", "token_ids", "codes", "audio", "sample_rate"}
    assert result["token_ids"] == want["token_ids"]
    assert result["codes"] == want["codes"]
    assert result["audio"].dtype == torch.float32 and result["audio"].dim() == 1
    rel, corr = stream_error(result["audio"], want["unchunked"])
    max_rel, min_corr = BOUNDS[mode]
    assert rel <= max_rel and corr >= min_corr, (mode, rel, corr)
    assert result["sample_rate"] == 24000


def config(name: str, token2wav_mode: str | None = None, **talker_args):
    cfg = load_config(name, registry=load_plugins().registry)
    changes = {"talker": talker_args, "token2wav": {"mode": token2wav_mode} if token2wav_mode else {}}
    if any(changes.values()):
        import attrs

        stages = [attrs.evolve(s, args={**s.args, **changes[s.name]}) if changes.get(s.name) else s
                  for s in cfg.stages]
        cfg = attrs.evolve(cfg, stages=stages)
    return cfg


async def collect(p: Pipeline, inputs: dict) -> tuple[list, dict]:
    chunks, result = [], None
    async for event in p.stream(inputs):
        if event.is_result:
            result = event.data
        else:
            # the text from the thinker (stream_to caller), the audio from token2wav
            assert event.stage == ("thinker" if "text" in event.data else "token2wav"), (event.stage, event.data)
            chunks.append(event.data)
    return chunks, result


def check_cases(results, tiny_model, reference, cases, mode: str = "fast") -> None:
    for (inputs, kwargs), (chunks, result) in zip(cases, results, strict=True):
        assert_equal_to_generate(result, expected(reference, tiny_model, inputs, kwargs), mode)
        # the stream: text deltas (one per thinker token, then what detokenisation held back) and,
        # as codes arrive, audio chunks that make up the result's waveform in order
        texts = [c for c in chunks if "text" in c]
        audio = [c for c in chunks if "audio" in c]
        assert len(texts) + len(audio) == len(chunks)
        assert all(set(c) - set(USAGE_KEYS) == {"text", "token_ids"} for c in texts)
        assert {k: texts[-1][k] for k in USAGE_KEYS} == {k: result[k] for k in USAGE_KEYS}  # the usage on the last
        assert [i for c in texts for i in c["token_ids"]] == result["token_ids"]
        assert "".join(c["text"] for c in texts) == result["text"]
        assert audio and all(c["sample_rate"] == 24000 for c in audio)
        assert torch.equal(torch.cat([c["audio"] for c in audio]), result["audio"])


# One pipeline start per test: stage processes that load transformers models are what costs.

def test_split_pipeline_equals_generate_sampled_and_greedy(tiny_model, reference):
    """In token2wav's exact mode: the waveform within the exact bound of generate's synthesis."""
    cases = CASES + GREEDY_CASES

    async def go():
        async with Pipeline(config("qwen2_5_omni.split", token2wav_mode="exact")) as p:
            return [await collect(p, dict(inputs)) for inputs, _ in cases]

    check_cases(arun(go()), tiny_model, reference, cases, "exact")


def test_pipeline_equals_generate_serves_twenty_at_once_and_survives_bad_inputs(tiny_model, reference):
    """qwen2_5_omni (thinker | talker + token2wav): the cases, then 20 concurrent requests each
    equal to its sequential result, then bad inputs that fail only their own request."""
    from omni_core.errors import StageError

    cases = CASES + GREEDY_CASES[:1]
    requests = [{"input_ids": (PROMPT_A if n % 2 else PROMPT_B)[: 10 + n % 7], "max_new_tokens": 3 + n % 6,
                 "seed": n, "talker_max_new_tokens": 16 + n % 5, "speaker": ("Chelsie", "Ethan")[n % 2],
                 "talker_do_sample": n % 3 != 0}
                for n in range(20)]
    bad_inputs = ({"nothing": 1}, {"input_ids": [1, 2], "speaker": "Nobody"}, {"text": "x", "seed": "s"})

    async def go():
        async with Pipeline(config("qwen2_5_omni")) as p:
            streamed = [await collect(p, dict(inputs)) for inputs, _ in cases]
            sequential = [await p.submit(dict(r)) for r in requests]
            concurrent = await asyncio.gather(*(p.submit(dict(r)) for r in requests))
            errors = []
            for bad in bad_inputs:
                with pytest.raises(StageError) as info:
                    await p.submit(bad)
                errors.append(info.value)
            after = await p.submit(dict(requests[4]))
            return streamed, sequential, concurrent, errors, after

    streamed, sequential, concurrent, errors, after = arun(go())
    check_cases(streamed, tiny_model, reference, cases)
    for n, (one, many) in enumerate(zip(sequential, concurrent, strict=True)):
        assert many["token_ids"] == one["token_ids"], n
        assert many["codes"] == one["codes"], n
        assert stream_error(many["audio"], one["audio"])[0] <= BATCHED_MAX_RELATIVE_ERROR, n  # token2wav batches
    for n in (0, 7, 19):
        kwargs = {} if requests[n]["talker_do_sample"] else {"talker_do_sample": False}
        assert_equal_to_generate(sequential[n], expected(reference, tiny_model, requests[n], kwargs))
    assert errors[0].stage == "processor" and "'text'" in str(errors[0])
    assert "Nobody" in str(errors[1]) and "Chelsie" in str(errors[1])
    assert errors[2].stage == "processor" and "seed" in str(errors[2])
    assert after["codes"] == sequential[4]["codes"]

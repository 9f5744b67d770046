"""Batched decoding of the thinker and talker (issue: every live request of a stage process in
one forward per step): concurrent requests joining at different times each equal to their
sequential result, aborts mid-batch, one failing request, a long prompt among short ones, and
text-only requests that run no speech stage. The in-process tests drive the stage objects with a
stand-in context, to see the decode loop's steps; the others run the shipped pipeline."""

from __future__ import annotations

import asyncio
import time

import attrs
import pytest
from omni_core import Pipeline, load_config
from omni_core.errors import StageError
from omni_core.metrics import collect as collect_metrics
from omni_core.plugins import load_plugins
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture

from omni_transformers.qwen2_5_omni.token2wav import BATCHED_MAX_RELATIVE_ERROR, stream_error

pytestmark = pytest.mark.timeout(600)

PROMPT = [257, 117, 115, 101, 114, 10, 104, 101, 108, 108, 111, 258, 10, 257, 97, 10]
LETTERS = list(range(97, 123))


def arun(coro, timeout: float = 500):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def request(n: int, **extra) -> dict:
    """Request n: prompt and reply lengths, seed, speaker and talker sampling all vary with n."""
    prompt = [257] + LETTERS[: 3 + n % 11] + PROMPT[-5:]
    return {"input_ids": prompt, "max_new_tokens": 2 + n % 9, "seed": n, "talker_max_new_tokens": 12 + n % 13,
            "speaker": ("Chelsie", "Ethan")[n % 2], "talker_do_sample": n % 3 != 0, "wav_path": None, **extra}


def config(name: str = "qwen2_5_omni", **stage_args):
    """The shipped pipeline, with ``stage_args[stage]`` merged into that stage's args (a
    ``factory`` key replaces the stage's factory)."""
    cfg = load_config(name, registry=load_plugins().registry)
    stages = []
    for stage in cfg.stages:
        extra = dict(stage_args.get(stage.name, {}))
        factory = extra.pop("factory", stage.factory)
        stages.append(attrs.evolve(stage, factory=factory, args={**stage.args, **extra}) if stage.name in stage_args
                      else stage)
    return attrs.evolve(cfg, stages=stages)


async def staggered(p: Pipeline, inputs: list[dict], every: int = 4) -> list:
    """Submit all, ``every`` at a time after the previous group's first chunk: requests join a
    batch that is already decoding."""
    tasks = []
    for i in range(0, len(inputs), every):
        first = asyncio.Event()

        async def one(inp, first=first):
            result = None
            async for event in p.stream(dict(inp)):
                first.set()
                if event.is_result:
                    result = event.data
            return result

        tasks += [asyncio.ensure_future(one(inp)) for inp in inputs[i:i + every]]
        await asyncio.wait_for(first.wait(), 120)
    return await asyncio.gather(*tasks)


def assert_same(one: dict, many: dict, n) -> None:
    assert many["token_ids"] == one["token_ids"], n
    assert many["codes"] == one["codes"], n
    # token2wav batches concurrent requests' chunks: within the last bits of float32 of alone
    assert stream_error(many["audio"], one["audio"])[0] <= BATCHED_MAX_RELATIVE_ERROR, f"request {n}"


async def stage_calls(p: Pipeline, want: dict[str, int]) -> dict[str, int]:
    """The stage processes' ``omni_stage_calls_total`` per stage, once they add up to ``want``
    (the exports are at most a quarter of a second old), or what they are at the deadline."""
    deadline = time.monotonic() + 30
    while True:
        snap = collect_metrics(p)
        calls: dict[str, int] = {}
        for (stage, _status), value in snap["values"].get("omni_stage_calls_total", []):
            calls[stage] = calls.get(stage, 0) + int(value)
        if all(calls.get(k, 0) >= v for k, v in want.items()) or time.monotonic() > deadline:
            return calls
        await asyncio.sleep(0.05)


@pytest.mark.usefixtures("no_leaks")
def test_16_and_64_concurrent_requests_joining_at_different_times_each_equal_their_sequential_result(tiny_model):
    """And text-only requests (return_audio: false) run neither talker nor token2wav."""
    reqs = [request(n) for n in range(64)]
    text_only = [dict(request(n), return_audio=False) for n in (0, 5, 11)]

    async def go():
        async with Pipeline(config()) as p:
            alone = [await p.submit(dict(r)) for r in reqs]
            sixteen = await staggered(p, reqs[:16], every=4)
            sixty_four = await staggered(p, reqs, every=16)
            texts = [await p.submit(dict(r)) for r in text_only]
            calls = await stage_calls(p, {"token2wav": 64 + 16 + 64, "text": 3})
            return alone, sixteen, sixty_four, texts, calls

    alone, sixteen, sixty_four, texts, calls = arun(go())
    for n, one in enumerate(alone):
        assert_same(one, sixty_four[n], n)
        if n < 16:
            assert_same(one, sixteen[n], n)
    assert sum(len(r["codes"]) > 0 for r in alone) > 50  # the talker had work in most requests
    for r, n in zip(texts, (0, 5, 11), strict=True):
        assert set(r) == {"text", "token_ids", "prompt_tokens", "completion_tokens", "finish_reason"}
        assert r["token_ids"] == alone[n]["token_ids"] and r["text"] == alone[n]["text"]
        assert r["prompt_tokens"] == len(reqs[n]["input_ids"]) and r["completion_tokens"] == len(r["token_ids"])
    runs = 64 + 16 + 64
    assert calls.get("text") == 3
    assert calls.get("thinker") == calls.get("talker") == calls.get("token2wav") == runs, calls


@pytest.mark.usefixtures("no_leaks")
def test_aborts_mid_batch_give_the_memory_back_and_a_failing_row_fails_alone(tiny_model):
    """KV budgets so small that the last request fits only in an empty loop: it finishing shows
    the aborted and failed rows gave their memory back. The thinker's batched step raises while
    the poisoned request (seed 666) is in it: the loop reruns the rows one by one, and only that
    request fails."""
    budget = 200  # thinker KV tokens; a request reserves its prompt + max_new_tokens
    args = {"thinker": {"kv_cache_tokens": budget, "factory": "batching_test_stages:FaultyThinker"},
            "talker": {"kv_cache_tokens": 260}}
    reqs = [request(n) for n in range(12)]
    doomed = [dict(request(100 + n), max_new_tokens=60, talker_max_new_tokens=80) for n in range(4)]
    poisoned = dict(request(7), seed=666, max_new_tokens=8)
    full = dict(request(3), max_new_tokens=budget - len(request(3)["input_ids"]), talker_max_new_tokens=16)

    async def go():
        async with Pipeline(config(**args)) as p:
            alone = [await p.submit(dict(r)) for r in reqs]
            started = asyncio.Event()
            streams = []

            async def abort_after_chunks(inp, n=3):
                seen = 0
                async for _ in p.stream(dict(inp)):
                    seen += 1
                    if seen == n:
                        started.set()
                        return "left"  # leaving the stream aborts the request everywhere

            streams = [asyncio.ensure_future(abort_after_chunks(d)) for d in doomed]
            await asyncio.wait_for(started.wait(), 120)
            mixed = await asyncio.gather(*(p.submit(dict(r)) for r in reqs), p.submit(dict(poisoned)),
                                         return_exceptions=True)
            left = await asyncio.gather(*streams)
            last = await p.submit(dict(full))
            return alone, mixed, left, last

    alone, mixed, left, last = arun(go())
    assert left == ["left"] * 4
    for n, one in enumerate(alone):
        assert_same(one, mixed[n], n)
    assert isinstance(mixed[-1], StageError) and mixed[-1].stage == "thinker"
    assert "poisoned row" in str(mixed[-1])
    assert len(last["token_ids"]) >= 1 and last["prompt_tokens"] == len(full["input_ids"])


# -- in process: the stage objects and their decode loops ------------------------------------------


class Ctx:
    """What a stage call needs of its context: emit, here into a list (with the loop step it came in)."""

    def __init__(self, log=None, name=None):
        self.chunks: list = []
        self.log, self.name = log, name

    async def emit(self, chunk):
        self.chunks.append(chunk)
        if self.log is not None:
            self.log.append(self.name)


def test_in_process_thinker_rows_equal_alone_greedy_and_sampled_and_the_loop_is_left_empty(tiny_model):
    from omni_transformers.qwen2_5_omni.thinker import Thinker

    greedy = Thinker(str(tiny_model), speech=False)
    sampled = Thinker(str(tiny_model), speech=False, do_sample=True, temperature=0.8, top_k=50, top_p=0.9)
    assert sampled.engine is greedy.engine  # one model and one loop for the process's thinkers

    async def call(stage, n):
        return await stage(request(n, max_new_tokens=6 + n % 10), Ctx())

    async def go():
        alone = [await call(stage, n) for n in range(16) for stage in (greedy, sampled)]
        together = await asyncio.gather(*(call(stage, n) for n in range(16) for stage in (greedy, sampled)))
        return alone, together

    alone, together = arun(go())
    assert [r["token_ids"] for r in together] == [r["token_ids"] for r in alone]
    loop = greedy.engine.loop
    assert loop.stats.largest >= 16 and loop.live == 0 and loop.memory_in_use == 0


def test_in_process_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode_every_step(tiny_model):
    from omni_transformers.qwen2_5_omni.thinker import Thinker

    stage = Thinker(str(tiny_model), speech=False, max_prefill_tokens=8, eos_token_id=[])
    whole = Thinker(str(tiny_model), speech=False, max_prefill_tokens=None, eos_token_id=[])
    engine = stage.engine
    steps: list[list[tuple[int, object]]] = []
    step = engine.step

    def record(rows):
        steps.append([(r.state.seed, r.prefill) for r in rows])
        return step(rows)

    engine.loop.step = record
    long_prompt = [257] + LETTERS * 3 + PROMPT[-5:]  # 84 tokens: 11 chunks of at most 8

    async def go():
        runners = [asyncio.ensure_future(stage(request(n, max_new_tokens=40), Ctx())) for n in (1, 2)]
        while engine.loop.stats.steps < 3:
            await asyncio.sleep(0.001)
        long = await stage({"input_ids": long_prompt, "max_new_tokens": 4, "seed": 99}, Ctx())
        done = await asyncio.gather(*runners)
        ref = await whole({"input_ids": long_prompt, "max_new_tokens": 4, "seed": 99}, Ctx())
        return long, done, ref

    long, done, ref = arun(go())
    assert long["token_ids"] == ref["token_ids"]  # chunked prefill: the same tokens as one prompt forward
    chunks = [p for s in steps for seed, p in s if seed == 99 and p is not None]
    assert chunks == [(i, min(i + 8, len(long_prompt))) for i in range(0, len(long_prompt), 8)]
    for s in steps:
        if any(seed == 99 and p is not None for seed, p in s):  # every prompt chunk rode along with both decodes
            assert {(1, None), (2, None)} <= set(s), s
    assert all(len(r["token_ids"]) == 40 for r in done)

"""Start-up and latency of a pipeline against one process running ``generate``:
``python -m omni_transformers.measure CHECKPOINT [--pipeline qwen2_5_omni ...] [--requests 5]
[--preload both|on|off] [--rounds 1] [--no-single]``; batching across requests with
``--batching [--in-flight 1,4,16,64]``; time to first audio under load with ``--first-audio
1,4,16,64 [--modes before,exact,fast]`` (token2wav's chunk modes side by side in one run).

Prints one JSON line per measurement. The single-process numbers are taken in a fresh
interpreter (import transformers, load the whole model, generate), the pipeline's with omni.
``--pipeline`` (repeatable) is a registered name or a config file; with several, each round
measures them one after the other, so configs compared on a loaded machine share its load.
Per request: the median total time, time to the first text chunk and to the first audio chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

INPUTS = {
    "input_ids": [257, 117, 115, 101, 114, 10, 104, 101, 108, 108, 111, 258, 10, 257, 97, 10],
    "max_new_tokens": 12,
    "talker_max_new_tokens": 60,
    "seed": 0,
}

SINGLE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
import transformers
from transformers import Qwen2_5OmniForConditionalGeneration
transformers.logging.set_verbosity_error()
model = Qwen2_5OmniForConditionalGeneration.from_pretrained(sys.argv[1]).eval()
start = time.perf_counter() - t0
inputs = json.loads(sys.argv[2]); n = int(sys.argv[3])
times = []
for _ in range(n):
    torch.manual_seed(inputs["seed"]); t = time.perf_counter()
    model.generate(torch.tensor([inputs["input_ids"]]), thinker_max_new_tokens=inputs["max_new_tokens"],
                   talker_max_new_tokens=inputs["talker_max_new_tokens"])
    times.append(time.perf_counter() - t)
print(json.dumps({"start_s": round(start, 3), "request_s": sorted(times)[len(times) // 2]}))
"""


async def pipeline_numbers(name: str, n: int, preload: bool) -> dict:
    import attrs
    from omni_core import Pipeline, load_config
    from omni_core.plugins import load_plugins

    cfg = load_config(name, registry=load_plugins().registry)
    if not preload:
        cfg = attrs.evolve(cfg, launcher=attrs.evolve(cfg.launcher, options={}))
    t0 = time.perf_counter()
    async with Pipeline(cfg) as p:
        start = time.perf_counter() - t0
        runs = []
        for _ in range(n):
            t = time.perf_counter()
            first_text = first_audio = None
            async for event in p.stream(dict(INPUTS, wav_path=None)):
                now = time.perf_counter() - t
                if event.kind == "chunk" and "text" in event.data and first_text is None:
                    first_text = now
                if event.kind == "chunk" and "audio" in event.data and first_audio is None:
                    first_audio = now
            runs.append((time.perf_counter() - t, first_text, first_audio))
    runs.sort()
    total, text, audio = runs[len(runs) // 2]
    return {
        "start_s": round(start, 3),
        "request_s": round(total, 3),
        "first_text_s": round(text, 3),
        "first_audio_s": round(audio, 3),
    }


#: ``--modes``: the stage arguments of each variant measured by ``--first-audio`` (``before``: exact
#: chunks, first-come batching, the talker's codes 16 at a time and no yielding to a first chunk:
#: the scheduling before the fast mode, but for the batched talker sampling). ``vocoder`` stands for
#: the stage whose chunks carry the audio (the pipeline's ``serve.options.openai.audio_stage``:
#: token2wav, code2wav ...).
MODES = {
    "before": {"vocoder": {"mode": "exact", "first_chunk_priority": False},
               "talker": {"first_codes_per_chunk": 16, "yield_to_first_audio": 0}},
    "exact": {"vocoder": {"mode": "exact"}},
    "fast": {"vocoder": {"mode": "fast"}},
}


def with_stage_args(cfg, changes: dict[str, dict]):
    """``cfg`` with ``changes[stage]`` laid over each named stage's arguments (``vocoder``: the stage
    whose chunks carry the audio)."""
    import attrs

    vocoder = cfg.serve.options.get("openai", {}).get("audio_stage") or "token2wav"
    changes = {vocoder if name == "vocoder" else name: args for name, args in changes.items()}
    stages = [attrs.evolve(s, args={**s.args, **changes[s.name]}) if s.name in changes else s for s in cfg.stages]
    return attrs.evolve(cfg, stages=stages)


async def first_audio_numbers(name: str, in_flight: list[int], requests: int, inputs: dict,
                              stage_args: dict[str, dict] | None = None) -> list[dict]:
    """Time to first audio under load: ``c`` streamed requests at a time (closed loop, each
    finished request replaced at once) for each ``c`` of ``in_flight``; p50/p99 of the first audio
    chunk, of the whole request, their ratio, the audio chunks per request, requests/s and, against
    the first level, the first audio's and the rate's multiples. ``stage_args``: arguments laid
    over the pipeline's stages (a mode of :data:`MODES`)."""
    from omni_core import Pipeline, load_config
    from omni_core.plugins import load_plugins

    def pct(values, q):
        values = sorted(values)
        return round(values[min(len(values) - 1, int(q * len(values)))], 4)

    out = []
    cfg = with_stage_args(load_config(name, registry=load_plugins().registry), stage_args or {})
    async with Pipeline(cfg) as p:
        async def one(seed):
            t = time.perf_counter()
            first = None
            chunks = codes = 0
            async for event in p.stream(dict(inputs, seed=seed, wav_path=None)):
                if event.kind == "chunk" and "audio" in event.data:
                    first = first if first is not None else time.perf_counter() - t
                    chunks += 1
                if event.is_result:
                    codes = len(event.data["codes"])
            return first, time.perf_counter() - t, chunks, codes

        async def worker(runs: list, seeds, count: int) -> None:
            while len(runs) < count:
                runs.append(await one(next(seeds)))

        await one(0)  # warm-up
        pids = {"caller": os.getpid(), **p.pids()}
        for c in in_flight:
            runs: list = []
            seeds = iter(range(1, 10**9))
            t0, cpu0 = time.perf_counter(), cpu_seconds(pids)
            await asyncio.gather(*(worker(runs, seeds, max(requests, c)) for _ in range(c)))
            elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pids)
            firsts = [r[0] for r in runs if r[0] is not None]
            out.append({"in_flight": c, "requests": len(runs), "first_audio_p50_s": pct(firsts, 0.5),
                        "first_audio_p99_s": pct(firsts, 0.99), "request_p50_s": pct([r[1] for r in runs], 0.5),
                        "first_audio_over_request_p50": pct([r[0] / r[1] for r in runs if r[0] is not None], 0.5),
                        "audio_chunks_p50": pct([r[2] for r in runs], 0.5), "codes_p50": pct([r[3] for r in runs], 0.5),
                        "requests_per_s": round(len(runs) / elapsed, 2),
                        "cpu_ms_per_request": {role: round((cpu[role] - cpu0[role]) * 1e3 / len(runs), 1)
                                               for role in pids},
                        "cores_used": round(sum(cpu[role] - cpu0[role] for role in pids) / elapsed, 2)})
            out[-1]["first_audio_x_first_level"] = round(out[-1]["first_audio_p50_s"] / out[0]["first_audio_p50_s"], 2)
            out[-1]["requests_per_s_x_first_level"] = round(out[-1]["requests_per_s"] / out[0]["requests_per_s"], 2)
            print(json.dumps({"what": f"{name} first audio", **out[-1]}), flush=True)
    return out


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """Each process's CPU time so far (user + system, every thread), in seconds (Linux's process
    CPU clock; NaN where it cannot be read)."""
    out = {}
    for role, pid in pids.items():
        try:
            out[role] = time.clock_gettime_ns(((~pid) << 3) | 2) / 1e9  # CPUCLOCK_SCHED of process pid
        except (OSError, OverflowError, AttributeError):
            out[role] = float("nan")
    return out


# -- batching across requests ----------------------------------------------------------------------


def batch_requests(n: int) -> list[dict]:
    """n requests: INPUTS with prompts of 12 to 16 tokens and their own seeds."""
    return [dict(INPUTS, input_ids=INPUTS["input_ids"][: 12 + i % 5], seed=i) for i in range(n)]


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


async def thinker_numbers(stage, in_flight: int, new_tokens: int) -> dict:
    """``in_flight`` requests of ``new_tokens`` tokens each through one thinker stage object (its
    decode loop), in this process: tokens/s and the mean wall time of one step."""

    class Sink:
        async def emit(self, chunk):
            pass

    stats = stage.engine.loop.stats
    steps, busy = stats.steps, stats.busy_s
    t = time.perf_counter()
    await asyncio.gather(*(stage(dict(r, max_new_tokens=new_tokens), Sink()) for r in batch_requests(in_flight)))
    wall = time.perf_counter() - t
    steps = stats.steps - steps
    return {"in_flight": in_flight, "tokens_s": round(in_flight * new_tokens / wall, 1),
            "step_ms": round((stats.busy_s - busy) / steps * 1e3, 3), "steps": steps}


def generate_numbers(thinker, in_flight: int, new_tokens: int) -> dict:
    """transformers' own ``generate`` of the same requests' thinker part: one at a time, then as
    one left-padded batch (greedy, exactly ``new_tokens`` each)."""
    import torch

    prompts = [r["input_ids"] for r in batch_requests(in_flight)]
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    t = time.perf_counter()
    for ids in prompts:
        thinker.generate(torch.tensor([ids]), **kwargs)
    alone = time.perf_counter() - t
    width = max(len(ids) for ids in prompts)
    pad = thinker.config.text_config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    thinker.generate(ids, attention_mask=mask, **kwargs)
    batched = time.perf_counter() - t
    total = in_flight * new_tokens
    return {"in_flight": in_flight, "one_at_a_time_tokens_s": round(total / alone, 1),
            "batched_tokens_s": round(total / batched, 1)}


async def pipeline_batching(name: str, levels: list[int], modes: tuple[bool, ...] = (True,)) -> list[dict]:
    """The pipeline under a closed loop of ``c`` clients for each level: requests/s, tokens/s
    (thinker tokens, talker codes), medians of the time to first text, first audio and the end.
    ``modes``: ``return_audio`` values to measure (False: text only, the thinker alone)."""
    from omni_core import Pipeline, load_config
    from omni_core.plugins import load_plugins

    rows = []
    async with Pipeline(load_config(name, registry=load_plugins().registry)) as p:
        await p.submit(dict(INPUTS, wav_path=None))  # warm
        for c, audio_on in ((c, a) for c in levels for a in modes):
            todo = [dict(r, return_audio=audio_on) for r in batch_requests(max(2 * c, 8))]
            runs: list[tuple[float, float, float, int, int]] = []

            async def client(todo=todo, runs=runs):
                while todo:
                    inputs = dict(todo.pop(), wav_path=None)
                    t = time.perf_counter()
                    text = audio = None
                    async for event in p.stream(inputs):
                        now = time.perf_counter() - t
                        if event.is_result:
                            tokens, codes = len(event.data["token_ids"]), len(event.data.get("codes", ()))
                        elif "audio" in event.data and audio is None:
                            audio = now
                        elif "text" in event.data and text is None:
                            text = now
                    runs.append((time.perf_counter() - t, text, audio, tokens, codes))

            t0 = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(c)))
            wall = time.perf_counter() - t0
            rows.append({"what": f"{name} batching" + ("" if audio_on else " text only"), "in_flight": c,
                         "requests": len(runs),
                         "requests_s": round(len(runs) / wall, 2),
                         "thinker_tokens_s": round(sum(r[3] for r in runs) / wall, 1),
                         "codes_s": round(sum(r[4] for r in runs) / wall, 1),
                         "first_text_ms": round(median(r[1] for r in runs) * 1e3, 1),
                         "first_audio_ms": round(median(r[2] for r in runs) * 1e3, 1) if audio_on else None,
                         "request_ms": round(median(r[0] for r in runs) * 1e3, 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def batching(checkpoint: str, levels: list[int], pipelines: list[str], new_tokens: int = 32,
             modes: tuple[bool, ...] = (True,), in_process: bool = True) -> None:
    import torch
    import transformers

    from .qwen2_5_omni.thinker import Thinker

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    transformers.logging.set_verbosity_error()

    async def in_process_run():  # one event loop: the stage's decode loop binds to it
        stage = Thinker(checkpoint, eos_token_id=[])  # exactly new_tokens per request
        thinker = transformers.Qwen2_5OmniForConditionalGeneration.from_pretrained(checkpoint).thinker.eval()
        await thinker_numbers(stage, 1, 4)  # warm
        for c in levels:
            mine = await thinker_numbers(stage, c, new_tokens)
            ref = generate_numbers(thinker, c, new_tokens)
            print(json.dumps({"what": "thinker in process (decode loop)", **mine}), flush=True)
            print(json.dumps({"what": "transformers thinker.generate", **ref}), flush=True)
        await stage.close()

    if in_process:
        asyncio.run(in_process_run())
    for name in pipelines:
        asyncio.run(pipeline_batching(name, levels, modes))


def first_audio_table(rows: list[dict]) -> str:
    """The ``--first-audio`` rows as a Markdown table (multiples against each variant's first level)."""
    lines = ["| pipeline | mode | in flight | requests/s | × | first audio p50 | × | request p50 | "
             "first audio ÷ request | codes | CPU per request | cores |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['pipeline']} | {r['mode']} | {r['in_flight']} | {r['requests_per_s']} | "
                     f"{r['requests_per_s_x_first_level']} | {r['first_audio_p50_s'] * 1e3:.0f} ms | "
                     f"{r['first_audio_x_first_level']} | {r['request_p50_s'] * 1e3:.0f} ms | "
                     f"{r['first_audio_over_request_p50']} | {r['codes_p50']:g} | "
                     f"{sum(r['cpu_ms_per_request'].values()):.0f} ms | {r['cores_used']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_transformers.measure")
    parser.add_argument("checkpoint")
    parser.add_argument(
        "--pipeline", action="append", help="a registered name or a config file (repeatable)"
    )
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--preload", choices=("both", "on", "off"), default="both")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--no-single", action="store_true", help="skip the single-process generate run"
    )
    parser.add_argument("--first-audio", metavar="N,N,...",
                        help="measure time to first audio at these numbers of requests in flight (e.g. 1,16,64) "
                             "instead of the rest")
    parser.add_argument("--talker-max-new-tokens", type=int, default=None,
                        help="codes per reply at most (default: the inputs' 60)")
    parser.add_argument("--modes", default=None, metavar="M,M,...",
                        help=f"with --first-audio: measure these variants one after the other in one run "
                             f"({', '.join(MODES)}; before: exact chunks, first-come batching, the talker's codes "
                             f"16 at a time, no yielding to first chunks), each against the first level "
                             f"(default: the pipeline as shipped)")
    parser.add_argument("--text", default=None,
                        help="with --first-audio: the request's text (through the chat template) instead of "
                             "the fixed prompt ids")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="with --first-audio: thinker tokens per reply at most (default: the inputs' 12)")
    parser.add_argument("--talker-greedy", action="store_true",
                        help="with --first-audio: a greedy talker (talker_do_sample: false)")
    parser.add_argument("--batching", action="store_true",
                        help="measure batching across requests at --in-flight levels instead")
    parser.add_argument("--in-flight", default="1,4,16,64", help="comma-separated levels (with --batching)")
    parser.add_argument("--text-only", choices=("no", "also", "only"), default="no",
                        help="with --batching: also (or only) measure return_audio: false requests")
    parser.add_argument("--no-in-process", action="store_true",
                        help="with --batching: skip the in-process thinker and generate numbers")
    args = parser.parse_args(argv)
    os.environ["OMNI_TRANSFORMERS_MODEL"] = args.checkpoint
    if args.batching:
        levels = [int(x) for x in args.in_flight.split(",") if x.strip()]
        modes = {"no": (True,), "also": (True, False), "only": (False,)}[args.text_only]
        batching(args.checkpoint, levels, args.pipeline or ["qwen2_5_omni"], modes=modes,
                 in_process=not args.no_in_process)
        return 0
    if args.first_audio:
        inputs = dict(INPUTS)
        if args.talker_max_new_tokens:
            inputs["talker_max_new_tokens"] = args.talker_max_new_tokens
        if args.max_new_tokens:
            inputs["max_new_tokens"] = args.max_new_tokens
        if args.text:
            del inputs["input_ids"]
            inputs["text"] = args.text
        if args.talker_greedy:
            inputs["talker_do_sample"] = False
        levels = [int(x) for x in args.first_audio.split(",")]
        modes = [m.strip() for m in args.modes.split(",")] if args.modes else [None]
        unknown = [m for m in modes if m is not None and m not in MODES]
        if unknown:
            parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
        table = []
        for pipeline in args.pipeline or ["qwen2_5_omni"]:
            for mode in modes:
                for row in asyncio.run(first_audio_numbers(pipeline, levels, args.requests, inputs,
                                                           MODES.get(mode))):
                    table.append({"pipeline": pipeline, "mode": mode or "as shipped", **row})
        print(first_audio_table(table), flush=True)
        return 0
    if not args.no_single:
        out = subprocess.run(
            [sys.executable, "-c", SINGLE, args.checkpoint, json.dumps(INPUTS), str(args.requests)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        )
        print(
            json.dumps(
                {
                    "what": "single process (generate)",
                    **json.loads(out.stdout.strip().splitlines()[-1]),
                }
            )
        )
    preloads = {"both": (False, True), "on": (True,), "off": (False,)}[args.preload]
    for round_ in range(args.rounds):
        for pipeline in args.pipeline or ["qwen2_5_omni"]:
            for preload in preloads:
                numbers = asyncio.run(pipeline_numbers(pipeline, args.requests, preload))
                print(
                    json.dumps(
                        {"what": f"{pipeline} preload={preload}", "round": round_, **numbers}
                    ),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

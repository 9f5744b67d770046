"""Start-up and latency of a pipeline against one process running ``generate``:
``python -m omni_transformers.measure CHECKPOINT [--pipeline qwen2_5_omni ...] [--requests 5]
[--preload both|on|off] [--rounds 1] [--no-single]``.

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
    args = parser.parse_args(argv)
    os.environ["OMNI_TRANSFORMERS_MODEL"] = args.checkpoint
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

"""Start-up and latency of a pipeline against one process running ``generate``:
``python -m omni_transformers.measure CHECKPOINT [--pipeline qwen2_5_omni] [--requests 5]``.

Prints one JSON line per measurement. The single-process numbers are taken in a fresh
interpreter (import transformers, load the whole model, generate), the pipeline's with omni.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

INPUTS = {"input_ids": [257, 117, 115, 101, 114, 10, 104, 101, 108, 108, 111, 258, 10, 257, 97, 10],
          "max_new_tokens": 12, "talker_max_new_tokens": 60, "seed": 0}

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
    return {"start_s": round(start, 3), "request_s": round(total, 3), "first_text_s": round(text, 3),
            "first_audio_s": round(audio, 3)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_transformers.measure")
    parser.add_argument("checkpoint")
    parser.add_argument("--pipeline", default="qwen2_5_omni")
    parser.add_argument("--requests", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ["OMNI_TRANSFORMERS_MODEL"] = args.checkpoint
    out = subprocess.run([sys.executable, "-c", SINGLE, args.checkpoint, json.dumps(INPUTS), str(args.requests)],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    print(json.dumps({"what": "single process (generate)", **json.loads(out.stdout.strip().splitlines()[-1])}))
    for preload in (False, True):
        numbers = asyncio.run(pipeline_numbers(args.pipeline, args.requests, preload))
        print(json.dumps({"what": f"{args.pipeline} preload={preload}", **numbers}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

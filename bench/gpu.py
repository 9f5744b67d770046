"""gpu: omni on one GPU, run by ``gpu/check`` on a GPU machine (docs/gpu.md).

``python -m bench.gpu relay [--out DIR] [--budget S]``: tensors of 1 MiB to 1 GiB between two
stage processes on one GPU, through ``cuda_ipc`` and through ``shm``, one request at a time. The
source stage returns a warm CUDA tensor of the requested size (made once per size: the relay's
cost alone); the sink stage, on the same GPU, needs it there (a host tensor from ``shm`` is moved
to the GPU) and reads its last byte. GB/s = bytes / median request time, so the control plane's
per-request cost is in it. The baseline, measured in the same run and interleaved with the relays
in alternating blocks, is a device-to-device ``dst.copy_(src)`` of the same size into a warm
buffer, timed with CUDA events: ratio 1 = as fast as one copy on the device (``cuda_ipc`` on one
GPU moves nothing, so it can be above 1).

``python -m bench.gpu transformers [--out DIR] [--budget S] [--shape 3b]``: the omni-transformers
pipeline (``qwen2_5_omni``, every stage on GPU 0, thinker and talker in bfloat16) on a random
checkpoint of realistic size written on the device (4.2 B parameters: a Qwen2.5-Omni-3B-shaped
thinker of 36 layers of 2048 and a 151,936-token vocabulary, a 24-layer talker, a full-size
token2wav; tiny audio and vision encoders, the prompts being text), with 1, 16 and 64 requests in flight: text tokens per second,
time to the first text chunk and to the first audio chunk. The reference is transformers' own
``Qwen2_5OmniForConditionalGeneration.generate`` on the same model, one request at a time in this
process (it does not batch a spoken answer). Random weights never stop early: every answer has its
full length.

Each writes ``gpu-<part>.json`` with rows, a markdown summary and notes, and stays within
``--budget`` seconds: what does not fit is left out and noted. ``--device cpu`` (with
``--shape small``) runs the same code on a CPU machine, to check it, measuring nothing of interest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import common
from .common import MiB

SIZES = [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB]
PROMPT = [257, 117, 115, 101, 114, 10, 104, 101, 108, 108, 111, 32, 111, 109, 110, 105, 258, 10, 257, 97, 10]


# -- stages (imported by dotted path in the stage processes) -------------------------------------------


class GpuSource:
    """Returns ``{"t": <uint8 tensor of payload["nbytes"] bytes on this stage's device>}``, made
    once per size."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.cache: dict[int, Any] = {}

    async def __call__(self, payload, ctx):
        import torch

        nbytes = int(payload["nbytes"])
        t = self.cache.get(nbytes)
        if t is None:
            self.cache.clear()  # one size at a time: 1 GiB tensors do not pile up
            t = self.cache[nbytes] = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
        return {"t": t}


class GpuSink:
    """Needs the tensor on its own device: moves a host tensor there, then reads its last byte."""

    def __init__(self, device: str = "cpu"):
        self.device = device

    async def __call__(self, payload, ctx):
        t = payload["t"]
        arrived = t.device.type
        if str(t.device) != self.device:
            t = t.to(self.device)
        return {"n": int(t.numel()), "last": int(t[-1]) if t.numel() else 0, "arrived": arrived}


# -- relay -----------------------------------------------------------------------------------------------


class DeviceCopy:
    """``dst.copy_(src)`` on the device into a warm buffer, timed with CUDA events (the baseline)."""

    def __init__(self, device: str):
        import torch

        self.torch = torch
        self.device = device
        self.pair: tuple[int, Any, Any] | None = None

    def once(self, nbytes: int) -> float:
        torch = self.torch
        if self.pair is None or self.pair[0] != nbytes:
            self.pair = None
            src = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            dst.copy_(src)
            self.pair = (nbytes, src, dst)
        _, src, dst = self.pair
        if self.device == "cpu":
            t0 = time.perf_counter()
            dst.copy_(src)
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


def relay_config(relay: str, options: dict, gpu: int | None) -> dict:
    stage = {"gpu": gpu} if gpu is not None else {}
    return {
        "name": f"bench-gpu-{relay}",
        "relay": {"backend": relay, "options": options},
        "stages": [
            {"name": "src", "factory": "bench.gpu:GpuSource", "next": "sink", **stage},
            {"name": "sink", "factory": "bench.gpu:GpuSink", "terminal": True, **stage},
        ],
    }


def shm_fit(sizes: list[int], notes: list[str]) -> tuple[list[int], dict]:
    """The sizes a two-slot shm pool of the largest size fits in /dev/shm (with room to spare)."""
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:
        free = 0
    fit = [s for s in sizes if 3 * s <= free]
    if len(fit) < len(sizes):
        notes.append(f"shm: /dev/shm has {free / 2**30:.1f} GiB free: sizes above {common.human_bytes(max(fit)) if fit else '0'} left out")
    return fit, {"slot_bytes": max(fit) if fit else MiB, "slots": 2}


def run_relay(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    from omni_core import Pipeline

    deadline = time.monotonic() + args.budget
    doc["parameters"].update(sizes=args.sizes, device=args.device)
    gpu = 0 if args.device.startswith("cuda") else None
    copy = DeviceCopy(args.device)
    shm_sizes, shm_options = shm_fit(args.sizes, doc["notes"])
    variants = [("cuda_ipc", {}, args.sizes), ("shm", shm_options, shm_sizes)]
    if gpu is None:
        variants = variants[1:]
        doc["notes"].append("on the CPU: cuda_ipc left out")
    with common.Loop() as loop:
        for relay, options, sizes in variants:
            if time.monotonic() > deadline - 20:
                doc["notes"].append(f"{relay}: not measured, out of time")
                continue
            pipeline = Pipeline(relay_config(relay, options, gpu))
            t0 = time.perf_counter()
            loop.run(asyncio.wait_for(pipeline.start(), max(5.0, deadline - time.monotonic())))
            common.log(f"gpu relay: {relay} pipeline up in {time.perf_counter() - t0:.1f} s")
            try:
                for nbytes in sizes:
                    left = deadline - time.monotonic()
                    if left < 10:
                        doc["notes"].append(f"{relay} {common.human_bytes(nbytes)} and larger: not measured, out of time")
                        break
                    doc["rows"].append(measure(loop, pipeline, relay, nbytes, copy, min(args.per_size, left / 3)))
                    r = doc["rows"][-1]
                    common.log(f"gpu relay: {relay} {common.human_bytes(nbytes)}: {r['gbps']:.2f} GB/s, "
                               f"copy {r['copy_gbps']:.1f} GB/s, ratio {r['ratio']:.3f}, arrived on {r['arrived']}")
            finally:
                loop.run(pipeline.stop())
    for r in doc["rows"]:
        doc["ratios"][f"{r['relay']} {common.human_bytes(r['bytes'])}"] = r["ratio"]


def measure(loop: common.Loop, pipeline: Any, relay: str, nbytes: int, copy: DeviceCopy, seconds: float) -> dict:
    async def once() -> tuple[float, dict]:
        t0 = time.perf_counter()
        out = await pipeline.submit({"nbytes": nbytes})
        took = time.perf_counter() - t0
        if out["n"] != nbytes or out["last"] != 1:
            raise AssertionError(f"relay {relay} delivered {out} for {nbytes} bytes")
        return took, out

    warm = [loop.run(once()) for _ in range(2)]
    [copy.once(nbytes) for _ in range(3)]
    per_request = max(min(t for t, _ in warm), 1e-6)
    rounds = 5
    reps = max(1, min(40, int(seconds / 2 / per_request / rounds)))
    relay_t: list[float] = []
    copy_t: list[float] = []
    for order in common.rounds(["relay", "copy"], rounds, seed=nbytes):
        for what in order:
            if what == "relay":
                relay_t += [loop.run(once())[0] for _ in range(reps)]
            else:
                copy_t += [copy.once(nbytes) for _ in range(max(reps, 5))]
    r, c = common.summarize(relay_t), common.summarize(copy_t)
    gbps, copy_gbps = nbytes / r["median"] / 1e9, nbytes / c["median"] / 1e9
    return {"relay": relay, "bytes": nbytes, "requests": len(relay_t), "request_ms": common.summarize(relay_t, 1e3),
            "copy_ms": common.summarize(copy_t, 1e3), "gbps": gbps, "copy_gbps": copy_gbps, "ratio": gbps / copy_gbps,
            "arrived": warm[0][1]["arrived"]}


def relay_summary(doc: dict) -> str:
    by_size: dict[int, dict[str, dict]] = {}
    for r in doc["rows"]:
        by_size.setdefault(r["bytes"], {})[r["relay"]] = r
    rows = []
    for size in sorted(by_size):
        ipc, shm = by_size[size].get("cuda_ipc"), by_size[size].get("shm")
        copies = [x["copy_gbps"] for x in by_size[size].values()]
        rows.append([common.human_bytes(size), ipc and ipc["request_ms"]["median"], ipc and ipc["gbps"], ipc and ipc["ratio"],
                     shm and shm["request_ms"]["median"], shm and shm["gbps"], shm and shm["ratio"], sorted(copies)[len(copies) // 2]])
    headers = ["size", "cuda_ipc ms", "cuda_ipc GB/s", "cuda_ipc / copy", "shm ms", "shm GB/s", "shm / copy", "D2D copy_ GB/s"]
    return ("Two stage processes on one GPU, one request at a time (GB/s = bytes / median request time; "
            "ratio 1 = one device-to-device copy_)\n\n" + common.table(headers, rows))


# -- transformers ------------------------------------------------------------------------------------------

#: Overrides of omni_transformers.tiny's config: "3b" is Qwen2.5-Omni-3B's thinker shape (the
#: encoders stay tiny), "small" the same structure at a size a CPU builds in seconds.
SHAPES = {
    "3b": {
        "text": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                 "num_attention_heads": 16, "num_key_value_heads": 2, "max_position_embeddings": 32768,
                 "mrope_section": [16, 24, 24]},
        "talker": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                   "num_key_value_heads": 2, "head_dim": 64, "mrope_section": [8, 12, 12]},
        "dit": {"hidden_size": 1024, "num_hidden_layers": 22, "num_attention_heads": 16, "head_dim": 64, "ff_mult": 2,
                "emb_dim": 512, "mel_dim": 80, "enc_emb_dim": 192, "enc_dim": 128, "enc_channels": [256, 256, 256, 256, 768],
                "enc_attention_channels": 64, "enc_se_channels": 64, "block_size": 24, "look_ahead_layers": [10],
                "look_backward_layers": [0, 20]},
        "bigvgan": {"mel_dim": 80, "upsample_initial_channel": 1536, "resblock_kernel_sizes": [3, 7, 11],
                    "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]], "upsample_rates": [5, 3, 2, 2, 2, 2],
                    "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4]},
    },
    "small": {
        "text": {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
                 "mrope_section": [8, 12, 12]},
        "talker": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "head_dim": 64, "mrope_section": [8, 12, 12]},
        "dit": {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2, "head_dim": 32, "ff_mult": 2,
                "emb_dim": 32, "mel_dim": 16, "enc_emb_dim": 32, "enc_dim": 16, "enc_channels": [32, 32, 32, 32, 96],
                "enc_attention_channels": 8, "enc_se_channels": 8, "block_size": 24, "look_ahead_layers": [2],
                "look_backward_layers": [0, 3]},
        "bigvgan": {"mel_dim": 16, "upsample_initial_channel": 64, "resblock_kernel_sizes": [3, 7, 11],
                    "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]], "upsample_rates": [5, 3, 2, 2, 2, 2],
                    "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4]},
    },
}


def shaped_config(shape: str):
    """A Qwen2_5OmniConfig of ``shape`` (SHAPES), built from the tiny checkpoint's."""
    from omni_transformers.tiny import tiny_config
    from transformers import Qwen2_5OmniConfig

    s = SHAPES[shape]
    d = tiny_config().to_dict()
    thinker = d["thinker_config"]
    text = thinker["text_config"]
    mrope = s["text"]["mrope_section"]
    text.update({k: v for k, v in s["text"].items() if k != "mrope_section"})
    text["head_dim"] = s["text"]["hidden_size"] // s["text"]["num_attention_heads"]
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": mrope}
    thinker["audio_config"]["output_dim"] = text["hidden_size"]
    thinker["vision_config"]["out_hidden_size"] = text["hidden_size"]
    talker = d["talker_config"]
    talker.update({k: v for k, v in s["talker"].items() if k != "mrope_section"})
    talker["embedding_size"] = text["hidden_size"]
    talker["rope_parameters"] = {**talker["rope_parameters"], "mrope_section": s["talker"]["mrope_section"]}
    for sub in (text, talker):  # derived from the layer count: rebuilt for the new one
        sub.pop("layer_types", None)
        sub.pop("max_window_layers", None)
    d["token2wav_config"]["dit_config"].update(s["dit"])
    d["token2wav_config"]["bigvgan_config"].update(s["bigvgan"])
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        d.pop(key, None)
    return Qwen2_5OmniConfig(**{k: v for k, v in d.items() if k in ("thinker_config", "talker_config", "token2wav_config",
                                                                     "enable_audio_output")})


def build_checkpoint(path: Path, shape: str, device: str, dtype: str):
    """Write a random checkpoint of ``shape`` to ``path``, built on ``device``; returns the model
    (on the device, for the reference) and the seconds building and writing took."""
    import torch
    import transformers
    from omni_transformers.tiny import SAMPLE_RATE, tiny_speakers, tiny_tokenizer
    from transformers import Qwen2_5OmniForConditionalGeneration

    transformers.logging.set_verbosity_error()
    config = shaped_config(shape)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5OmniForConditionalGeneration._from_config(config, dtype=getattr(torch, dtype))
    model.eval()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    torch.save(tiny_speakers(config), path / "spk_dict.pt")
    model.load_speakers(str(path / "spk_dict.pt"))  # from_pretrained would: generate needs them
    (path / "omni_transformers.json").write_text(json.dumps({"sample_rate": SAMPLE_RATE, "shape": shape}) + "\n")
    params = sum(p.numel() for p in model.parameters())
    thinker = sum(p.numel() for p in model.thinker.parameters())
    return model, {"build_s": built, "write_s": time.perf_counter() - t0, "parameters": params, "thinker_parameters": thinker,
                   "bytes_on_disk": sum(f.stat().st_size for f in path.iterdir() if f.is_file())}


def reference(model, args: argparse.Namespace, count: int) -> dict:
    """transformers' generate, one request at a time: seconds per request, text tokens/s."""
    import torch

    ids = torch.tensor([PROMPT], device=model.device)

    def once(text_tokens: int, codes: int) -> tuple[float, int, Any]:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            sequences, audio = model.generate(ids, speaker="Chelsie", thinker_max_new_tokens=text_tokens,
                                              talker_max_new_tokens=codes)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0, int(sequences.shape[1] - ids.shape[1]), sequences[0, ids.shape[1]:].tolist()

    once(4, 8)  # warm-up: kernels, cuBLAS handles, the first allocation
    runs = [once(args.text_tokens, args.codes) for _ in range(count)]
    times = [r[0] for r in runs]
    s = common.summarize(times)
    return {"requests": count, "request_s": s, "text_tokens": runs[0][1], "tokens_per_s": runs[0][1] / s["median"],
            "token_ids": runs[0][2]}


def pipeline_config(model: Path, gpu: int | None, dtype: str) -> dict:
    from importlib.resources import files

    import yaml

    cfg = yaml.safe_load(files("omni_transformers").joinpath("pipelines/qwen2_5_omni.yaml").read_text())
    cfg.pop("serve", None)
    for stage in cfg["stages"]:
        args = stage.setdefault("args", {})
        args["model"] = str(model)
        if stage["name"] in ("thinker", "talker"):
            args["dtype"] = dtype
        if gpu is not None:
            stage["gpu"] = gpu
    # 64 requests at once: a stream may wait long for its consumer without being stalled
    cfg.setdefault("limits", {}).update(request_timeout=600, stream_stall_timeout=300)
    return cfg


async def one_level(pipeline: Any, in_flight: int, args: argparse.Namespace) -> dict:
    async def request(i: int) -> dict:
        t0 = time.perf_counter()
        first_text = first_audio = None
        result = None
        inputs = {"input_ids": PROMPT, "max_new_tokens": args.text_tokens, "talker_max_new_tokens": args.codes,
                  "seed": i, "wav_path": None}
        async for event in pipeline.stream(inputs):
            now = time.perf_counter() - t0
            if event.is_result:
                result = event.data
            elif isinstance(event.data, dict):
                if first_text is None and event.data.get("text") is not None:
                    first_text = now
                if first_audio is None and event.data.get("audio") is not None:
                    first_audio = now
        total = time.perf_counter() - t0
        return {"total_s": total, "first_text_s": first_text, "first_audio_s": first_audio,
                "text_tokens": len(result.get("token_ids") or []), "token_ids": result.get("token_ids"),
                "audio_samples": int(getattr(result.get("audio"), "numel", lambda: 0)())}

    t0 = time.perf_counter()
    done = await asyncio.gather(*(request(i) for i in range(in_flight)))
    wall = time.perf_counter() - t0
    tokens = sum(d["text_tokens"] for d in done)
    pick = lambda key: common.summarize([d[key] for d in done if d[key] is not None])  # noqa: E731
    return {"in_flight": in_flight, "wall_s": wall, "text_tokens": tokens, "tokens_per_s": tokens / wall,
            "first_text_s": pick("first_text_s"), "first_audio_s": pick("first_audio_s"), "total_s": pick("total_s"),
            "audio_samples": done[0]["audio_samples"], "token_ids_0": done[0]["token_ids"]}


def run_transformers(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    import torch

    from omni_core import Pipeline

    deadline = time.monotonic() + args.budget
    doc["parameters"].update(shape=args.shape, dtype=args.dtype, device=args.device, text_tokens=args.text_tokens,
                             codes=args.codes, in_flight=args.in_flight, prompt_tokens=len(PROMPT))
    room = Path("/dev/shm") if shutil.disk_usage("/dev/shm").free > (24 << 30) else Path(tempfile.gettempdir())
    folder = Path(tempfile.mkdtemp(prefix="omni-bench-ckpt-", dir=room))
    try:
        model, facts = build_checkpoint(folder, args.shape, args.device, args.dtype)
        doc["checkpoint"] = {**facts, "folder": str(room)}
        common.log(f"gpu transformers: {facts['parameters'] / 1e9:.2f} B parameters ({facts['thinker_parameters'] / 1e9:.2f} B thinker) "
                   f"built in {facts['build_s']:.1f} s, written in {facts['write_s']:.1f} s")
        if deadline - time.monotonic() < 60:
            doc["notes"].append(f"building and writing the checkpoint left {deadline - time.monotonic():.0f} s: nothing measured")
            return
        ref = reference(model, args, count=args.reference_requests)
        doc["reference"] = ref
        common.log(f"gpu transformers: generate {ref['request_s']['median']:.2f} s per request, {ref['tokens_per_s']:.1f} text tokens/s")
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        gpu = 0 if args.device.startswith("cuda") else None
        with common.Loop() as loop:
            pipeline = Pipeline(pipeline_config(folder, gpu, args.dtype))
            t0 = time.perf_counter()
            loop.run(asyncio.wait_for(pipeline.start(), max(10.0, deadline - time.monotonic())))
            doc["pipeline_start_s"] = time.perf_counter() - t0
            common.log(f"gpu transformers: pipeline up in {doc['pipeline_start_s']:.1f} s")
            try:
                loop.run(one_level(pipeline, 1, args))  # warm-up
                last = None
                for level in args.in_flight:
                    left = deadline - time.monotonic()
                    if last is not None:  # throughput no worse than the level before
                        estimate = level * args.text_tokens / max(last["tokens_per_s"], 1e-6) * 1.3
                        if estimate > left - 10:
                            doc["notes"].append(f"{level} in flight: not measured, would take about {estimate:.0f} s and {left:.0f} s are left")
                            continue
                    row = loop.run(asyncio.wait_for(one_level(pipeline, level, args), max(5.0, left - 5)))
                    row["vs_generate"] = row["tokens_per_s"] / ref["tokens_per_s"]
                    row["same_tokens_as_generate"] = row.pop("token_ids_0") == ref["token_ids"]
                    doc["rows"].append(row)
                    last = row
                    common.log(f"gpu transformers: {level} in flight: {row['tokens_per_s']:.1f} tokens/s "
                               f"({row['vs_generate']:.2f} x generate), first text {row['first_text_s']['median']:.2f} s, "
                               f"first audio {row['first_audio_s']['median']:.2f} s")
            finally:
                loop.run(pipeline.stop())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for r in doc["rows"]:
        doc["ratios"][f"{r['in_flight']} in flight vs generate"] = r["vs_generate"]


def transformers_summary(doc: dict) -> str:
    ref = doc.get("reference") or {}
    ck = doc.get("checkpoint") or {}
    p = doc["parameters"]
    head = (f"qwen2_5_omni on one GPU, random {p['shape']} checkpoint ({(ck.get('parameters') or 0) / 1e9:.2f} B parameters, "
            f"{p['dtype']}), {p['prompt_tokens']} prompt tokens, {p['text_tokens']} text tokens and up to {p['codes']} codes per "
            f"request; generate (one at a time): {ref.get('tokens_per_s', float('nan')):.1f} text tokens/s, "
            f"{(ref.get('request_s') or {}).get('median', float('nan')):.2f} s per request")
    rows = [[r["in_flight"], r["tokens_per_s"], r["vs_generate"], r["first_text_s"]["median"], r["first_audio_s"]["median"],
             r["total_s"]["median"], r["wall_s"], r["same_tokens_as_generate"]] for r in doc["rows"]]
    headers = ["in flight", "text tokens/s", "x generate", "first text s (p50)", "first audio s (p50)", "request s (p50)",
               "wall s", "tokens = generate's"]
    return head + "\n\n" + common.table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description="omni's benchmarks on one GPU (gpu/check runs them)")
    parser.add_argument("part", choices=["relay", "transformers"])
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds the part may take")
    parser.add_argument("--device", default="cuda:0", help="cuda:0 (default), or cpu to check the code on a CPU machine")
    parser.add_argument("--sizes", type=lambda s: [int(float(x) * MiB) for x in s.split(",")], default=SIZES,
                        help="relay: tensor sizes in MiB, comma-separated (default 1,4,16,64,256,1024)")
    parser.add_argument("--per-size", type=float, default=4.0, help="relay: seconds per size and relay at most")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="3b", help="transformers: the checkpoint's shape")
    parser.add_argument("--dtype", default="bfloat16", help="transformers: the thinker's and talker's dtype")
    parser.add_argument("--text-tokens", type=int, default=32, help="transformers: text tokens per request")
    parser.add_argument("--codes", type=int, default=96, help="transformers: talker codes per request at most")
    parser.add_argument("--in-flight", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64],
                        help="transformers: requests in flight, comma-separated (default 1,16,64)")
    parser.add_argument("--reference-requests", type=int, default=3, help="transformers: generate runs")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("error: torch sees no CUDA device; use --device cpu to check the code on a CPU machine", file=sys.stderr)
            return 2
    else:
        import torch

        torch.set_num_threads(1)  # beside the stage processes, on a CPU machine's few cores
    os.environ.setdefault("OMNI_LOG_LEVEL", "WARNING")
    doc = common.result(f"gpu-{args.part}", quick=False, parameters={})
    status = 0
    try:
        (run_relay if args.part == "relay" else run_transformers)(args, doc)
    except Exception:  # what was measured before is kept, with the error
        import traceback

        doc["notes"].append("failed: " + traceback.format_exc()[-3000:])
        traceback.print_exc()
        status = 1
    doc["summary"] = (relay_summary if args.part == "relay" else transformers_summary)(doc)
    doc = common.clean_nans(doc)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-{args.part}.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(doc["summary"])
    for note in doc["notes"]:
        print(f"note: {note}")
    print(f"wrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())

"""The demo pipeline on a GPU (skipped without CUDA, failed under OMNI_REQUIRE_CUDA=1): its model
stages placed on GPU 0 give the words and the audio of the CPU run."""

from __future__ import annotations

import asyncio
import os
import wave
from importlib.resources import files

import pytest
import torch
import yaml
from conftest import arun

from omni_core import Pipeline

pytestmark = [pytest.mark.timeout(180), pytest.mark.cuda(reason="the demo's models on a GPU"),
              pytest.mark.usefixtures("no_leaks")]

MODEL_STAGES = ("audio_encoder", "image_encoder", "thinker", "talker", "vocoder")


def demo_config(gpu: int | None) -> dict:
    cfg = yaml.safe_load(files("omni_contrib_stages").joinpath("pipelines/demo.yaml").read_text())
    for stage in cfg["stages"]:
        if gpu is not None and stage["name"] in MODEL_STAGES:
            stage["gpu"] = gpu
    return cfg


def samples(path: str) -> torch.Tensor:
    with wave.open(path, "rb") as w:
        return torch.frombuffer(bytearray(w.readframes(w.getnframes())), dtype=torch.int16).to(torch.int32)


def test_the_demo_on_gpu_0_says_what_it_says_on_the_cpu(tmp_path):
    inputs = [{"text": text, "max_tokens": 9} for text in ("hello omni", "a longer prompt for the GPU", "x")]

    async def both(cfg, tag):
        async with Pipeline(cfg) as p:
            return await asyncio.gather(*(p.submit({**x, "wav_path": str(tmp_path / f"{tag}{i}.wav")}) for i, x in enumerate(inputs)))

    cpu = arun(both(demo_config(None), "cpu"), 120)
    gpu = arun(both(demo_config(0), "gpu"), 120)
    for i, (c, g) in enumerate(zip(cpu, gpu, strict=True)):
        assert g["thinker"]["token_ids"] == c["thinker"]["token_ids"], f"request {i}: other words on the GPU"
        assert g["vocoder"]["frames"] == c["vocoder"]["frames"] and g["vocoder"]["samples"] == c["vocoder"]["samples"]
        a, b = samples(g["vocoder"]["wav_path"]), samples(c["vocoder"]["wav_path"])
        assert int((a - b).abs().max()) <= 4, f"request {i}: the GPU's audio differs from the CPU's by more than rounding"
        assert os.path.getsize(g["vocoder"]["wav_path"]) > 44

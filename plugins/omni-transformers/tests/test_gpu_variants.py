"""The GPU-placed variants of the Qwen pipelines (``qwen2_5_omni.gpu``, ``qwen2_5_omni.split.gpu``, and
Qwen3-Omni's ``qwen3_omni.gpu``, ``qwen3_omni.split.gpu``):
``omni plan NAME --gpus N`` puts their stages on the GPUs, and they stay the pipelines they vary
(same stages, wiring, arguments and serve section; only placement and memory shares added)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import resources

import pytest
import yaml
from omni_core.config import collect_issues, load_config
from omni_core.plugins import load_plugins

VARIANTS = {"qwen2_5_omni.gpu": ("qwen2_5_omni_gpu.yaml", "qwen2_5_omni.yaml"),
            "qwen2_5_omni.split.gpu": ("qwen2_5_omni_split_gpu.yaml", "qwen2_5_omni_split.yaml"),
            "qwen3_omni.gpu": ("qwen3_omni_gpu.yaml", "qwen3_omni.yaml"),
            "qwen3_omni.split.gpu": ("qwen3_omni_split_gpu.yaml", "qwen3_omni_split.yaml")}


def omni_plan(name: str, *args: str) -> dict:
    env = {**os.environ, "OMNI_LOAD_PLUGINS": "transformers", "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, "-c", "from omni_core.cli import main; main()", "plan", name, "--json", *args],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def raw(file: str) -> dict:
    return yaml.safe_load(resources.files("omni_transformers").joinpath("pipelines", file).read_text())


def test_the_plugin_registers_both_variants():
    info = load_plugins(env={"OMNI_LOAD_PLUGINS": "transformers"}).info("transformers")
    assert set(VARIANTS) <= set(info.registered["pipeline"])


@pytest.mark.parametrize("name", VARIANTS)
def test_each_variant_is_its_base_pipeline_plus_placement(name):
    """Only name, placement and the stages' memory shares differ: change the base and the variant together."""
    variant_file, base_file = VARIANTS[name]
    variant, base = raw(variant_file), raw(base_file)
    assert variant.pop("name") == name
    assert variant.pop("placement") == {"strategy": "spread"}
    base.pop("name")
    shares = {stage["name"]: stage.pop("memory") for stage in variant["stages"]}
    assert all(0 < share < 1 for share in shares.values()) and sum(shares.values()) <= 1, shares
    assert variant == base, f"pipelines/{variant_file} no longer matches pipelines/{base_file} (besides placement)"
    registry = load_plugins(env={"OMNI_LOAD_PLUGINS": "transformers"}).registry
    assert collect_issues(load_config(name, registry=registry), registry) == []


def test_omni_plan_puts_the_thinker_and_the_speech_stages_on_different_gpus():
    plan = omni_plan("qwen2_5_omni.gpu", "--gpus", "2")
    gpu = {row["stage"]: row["gpu"] for row in plan["placement"]}
    assert gpu["thinker"] == gpu["processor"] == gpu["text"] == 0
    assert gpu["talker"] == gpu["token2wav"] == 1
    assert not plan["warnings"], plan["warnings"]


def test_omni_plan_of_the_split_variant_uses_every_gpu():
    plan = omni_plan("qwen2_5_omni.split.gpu", "--gpus", "2")
    gpus = [row["gpu"] for row in plan["placement"]]
    assert None not in gpus and set(gpus) == {0, 1}
    assert not plan["warnings"], plan["warnings"]


@pytest.mark.parametrize("name", VARIANTS)
def test_one_gpu_holds_every_stage_and_no_gpu_means_the_cpu(name):
    one = omni_plan(name, "--gpus", "1")
    assert {row["gpu"] for row in one["placement"]} == {0}
    assert not one["warnings"], one["warnings"]
    none = omni_plan(name, "--gpus", "0")
    assert {row["gpu"] for row in none["placement"]} == {None}


def test_the_base_pipelines_stay_on_the_cpu():
    """What the CPU-only shipped configs do with GPUs present (what the variants are for)."""
    plan = omni_plan("qwen2_5_omni", "--gpus", "2")
    assert {row["gpu"] for row in plan["placement"]} == {None}

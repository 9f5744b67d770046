"""The toy family (tests/toy_family.py): a family registered through the plugin hooks, made only
of its own parts on the kit, served end to end through a pipeline."""

from __future__ import annotations

import asyncio
import json

import attrs
import pytest
import torch
import toy_family
from omni_core import Pipeline, load_config
from omni_core.plugins import load_plugins

from omni_transformers.kit.family import family_for, installed_families


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    return toy_family.write_tiny(tmp_path_factory.mktemp("toy") / "ckpt")


@pytest.fixture(scope="module")
def registry():
    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": "transformers"}, extra=[("toy", toy_family)])
    assert plugins.info("toy").error is None
    return plugins.registry


def test_the_toy_family_is_registered_and_found_by_its_checkpoints_model_type(registry, toy_model, tiny_model,
                                                                              tmp_path):
    entry = registry.get("family", "toy")
    assert entry.meta == {"model_types": ("llama",), "pipeline": "toy"}
    assert set(installed_families(registry)) == {"toy", "qwen2_5_omni", "qwen3_omni", "whisper", "csm"}
    assert family_for(toy_model, registry) is toy_family.FAMILY
    assert family_for(tiny_model, registry).name == "qwen2_5_omni"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ValueError, match=r"no installed model family serves model_type 'mamba'; installed "
                                         r"families: .*qwen2_5_omni \(qwen2_5_omni\).*toy \(llama\)"):
        family_for(tmp_path, registry)


def test_the_toy_family_end_to_end_through_its_pipeline_equals_generate(registry, toy_model):
    from transformers import AutoTokenizer, LlamaForCausalLM

    cfg = load_config("toy", registry=registry)
    cfg = attrs.evolve(cfg, stages=[attrs.evolve(s, args={**s.args, "model": str(toy_model)}) for s in cfg.stages])
    prompts = ["hello", "a toy", "more text here", "x"]

    async def one(p, text):
        chunks, result = [], None
        async for event in p.stream({"text": text, "max_new_tokens": 6}):
            if event.is_result:
                result = event.data
            else:
                assert event.stage == "codec"
                chunks.append(event.data)
        return chunks, result

    async def go():
        async with Pipeline(cfg) as p:
            alone = [await one(p, t) for t in prompts]
            together = await asyncio.gather(*(one(p, t) for t in prompts))
        return alone, together

    alone, together = asyncio.run(asyncio.wait_for(go(), 300))
    model = LlamaForCausalLM.from_pretrained(toy_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(toy_model)
    for text, (chunks, result), (_, other) in zip(prompts, alone, together, strict=True):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        want = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
        assert result["token_ids"] == want == other["token_ids"]
        assert result["codes"] == [c for t in want for c in (t % 16, t // 16 % 16)]
        assert result["audio"].shape == (len(want) * toy_family.SAMPLES_PER_FRAME,)
        audio = [c["audio"] for c in chunks if "audio" in c]
        assert len(audio) >= 1 and torch.equal(torch.cat(audio), result["audio"])
        assert "".join(c["text"] for c in chunks if "text" in c) == result["text"]

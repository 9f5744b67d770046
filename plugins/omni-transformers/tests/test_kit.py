"""The kit on its own: it names no family, its engine registry, its typed chunks, and the private
transformers names the plugin relies on."""

from __future__ import annotations

import ast
import asyncio
import importlib
from pathlib import Path

import pytest
import torch

import omni_transformers
from omni_transformers.kit.chunks import (
    ChunkError,
    CodesChunk,
    TextChunk,
    ThinkerEnd,
    ThinkerHead,
    ThinkerStep,
    codes_chunk,
    thinker_chunk,
)
from omni_transformers.kit.engines import EngineRegistry

PACKAGE = Path(omni_transformers.__file__).parent
KIT = PACKAGE / "kit"
FAMILIES = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file() and p.name != "kit")


def test_the_kit_imports_no_family_and_names_no_qwen():
    assert "qwen2_5_omni" in FAMILIES
    for path in sorted(KIT.glob("*.py")):
        source = path.read_text()
        assert "qwen" not in source.lower(), f"{path.name} names Qwen"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else [f"{'.' * node.level}{node.module or ''}"]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith(".."), f"{path.name} imports {name} from outside the kit"
                assert not any(f in name.split(".") for f in FAMILIES), f"{path.name} imports the family {name}"


class _Engine:
    def __init__(self):
        self.closed = False

    async def close(self):
        self.closed = True


def test_engine_registry_shares_by_key_and_the_last_release_closes_and_forgets():
    async def go():
        engines = EngineRegistry()
        a = engines.acquire("k", _Engine)
        b = engines.acquire("k", _Engine)
        assert a is b and engines.holders("k") == 2 and len(engines) == 1
        await engines.release("k")
        assert not a.closed and engines.holders("k") == 1
        await engines.release("k")
        assert a.closed and len(engines) == 0
        c = engines.acquire("k", _Engine)  # a fresh engine, not the closed one
        assert c is not a and not c.closed
        await engines.release("k")
        await engines.release("k")  # one release too many changes nothing
        assert len(engines) == 0

    asyncio.run(go())


class _Ctx:
    def __init__(self):
        self.chunks = []

    async def emit(self, chunk):
        self.chunks.append(chunk)


def test_a_thinker_closed_beside_another_leaves_it_a_working_loop_and_a_new_one_gets_a_fresh_engine(tiny_model):
    from omni_transformers.qwen2_5_omni.thinker import Thinker

    engines = EngineRegistry()
    request = {"input_ids": [257, 104, 105], "max_new_tokens": 4}

    async def go():
        first = Thinker(str(tiny_model), speech=False, engines=engines)
        second = Thinker(str(tiny_model), speech=False, engines=engines)
        assert first.engine is second.engine
        alone = await first(dict(request), _Ctx())
        await first.close()
        await first.close()  # closing twice releases once
        assert await second(dict(request), _Ctx()) == alone  # the shared loop is still open
        await second.close()
        assert len(engines) == 0
        third = Thinker(str(tiny_model), speech=False, engines=engines)
        assert third.engine is not first.engine
        assert await asyncio.wait_for(third(dict(request), _Ctx()), 120) == alone
        await third.close()

    asyncio.run(asyncio.wait_for(go(), 300))


def test_chunks_round_trip_through_their_wire_mappings_and_say_what_is_wrong():
    prompt, reply = torch.zeros(3, 4), torch.ones(4)
    head = thinker_chunk(ThinkerHead(5, "a", prompt, {"text_eos": reply}).to_wire(), head_keys=("text_eos",))
    assert isinstance(head, ThinkerHead) and head.token_id == 5 and head.extra["text_eos"] is reply
    step = thinker_chunk(ThinkerStep(2, 6, "b", reply).to_wire())
    assert isinstance(step, ThinkerStep) and step.step == 2 and step.reply is reply
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "finish_reason": "stop"}
    end = thinker_chunk(ThinkerEnd("!", usage).to_wire())
    assert isinstance(end, ThinkerEnd) and end.usage == usage
    assert TextChunk.from_wire(TextChunk("hi", [1], usage).to_wire()) == TextChunk("hi", [1], usage)
    frames = CodesChunk([1, 2, 3, 4, 5, 6], codebooks=3, final=True, rng_state=b"x")
    assert codes_chunk(frames.to_wire()) == frames and frames.frames == [[1, 2, 3], [4, 5, 6]]
    assert CodesChunk([7, 8]).to_wire() == {"codes": [7, 8]}  # one codebook: the version-1 mapping
    with pytest.raises(ChunkError, match="whole frames of 4"):
        CodesChunk([1, 2, 3], codebooks=4)
    with pytest.raises(ChunkError, match="no 'reply'"):
        thinker_chunk({"step": 1, "token_id": 1, "text": ""})


# Every private name of transformers the plugin uses: (module, attribute path, where it is used).
PRIVATE_NAMES = [
    ("transformers.models.qwen2_5_omni.modeling_qwen2_5_omni", "RungeKutta4ODESolver", "qwen2_5_omni/token2wav.py"),
    ("transformers.models.qwen2_5_omni.modeling_qwen2_5_omni",
     "Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths", "qwen2_5_omni/encoders.py"),
    ("transformers.integrations.sdpa_attention", "sdpa_attention_forward", "kit/batched.py"),
    ("transformers.masking_utils", "sdpa_mask", "kit/batched.py"),
    ("transformers.masking_utils", "AttentionMaskInterface.register", "kit/batched.py"),
    ("transformers.modeling_utils", "AttentionInterface.register", "kit/batched.py"),
    ("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl", "Qwen2VLImageProcessorPil",
     "qwen2_5_omni/processor.py"),
    ("transformers.cache_utils", "DynamicCache.crop", "kit/batched.py"),
]


@pytest.mark.parametrize("module, attr, where", PRIVATE_NAMES, ids=[f"{m}:{a}" for m, a, _ in PRIVATE_NAMES])
def test_the_private_transformers_names_the_plugin_uses_are_where_it_expects(module, attr, where):
    import transformers

    obj = importlib.import_module(module)
    for part in attr.split("."):
        assert hasattr(obj, part), (f"transformers {transformers.__version__} moved {module}.{attr}, which "
                                    f"omni_transformers/{where} uses: find its new home and update that file")
        obj = getattr(obj, part)


def test_the_private_attributes_of_instances_the_plugin_uses_are_there(tiny_model):
    """``config._attn_implementation`` (kit/batched.py), ``tokenizer._tokenizer.decode``
    (kit/sampling.py's TextDecoder), a DynamicCache's ``layers[i].keys/.values`` (kit/batched.py)."""
    from transformers import AutoTokenizer, DynamicCache, LlamaConfig

    config = LlamaConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    assert config._attn_implementation in (None, "sdpa", "eager"), "config._attn_implementation moved"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert callable(getattr(getattr(tokenizer, "_tokenizer", None), "decode", None)), "tokenizer._tokenizer moved"
    cache = DynamicCache(config=config)
    cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)
    layer = cache.layers[0]
    assert layer.keys.shape == (1, 2, 1, 4) and layer.values.shape == (1, 2, 1, 4), "DynamicCache layers moved"


def test_a_requests_sampling_is_checked_and_laid_over_the_stages():
    from omni_core import InvalidInput

    from omni_transformers.kit.sampling import request_sampling, sampling_for

    stage = {"do_sample": False, "temperature": 0.7, "top_k": 50, "top_p": 0.8}
    assert sampling_for(request_sampling({"text": "hi"}), **stage) == stage
    assert sampling_for(request_sampling({"temperature": 0}), **stage) == {
        "do_sample": False, "temperature": None, "top_k": 50, "top_p": 0.8}
    assert sampling_for(request_sampling({"temperature": 2}), **stage) == {
        "do_sample": True, "temperature": 2.0, "top_k": 50, "top_p": 0.8}
    assert sampling_for(request_sampling({"top_p": 0.5, "top_k": 3}), **stage) == {
        "do_sample": True, "temperature": 0.7, "top_k": 3, "top_p": 0.5}
    for bad in ({"temperature": -1}, {"temperature": "hot"}, {"temperature": True}, {"top_p": 0},
                {"top_p": 1.5}, {"top_k": -1}, {"top_k": 2.5}, {"temperature": float("nan")}):
        with pytest.raises(InvalidInput) as caught:
            request_sampling(bad)
        assert caught.value.field == next(iter(bad))

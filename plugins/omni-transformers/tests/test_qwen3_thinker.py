"""The qwen3_omni family's MoE thinker on the kit (text prompts): its tokens equal transformers'
``model.thinker.generate`` (greedy), 16 requests at once each get what they get alone, and the ``qwen3_omni``
pipeline answers through ``omni run`` on a checkpoint folder."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from omni_core.errors import InvalidInput
from omni_core.testing.leaks import no_leaks  # noqa: F401 - a fixture

from omni_transformers.qwen3_omni import tiny

pytestmark = [pytest.mark.timeout(600)]

PROMPTS = ["Hello there, say something.", "What is up?", "Tell me a story", "hi", "Describe Paris.",
           "Why is the sky blue?", "Count to five", "A haiku, please", "ok", "Name three colours.",
           "What time is it?", "Say yes", "Spell omni", "Good morning!", "Help me", "Bye"]


class Ctx:
    """What a stage call needs of its context: emit, here into a list."""

    def __init__(self):
        self.chunks: list = []

    async def emit(self, chunk):
        self.chunks.append(chunk)


@pytest.fixture(scope="module")
def qwen3_tiny(tmp_path_factory):
    return tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_omni_tiny") / "ckpt")


@pytest.fixture(scope="module")
def stages(qwen3_tiny):
    from omni_transformers.qwen3_omni.processor import Processor
    from omni_transformers.qwen3_omni.thinker import Thinker

    thinker = Thinker(str(qwen3_tiny), max_new_tokens=16)
    yield Processor(str(qwen3_tiny)), thinker
    asyncio.run(thinker.close())


def reference(qwen3_tiny, ids_list, max_new):
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(qwen3_tiny)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_tiny).eval()
    out = []
    for ids in ids_list:
        seq = model.thinker.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     eos_token_id=tok.eos_token_id, do_sample=False, max_new_tokens=max_new)
        out.append(seq[0, len(ids):].tolist())
    return out


def test_thinker_tokens_equal_generate_and_16_at_once_equal_alone(qwen3_tiny, stages):
    processor, thinker = stages
    inputs = [processor({"text": text, "max_new_tokens": 16}, None) for text in PROMPTS]
    assert inputs[0]["input_ids"][-3:] == [tiny.SPECIAL["<|im_start|>"], tiny.ROLE["assistant"], 10]
    expected = reference(qwen3_tiny, [p["input_ids"] for p in inputs], 16)

    async def go():
        alone = [await thinker(dict(p), Ctx()) for p in inputs]
        together = await asyncio.gather(*(thinker(dict(p), Ctx()) for p in inputs))
        return alone, together

    alone, together = asyncio.run(go())
    # Alone (batch 1) as generate; together each row as alone (these prompts' greedy margins are safe: random
    # weights leave some at 1e-5, where another matmul shape could flip a pick).
    assert [r["token_ids"] for r in alone] == expected
    assert [r["token_ids"] for r in together] == [r["token_ids"] for r in alone]
    for result, p in zip(alone, inputs, strict=True):
        assert result["prompt_tokens"] == len(p["input_ids"])
        assert result["completion_tokens"] == len(result["token_ids"])


def test_the_processor_refuses_video_parts_naming_them(stages):
    processor, _ = stages
    with pytest.raises(InvalidInput, match="videos are not supported") as refused:
        processor({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                             {"type": "video", "video": "c.mp4"}]}]}, None)
    assert refused.value.field == "messages[0].content[1]"


def test_omni_run_on_the_checkpoint_folder_answers_with_the_thinkers_text(qwen3_tiny, stages):
    processor, thinker = stages
    exe = shutil.which("omni")
    assert exe, "the omni console script is not installed"
    env = {k: v for k, v in os.environ.items() if k != "OMNI_TRANSFORMERS_MODEL"}  # the folder picks the family
    out = subprocess.run([exe, "run", str(qwen3_tiny), "--input",
                          json.dumps({"text": "Hello there, say something.", "max_new_tokens": 12})],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    alone = asyncio.run(thinker(processor({"text": "Hello there, say something.", "max_new_tokens": 12}, None),
                                Ctx()))
    assert result["token_ids"] == alone["token_ids"]
    assert result["text"] == alone["text"]


def test_the_tiny_command_writes_the_family_checkpoint(tmp_path):
    out = subprocess.run([sys.executable, "-m", "omni_transformers.tiny", str(tmp_path / "q3"), "--family",
                          "qwen3_omni", "--seed", "3"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "q3")
    assert json.loads((tmp_path / "q3" / "config.json").read_text())["model_type"] == "qwen3_omni_moe"


@pytest.mark.usefixtures("no_leaks")
def test_omni_serve_on_the_checkpoint_folder_answers_the_openai_sdk_with_text(qwen3_tiny, stages, tmp_path):
    import openai
    from omni_core.testing.serve import ServerProcess

    processor, thinker = stages
    prompt = "Hello there, say something."
    alone = asyncio.run(thinker(processor({"text": prompt, "max_new_tokens": 12}, None), Ctx()))
    srv = ServerProcess(str(qwen3_tiny), env={"OMNI_TRANSFORMERS_MODEL": ""}, cwd=str(tmp_path), ready_timeout=300)
    with srv.serving(stop_timeout=120):
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["qwen3_omni"]
        messages = [{"role": "user", "content": prompt}]
        reply = client.chat.completions.create(model="qwen3_omni", messages=messages, max_tokens=12, temperature=0)
        assert reply.choices[0].message.content == alone["text"]
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (alone["prompt_tokens"], 12)
        stream = client.chat.completions.create(model="qwen3_omni", messages=messages, max_tokens=12, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == alone["text"]

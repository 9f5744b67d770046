"""What the plugin registers, the tiny checkpoint, and the per-request helpers (no stage processes)."""

from __future__ import annotations

import pytest
import torch
from omni_core.config import collect_issues, load_config
from omni_core.plugins import load_plugins

STAGES = ["processor", "audio_encoder", "vision_encoder", "thinker", "talker", "token2wav"]
# The pipelines' stages: the registered ones, and "text" (a thinker without speech) for text-only requests.
PIPELINE_STAGES = ["processor", "audio_encoder", "vision_encoder", "thinker", "text", "talker", "token2wav"]


def registry():
    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": "transformers"})
    assert plugins.info("transformers").error is None
    return plugins.registry


def test_the_plugin_registers_its_stages_wiring_functions_and_two_pipelines():
    info = load_plugins(env={"OMNI_LOAD_PLUGINS": "transformers"}).info("transformers")
    assert info.registered["stage"] == [f"transformers.qwen2_5_omni.{s}" for s in STAGES] + [
        "transformers.qwen3_omni.processor", "transformers.qwen3_omni.audio_encoder",
        "transformers.qwen3_omni.vision_encoder", "transformers.qwen3_omni.thinker", "transformers.qwen3_omni.talker",
        "transformers.qwen3_omni.code2wav", "transformers.whisper.asr",
        "transformers.csm.processor", "transformers.csm.talker", "transformers.csm.vocoder"]
    assert info.registered["pipeline"] == ["qwen2_5_omni", "qwen2_5_omni.split", "qwen2_5_omni.gpu",
                                           "qwen2_5_omni.split.gpu", "qwen3_omni", "qwen3_omni.split",
                                           "qwen3_omni.gpu", "qwen3_omni.split.gpu", "whisper", "csm"]
    assert info.registered["route"] == [f"transformers.qwen2_5_omni.{f}"
                                        for f in ("no_payload", "route_encoded", "route_inputs")] + [
                                            "transformers.qwen3_omni.route_inputs"]
    assert info.registered["terminal_stages"] == ["transformers.qwen2_5_omni.terminal_stages",
                                                  "transformers.qwen3_omni.terminal_stages"]


@pytest.mark.parametrize("name, processes", [("qwen2_5_omni", 3), ("qwen2_5_omni.split", 6)])
def test_shipped_pipelines_are_valid(name, processes):
    reg = registry()
    cfg = load_config(name, registry=reg)
    assert collect_issues(cfg, reg) == []
    assert [s.name for s in cfg.stages] == PIPELINE_STAGES
    assert cfg.terminal_stages == ["text", "token2wav"]
    assert cfg.terminal_stages_fn == "transformers.qwen2_5_omni.terminal_stages"
    assert len({s.process or s.name for s in cfg.stages}) == processes
    if name == "qwen2_5_omni":
        by_name = {s.name: s for s in cfg.stages}
        # thinker, talker and token2wav each in a process of their own (docs/models.md: beside the
        # talker, token2wav's DiT held the interpreter the talker's steps need)
        assert len({by_name[n].process for n in ("thinker", "talker", "token2wav")}) == 3
    by_name = {s.name: s for s in cfg.stages}
    assert by_name["text"].process == by_name["thinker"].process  # one model and decode loop for both
    assert cfg.launcher.options["preload"] == ["omni_transformers.preload"]


def test_the_tiny_checkpoint_loads_with_transformers_own_classes(tiny_model):
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_model)
    assert "Chelsie" in model.speaker_map
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok("hello é")["input_ids"]
    assert tok.decode(ids) == "hello é"
    spk = torch.load(tiny_model / "spk_dict.pt", weights_only=True)
    assert set(spk["Chelsie"]) == {"bos_token", "cond", "ref_mel"}


def test_every_special_token_of_the_tiny_tokenizer_is_one_id(tiny_model):
    from transformers import AutoTokenizer

    from omni_transformers.tiny import SPECIAL, TOKENIZER_SPECIAL_NAMES

    tok = AutoTokenizer.from_pretrained(tiny_model)
    for token, token_id in SPECIAL.items():
        assert tok(token, add_special_tokens=False)["input_ids"] == [token_id], token
    for name, token in TOKENIZER_SPECIAL_NAMES.items():
        assert getattr(tok, name) == token
    # The chat template's turns are the real tokenizer's: one id per turn marker, dropped when decoding.
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    ids = tok(ids, add_special_tokens=False)["input_ids"]
    assert ids.count(SPECIAL["<|im_start|>"]) == 2 and ids.count(SPECIAL["<|im_end|>"]) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\nassistant\n"


def test_tiny_is_a_module_with_a_command_line(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "omni_transformers.tiny", str(tmp_path / "m")],
                         capture_output=True, text=True, timeout=240, check=True)
    assert out.stdout.strip() == str(tmp_path / "m")
    assert {"config.json", "model.safetensors", "tokenizer.json", "spk_dict.pt"} <= {
        p.name for p in (tmp_path / "m").iterdir()}


def test_each_part_loads_alone_from_the_whole_checkpoint(tiny_model):
    from transformers import Qwen2_5OmniForConditionalGeneration

    from omni_transformers.qwen2_5_omni.parts import load_part

    whole = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_model)
    for part in ("thinker", "talker", "token2wav"):
        mine = load_part(tiny_model, part).state_dict()
        theirs = getattr(whole, part).state_dict()
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_a_missing_checkpoint_says_what_to_do(monkeypatch, tmp_path):
    from omni_transformers.kit.sampling import resolve_model_path

    monkeypatch.delenv("OMNI_TRANSFORMERS_MODEL", raising=False)
    with pytest.raises(ValueError, match="OMNI_TRANSFORMERS_MODEL"):
        resolve_model_path(None)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(tmp_path)


def test_the_sampler_draws_from_its_own_generator_like_the_global_rng():
    from omni_transformers.kit.sampling import Sampler, make_generator

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(5))
    seq = torch.tensor([[1, 2, 3]])
    mine = [Sampler(do_sample=True, top_k=10, generator=make_generator(7))(seq, logits) for _ in range(3)]
    assert mine[0] == mine[1] == mine[2]
    torch.manual_seed(7)
    scores = torch.where(logits < torch.topk(logits, 10)[0][..., -1, None], float("-inf"), logits)
    assert int(torch.multinomial(torch.softmax(scores, -1), 1)[0, 0]) == mine[0]
    assert Sampler(do_sample=False)(seq, logits) == int(logits.argmax())


def test_incremental_text_never_splits_a_character(tiny_model):
    from transformers import AutoTokenizer

    from omni_transformers.kit.sampling import TextDecoder

    tok = AutoTokenizer.from_pretrained(tiny_model)
    decoder = TextDecoder(tok)
    ids = tok("hé!")["input_ids"]
    deltas = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert deltas == ["h", "", "é", "!", ""]

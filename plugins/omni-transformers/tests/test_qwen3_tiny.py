"""The tiny Qwen3-Omni checkpoint (``python -m omni_transformers.tiny DIR --family qwen3_omni``): the real
checkpoint's file layout and codec ids, loaded by transformers' own ``Qwen3OmniMoeForConditionalGeneration``
whose ``generate(return_audio=True)`` runs end to end with an audible waveform."""

from __future__ import annotations

import json

import pytest
import torch

from omni_transformers.qwen3_omni import tiny


@pytest.fixture(scope="module")
def qwen3_tiny(tmp_path_factory):
    return tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_omni_tiny") / "ckpt")


@pytest.fixture(scope="module")
def model(qwen3_tiny):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_tiny).eval()


def test_the_checkpoint_has_the_real_file_layout_and_codec_ids(qwen3_tiny):
    names = {p.name for p in qwen3_tiny.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "preprocessor_config.json"} <= names
    assert not any(name.startswith("omni") or name.endswith(".pt") for name in names)  # nothing omni-specific
    config = json.loads((qwen3_tiny / "config.json").read_text())
    assert config["model_type"] == "qwen3_omni_moe"
    talker = config["talker_config"]
    assert (talker["codec_pad_id"], talker["codec_bos_id"], talker["codec_eos_token_id"]) == (2148, 2149, 2150)
    assert (talker["codec_nothink_id"], talker["codec_think_bos_id"], talker["codec_think_eos_id"]) == (
        2155, 2156, 2157)
    assert talker["speaker_id"] == {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
    assert talker["num_code_groups"] == 16 and talker["code_predictor_config"]["vocab_size"] == 2048
    code2wav = config["code2wav_config"]
    assert (code2wav["num_quantizers"], code2wav["codebook_size"], code2wav["sliding_window"]) == (16, 2048, 72)
    assert config["thinker_config"]["text_config"]["num_experts"] == 4
    assert config["thinker_config"]["text_config"]["num_hidden_layers"] == 3


def test_the_tokenizer_renders_the_chat_format_with_one_token_per_special_and_role(qwen3_tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_tiny)
    messages = [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}, {"type": "image", "image": "b.png"},
                                             {"type": "text", "text": "hi"}]}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    s, r = tiny.SPECIAL, tiny.ROLE
    assert ids == [s["<|im_start|>"], r["user"], 10, s["<|audio_start|>"], s["<|audio_pad|>"], s["<|audio_end|>"],
                   s["<|vision_start|>"], s["<|image_pad|>"], s["<|vision_end|>"], ord("h"), ord("i"),
                   s["<|im_end|>"], 10, s["<|im_start|>"], r["assistant"], 10]
    assert tok.decode(ids[-3:]) == "<|im_start|>assistant\n"
    assert (tok.audio_token, tok.image_token, tok.vision_bos_token) == ("<|audio_pad|>", "<|image_pad|>",
                                                                         "<|vision_start|>")


def test_the_talker_moe_and_code2wav_are_initialised(model):
    for layer in model.talker.model.layers:
        for weight in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj, layer.mlp.gate.weight):
            assert torch.isfinite(weight).all()
            assert 0.01 < weight.std().item() < 0.03  # drawn, neither left empty nor all zero
    assert model.code2wav.code_embedding.weight.std().item() > 0.5


def test_generate_with_audio_runs_end_to_end(qwen3_tiny, model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_tiny)
    inputs = tok.apply_chat_template([{"role": "user", "content": "Hello there, say something."}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    frames = []
    hook = model.code2wav.register_forward_pre_hook(lambda module, args: frames.append(args[0].shape[-1]))
    try:
        sequences, wav = model.generate(**inputs, return_audio=True, thinker_eos_token_id=tok.eos_token_id,
                                        thinker_max_new_tokens=12, talker_do_sample=False, speaker="aiden",
                                        talker_max_new_tokens=24)
    finally:
        hook.remove()
    assert sequences.shape[1] > inputs["input_ids"].shape[1]
    assert frames and frames[0] > 0
    # one decode of n frames: 1920 samples a frame, less the 555 its transposed convs wait for the next frame
    assert wav.shape[-1] == frames[0] * 1920 - 555
    assert torch.isfinite(wav).all() and wav.abs().max().item() > 0.01  # audible, not ~1e-7


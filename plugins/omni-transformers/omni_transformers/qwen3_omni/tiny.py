"""Write a tiny random Qwen3-Omni checkpoint (``python -m omni_transformers.tiny DIR --family qwen3_omni``).

The checkpoint has the real checkpoint's file layout: ``config.json`` (``model_type`` ``qwen3_omni_moe``: MoE
thinker with audio and vision towers, MoE talker with its code predictor, code2wav) and ``model.safetensors``
written by transformers' own ``save_pretrained``, a byte-level tokenizer with the real special tokens and a chat
template, ``chat_template.jinja`` and ``preprocessor_config.json``. Nothing in it is specific to omni. The codec
ids are the real checkpoint's (pad 2148, bos 2149, eos 2150, nothink 2155, think 2156/2157; speakers chelsie
2301, ethan 2302, aiden 2303 in the talker config, no speaker file); 16 codebooks of 2048 codes; code2wav makes
1920 samples per frame at 24 kHz (12.5 frames/s) with a sliding window of 72 frames. Its weights are random
(seeded), so its text and speech are noise: it exists for tests, CI and a CPU demo.

transformers' random init leaves the talker's MoE experts as uninitialised memory and its routers all zero, and
its 0.02-std init shrinks code2wav's waveform to ~1e-7: the writer initialises both itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..kit.tiny import byte_tokenizer

# Token ids of the tiny vocabulary: 256 byte tokens, the real checkpoint's special tokens, then the chat roles
# (one token each, as in the real vocabulary: the talker finds a turn's role right after <|im_start|>).
SPECIAL_TOKENS = [
    "<|endoftext|>",  # 256
    "<|im_start|>",  # 257
    "<|im_end|>",  # 258
    "<|audio_start|>",  # 259
    "<|audio_end|>",  # 260
    "<|audio_pad|>",  # 261
    "<|vision_start|>",  # 262
    "<|vision_end|>",  # 263
    "<|image_pad|>",  # 264
    "<|video_pad|>",  # 265
    "<tts_pad>",  # 266
    "<tts_text_bos>",  # 267
    "<tts_text_eod>",  # 268
    "<tts_text_bos_single>",  # 269
]
SPECIAL = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}
ROLES = ["system", "user", "assistant"]
ROLE = {role: 256 + len(SPECIAL_TOKENS) + i for i, role in enumerate(ROLES)}  # 270, 271, 272
TEXT_VOCAB = 288
SAMPLE_RATE = 24000

# The real checkpoint's codec ids (talker vocabulary 3072: codes 0..2047, specials above).
CODEC_VOCAB = 3072
CODEBOOK_SIZE = 2048
NUM_CODE_GROUPS = 16
CODEC_PAD, CODEC_BOS, CODEC_EOS = 2148, 2149, 2150
CODEC_NOTHINK, CODEC_THINK_BOS, CODEC_THINK_EOS = 2155, 2156, 2157
SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
# Random weights almost never pick one token out of thousands: the end-of-text and end-of-codes rows of the
# output heads are scaled so that a reply ends after some tens of steps (and its speech after some seconds).
THINKER_EOS_SCALE = 3.0
TALKER_EOS_SCALE = 2.0
# code2wav's weights are drawn as PyTorch's own layer init would (not 0.02-std), so the waveform is audible.
CODE_EMBEDDING_STD = 1.0

# Renders content parts as the real checkpoint's template does: an audio part is
# <|audio_start|><|audio_pad|><|audio_end|>, an image part <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' or 'audio' in part %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# What the tokenizer calls its special tokens (Qwen3OmniMoeProcessor reads tokenizer.audio_token ...).
TOKENIZER_SPECIAL_NAMES = {
    "audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}
# preprocessor_config.json: the real checkpoint's feature extractor and image processor settings, scaled down
# (16 mel bins as the tiny audio tower takes, audio up to 10 s, images up to 128 x 128).
AUDIO_SECONDS = 10
PREPROCESSOR_CONFIG = {
    "processor_class": "Qwen3OmniMoeProcessor",
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 16, "sampling_rate": 16000, "hop_length": 160, "chunk_length": AUDIO_SECONDS, "n_fft": 400,
    "n_samples": AUDIO_SECONDS * 16000, "nb_max_frames": AUDIO_SECONDS * 100, "padding_side": "right",
    "padding_value": 0.0, "dither": 0.0, "return_attention_mask": True,
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True, "do_convert_rgb": True,
    "resample": 3, "min_pixels": 64 * 64, "max_pixels": 128 * 128,
    "size": {"shortest_edge": 64 * 64, "longest_edge": 128 * 128},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
}


def tiny_config():
    """The ``Qwen3OmniMoeConfig`` of the tiny checkpoint."""
    from transformers import Qwen3OmniMoeConfig

    hidden = 32
    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 1, 1], "interleaved": True,
             "mrope_interleaved": True}
    media = {
        "audio_token_id": SPECIAL["<|audio_pad|>"],
        "image_token_id": SPECIAL["<|image_pad|>"],
        "video_token_id": SPECIAL["<|video_pad|>"],
        "audio_start_token_id": SPECIAL["<|audio_start|>"],
        "audio_end_token_id": SPECIAL["<|audio_end|>"],
        "vision_start_token_id": SPECIAL["<|vision_start|>"],
        "vision_end_token_id": SPECIAL["<|vision_end|>"],
        "position_id_per_seconds": 13,
    }
    thinker = {
        **media,
        "user_token_id": ROLE["user"],
        "audio_config": {
            "num_mel_bins": 16, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 32,
            "d_model": 16, "output_dim": hidden, "max_source_positions": 1500, "n_window": 50,
            "n_window_infer": 400, "conv_chunksize": 500, "downsample_hidden_size": 8,
        },
        "vision_config": {
            "depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": hidden,
            "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1],
        },
        "text_config": {
            "vocab_size": TEXT_VOCAB, "hidden_size": hidden, "intermediate_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 4096,
            "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "rope_parameters": mrope, "eos_token_id": SPECIAL["<|im_end|>"],
            "pad_token_id": SPECIAL["<|endoftext|>"], "tie_word_embeddings": False,
        },
    }
    talker = {
        **media,
        "spatial_merge_size": 2,  # as the real talker config (the talker's M-RoPE positions of an image)
        "thinker_hidden_size": hidden,
        "num_code_groups": NUM_CODE_GROUPS,
        "accept_hidden_layer": 2,
        "codec_eos_token_id": CODEC_EOS,
        "codec_nothink_id": CODEC_NOTHINK,
        "codec_think_bos_id": CODEC_THINK_BOS,
        "codec_think_eos_id": CODEC_THINK_EOS,
        "codec_pad_id": CODEC_PAD,
        "codec_bos_id": CODEC_BOS,
        "speaker_id": dict(SPEAKERS),
        "text_config": {
            "vocab_size": CODEC_VOCAB, "hidden_size": hidden, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 4096,
            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "num_experts": 4,
            "num_experts_per_tok": 2, "norm_topk_prob": False, "rope_parameters": mrope,
        },
        "code_predictor_config": {
            "vocab_size": CODEBOOK_SIZE, "hidden_size": hidden, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_code_groups": NUM_CODE_GROUPS,
            "max_position_embeddings": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    }
    # 1920 samples per frame (8 * 5 * 4 * 3 * 2 * 2) at 24 kHz: 12.5 frames a second, as the real code2wav.
    code2wav = {
        "codebook_size": CODEBOOK_SIZE, "num_quantizers": NUM_CODE_GROUPS, "hidden_size": 16,
        "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 32, "num_hidden_layers": 2,
        "sliding_window": 72, "max_position_embeddings": 8000, "decoder_dim": 32,
        "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav, enable_audio_output=True,
        im_start_token_id=SPECIAL["<|im_start|>"], im_end_token_id=SPECIAL["<|im_end|>"],
        tts_pad_token_id=SPECIAL["<tts_pad>"], tts_bos_token_id=SPECIAL["<tts_text_bos>"],
        tts_eos_token_id=SPECIAL["<tts_text_eod>"], system_token_id=ROLE["system"], user_token_id=ROLE["user"],
        assistant_token_id=ROLE["assistant"],
    )


def tiny_tokenizer():
    """A byte-level tokenizer over the tiny vocabulary (the chat roles one token each), with a chat template."""
    return byte_tokenizer(SPECIAL, TOKENIZER_SPECIAL_NAMES, CHAT_TEMPLATE, words=ROLE)


def _init_talker_moe(model, generator, std: float) -> None:
    """Draw the talker's MoE experts and routers (transformers' init leaves them empty and zero)."""
    import torch

    for layer in model.talker.model.layers:
        mlp = layer.mlp
        for weight in (mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.weight):
            weight.copy_(torch.randn(weight.shape, generator=generator, device=generator.device) * std)


def _init_code2wav(model, generator) -> None:
    """Draw code2wav's weights as PyTorch's layer init would, so that its waveform is audible."""
    import math

    import torch

    code2wav = model.code2wav
    device = generator.device
    for module in code2wav.modules():
        if isinstance(module, torch.nn.Conv1d | torch.nn.ConvTranspose1d | torch.nn.Linear):
            fan_in = module.weight.shape[1] * (module.weight[0, 0].numel() if module.weight.dim() > 2 else 1)
            if isinstance(module, torch.nn.ConvTranspose1d):
                fan_in = module.weight.shape[0] * module.weight.shape[2]
            bound = 1 / math.sqrt(fan_in)
            module.weight.copy_((torch.rand(module.weight.shape, generator=generator, device=device) * 2 - 1) * bound)
            if module.bias is not None:
                module.bias.copy_((torch.rand(module.bias.shape, generator=generator, device=device) * 2 - 1) * bound)
    emb = code2wav.code_embedding.weight
    emb.copy_(torch.randn(emb.shape, generator=generator, device=device) * CODE_EMBEDDING_STD)


def random_model(config=None, *, seed: int = 0, device: str = "cpu", dtype: str | None = None):
    """A random ``Qwen3OmniMoeForConditionalGeneration`` of ``config`` (default: the tiny one, :func:`tiny_config`),
    built on ``device`` and initialised as the tiny checkpoint is (the talker's experts and routers, code2wav, the
    end rows of the heads), then cast to ``dtype`` (None: float32). A larger ``config`` gives a random checkpoint of
    realistic size (the GPU test writes one)."""
    import torch
    import transformers
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from ..kit.sampling import torch_dtype

    transformers.logging.set_verbosity_error()
    config = tiny_config() if config is None else config
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    g = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        _init_talker_moe(model, g, config.talker_config.initializer_range)
        _init_code2wav(model, g)
        model.thinker.lm_head.weight[SPECIAL["<|im_end|>"]] *= THINKER_EOS_SCALE
        model.talker.codec_head.weight[CODEC_EOS] *= TALKER_EOS_SCALE
    want = torch_dtype(dtype)
    return model if want is None else model.to(want)


def save_checkpoint(model, path) -> Path:
    """Write ``model`` (a ``Qwen3OmniMoeForConditionalGeneration`` over the tiny vocabulary's ids) to ``path``
    (created if missing) as the real checkpoint's file layout: its weights and config by ``save_pretrained``, the
    tiny tokenizer, ``chat_template.jinja`` and ``preprocessor_config.json``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    return path


def write_tiny_checkpoint(path, *, seed: int = 0) -> Path:
    """Write the tiny checkpoint to ``path`` (created if missing) and return it."""
    return save_checkpoint(random_model(seed=seed), path)

"""Write a tiny random Qwen2.5-Omni checkpoint (``python -m omni_transformers.tiny DIR``).

The checkpoint has the real model's layout (thinker, talker, token2wav in one
``Qwen2_5OmniForConditionalGeneration``, a tokenizer, ``spk_dict.pt`` with the speaker
``Chelsie``) at a size that loads and generates on a CPU in well under a second. Its weights
are random (seeded), so its text and speech are noise: it exists for tests, CI and a CPU demo.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..kit.tiny import byte_tokenizer

# Token ids of the tiny vocabulary: 256 byte tokens first, then the special tokens.
SPECIAL_TOKENS = [
    "<|endoftext|>",  # 256
    "<|im_start|>",  # 257
    "<|im_end|>",  # 258
    "<|AUDIO|>",  # 259
    "<|audio_bos|>",  # 260
    "<|audio_eos|>",  # 261
    "<|IMAGE|>",  # 262
    "<|VIDEO|>",  # 263
    "<|vision_bos|>",  # 264
    "<|vision_eos|>",  # 265
    "<tts_pad>",  # 266
    "<tts_text_bos>",  # 267
    "<tts_text_eod>",  # 268
    "<tts_text_bos_single>",  # 269
]
SPECIAL = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}
TEXT_VOCAB = 288
# The real checkpoint's codec ids, so generate's default talker_eos_token_id ([8292, 8294]) holds.
CODEC_VOCAB = 8448
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 8292, 8293, 8294, 8296
# Random weights almost never pick one token out of thousands: the end-of-text and end-of-codes
# rows of the output heads are scaled so that a reply ends after some tens of steps.
THINKER_EOS_SCALE = 1.7
TALKER_EOS_SCALE = 2.4
# At random init the DiT's attention barely couples mel frames (a change reaches 1e-7 one block away), so
# chunked synthesis would be exact for free; these scales make a frame feel its neighbour blocks (1e-3
# one block away, 1e-5 two), as a trained DiT does, so streamed token2wav is tested against real context.
DIT_VALUE_SCALE = 30.0
DIT_GATE_SCALE = 10.0
SAMPLE_RATE = 24000

# Renders content parts as the real checkpoint's template does: an audio part is
# <|audio_bos|><|AUDIO|><|audio_eos|>, an image part <|vision_bos|><|IMAGE|><|vision_eos|>, a text part its text.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' or 'audio' in part %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif part['type'] == 'image' or 'image' in part %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# What the tokenizer calls its special tokens (Qwen2_5OmniProcessor reads tokenizer.audio_token ...).
TOKENIZER_SPECIAL_NAMES = {
    "audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
    "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
}
# preprocessor_config.json: the real checkpoint's feature extractor and image processor settings,
# scaled down (16 mel bins as the tiny audio tower takes, audio up to 10 s, images up to 112 x 112).
AUDIO_SECONDS = 10
PREPROCESSOR_CONFIG = {
    "processor_class": "Qwen2_5OmniProcessor",
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 16, "sampling_rate": 16000, "hop_length": 160, "chunk_length": AUDIO_SECONDS, "n_fft": 400,
    "n_samples": AUDIO_SECONDS * 16000, "nb_max_frames": AUDIO_SECONDS * 100, "padding_side": "right",
    "padding_value": 0.0, "dither": 0.0, "return_attention_mask": True,
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True, "do_convert_rgb": True,
    "resample": 3, "min_pixels": 56 * 56, "max_pixels": 112 * 112,
    "size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112},
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
}


def tiny_config():
    """The ``Qwen2_5OmniConfig`` of the tiny checkpoint."""
    from transformers import Qwen2_5OmniConfig

    hidden = 32
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    specials = {
        "audio_token_index": SPECIAL["<|AUDIO|>"],
        "image_token_index": SPECIAL["<|IMAGE|>"],
        "video_token_index": SPECIAL["<|VIDEO|>"],
        "audio_start_token_id": SPECIAL["<|audio_bos|>"],
        "audio_end_token_id": SPECIAL["<|audio_eos|>"],
    }
    thinker = {
        **specials,
        "user_token_id": ord("u"),
        "vision_start_token_id": SPECIAL["<|vision_bos|>"],
        "vision_end_token_id": SPECIAL["<|vision_eos|>"],
        "audio_config": {
            "num_mel_bins": 16, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 32,
            "d_model": 16, "output_dim": hidden, "max_source_positions": 64, "n_window": 8,
        },
        "vision_config": {
            "depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": hidden,
            "fullatt_block_indexes": [1], "window_size": 56, "patch_size": 14, "temporal_patch_size": 2,
        },
        "text_config": {
            "vocab_size": TEXT_VOCAB, "hidden_size": hidden, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "rope_parameters": mrope, "eos_token_id": SPECIAL["<|im_end|>"],
            "pad_token_id": SPECIAL["<|endoftext|>"], "tie_word_embeddings": False,
        },
    }
    talker = {
        **specials,
        "vocab_size": CODEC_VOCAB,
        "tts_text_start_token_id": SPECIAL["<tts_text_bos>"],
        "tts_text_end_token_id": SPECIAL["<tts_text_eod>"],
        "tts_text_pad_token_id": SPECIAL["<tts_pad>"],
        "tts_codec_start_token_id": CODEC_BOS,
        "tts_codec_end_token_id": CODEC_EOS,
        "tts_codec_pad_token_id": CODEC_PAD,
        "tts_codec_mask_token_id": CODEC_MASK,
        "vision_start_token_id": SPECIAL["<|vision_bos|>"],
        "vision_end_token_id": SPECIAL["<|vision_eos|>"],
        "embedding_size": hidden, "hidden_size": 24, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 12, "max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]},
    }
    # num_embeds covers the whole codec vocabulary: every code a random talker picks has a DiT embedding.
    token2wav = {
        "dit_config": {
            "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 16, "ff_mult": 2,
            "emb_dim": 16, "block_size": 8, "look_ahead_layers": [1], "look_backward_layers": [0],
            "repeats": 2, "num_embeds": CODEC_VOCAB, "mel_dim": 8, "enc_emb_dim": 16, "enc_dim": 16,
            "enc_channels": [16, 16, 16, 16, 48], "enc_attention_channels": 8, "enc_se_channels": 8,
            "max_position_embeddings": 8192,  # 4096 codes (the talker default) x 2
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "bigvgan_config": {
            "mel_dim": 8, "upsample_initial_channel": 16, "resblock_kernel_sizes": [3],
            "resblock_dilation_sizes": [[1, 3, 5]], "upsample_rates": [5, 4], "upsample_kernel_sizes": [10, 8],
        },
    }
    return Qwen2_5OmniConfig(
        thinker_config=thinker, talker_config=talker, token2wav_config=token2wav, enable_audio_output=True
    )


def tiny_tokenizer():
    """A byte-level tokenizer (no merges) over the tiny vocabulary, with a chat template."""
    return byte_tokenizer(SPECIAL, TOKENIZER_SPECIAL_NAMES, CHAT_TEMPLATE)


def tiny_speakers(config, seed: int = 0):
    """``spk_dict.pt`` contents: the speaker ``Chelsie`` (the real checkpoint's default) and ``Ethan``."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    dit = config.token2wav_config.dit_config
    speakers = {}
    for name in ("Chelsie", "Ethan"):
        speakers[name] = {
            "bos_token": SPECIAL["<tts_text_bos_single>"],
            "cond": torch.randn(dit.enc_emb_dim, generator=g),
            "ref_mel": torch.randn(1, 24, dit.mel_dim, generator=g),
        }
    return speakers


def write_tiny_checkpoint(path, *, seed: int = 0) -> Path:
    """Write the tiny checkpoint to ``path`` (created if missing) and return it."""
    import torch
    import transformers
    from transformers import Qwen2_5OmniForConditionalGeneration

    transformers.logging.set_verbosity_error()  # the talker's text ids live in the thinker's vocabulary
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.thinker.lm_head.weight[SPECIAL["<|im_end|>"]] *= THINKER_EOS_SCALE
        model.talker.codec_head.weight[CODEC_EOS] *= TALKER_EOS_SCALE
        for block in model.token2wav.code2wav_dit_model.transformer_blocks:
            block.attn.to_v.weight *= DIT_VALUE_SCALE
            block.attn.to_out[0].weight *= DIT_VALUE_SCALE
            block.attn_norm.linear.weight *= DIT_GATE_SCALE
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    torch.save(tiny_speakers(config, seed), path / "spk_dict.pt")
    (path / "omni_transformers.json").write_text(json.dumps({"sample_rate": SAMPLE_RATE, "tiny": True}) + "\n")
    return path

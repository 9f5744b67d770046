"""Write a tiny random CSM checkpoint (``python -m omni_transformers.tiny DIR --family csm``).

The checkpoint has the real checkpoint's file layout (``config.json``, ``generation_config.json``,
``model.safetensors``, the processor's and tokenizer's files, ``chat_template.jinja``) written by transformers' own
``save_pretrained``: ``CsmForConditionalGeneration`` with a 2-layer Llama backbone predicting codebook 0, a 2-layer
depth decoder predicting the others, and Mimi (8 codebooks of 64 codes here; the real strides, so 1,920 samples per
12.5 Hz frame at 24 kHz). The tokenizer is the kit's byte-level one with CSM's special tokens (``<|begin_of_text|>``,
``<|end_of_text|>``, ``<|AUDIO|>``, ``<|audio_eos|>``) and a chat template rendering each turn as
``<|begin_of_text|>[speaker]text<|end_of_text|>``, as the real one does for text.

The generation config is written whole, as the real one: sampling (temperature 0.9, top-k 50) for the backbone and,
as ``depth_decoder_*`` keys, for the depth decoder; never ``_from_model_config: true``, with which transformers
drops the depth decoder's keys on load. Its weights are random (seeded), so its speech is noise: it exists for
tests, CI and a CPU demo.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL = {"<|begin_of_text|>": 256, "<|end_of_text|>": 257, "<|AUDIO|>": 258, "<|audio_eos|>": 259}
SPECIAL_NAMES = {"audio_token": "<|AUDIO|>", "audio_eos_token": "<|audio_eos|>"}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|begin_of_text|>[{{ message['role'] }}]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|end_of_text|>{% endfor %}"
)
CODEBOOKS = 8
CODEBOOK_SIZE = 64
SAMPLE_RATE = 24000
MAX_NEW_FRAMES = 24  # ~2 s: a random model rarely draws its end frame


def tiny_config():
    from transformers import CsmConfig, CsmDepthDecoderConfig, MimiConfig

    codec = MimiConfig(hidden_size=32, num_filters=4, codebook_size=CODEBOOK_SIZE, codebook_dim=16,
                       vector_quantization_hidden_dimension=16, num_quantizers=CODEBOOKS, num_semantic_quantizers=1,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                       intermediate_size=64, upsample_groups=32, sampling_rate=SAMPLE_RATE)
    depth = CsmDepthDecoderConfig(num_codebooks=CODEBOOKS, backbone_hidden_size=64, vocab_size=CODEBOOK_SIZE,
                                  hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=CODEBOOKS + 1)
    end, audio, audio_eos = SPECIAL["<|end_of_text|>"], SPECIAL["<|AUDIO|>"], SPECIAL["<|audio_eos|>"]
    return CsmConfig(num_codebooks=CODEBOOKS, vocab_size=CODEBOOK_SIZE, text_vocab_size=256 + len(SPECIAL),
                     hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=end,
                     bos_token_id=SPECIAL["<|begin_of_text|>"], eos_token_id=end, audio_token_id=audio,
                     audio_eos_token_id=audio_eos, codebook_pad_token_id=CODEBOOK_SIZE - 1, codebook_eos_token_id=0,
                     depth_decoder_config=depth.to_dict(), codec_config=codec.to_dict())


def write_tiny_checkpoint(path, *, seed: int = 0) -> Path:
    import torch
    from transformers import (
        CsmForConditionalGeneration,
        CsmProcessor,
        EncodecFeatureExtractor,
        GenerationConfig,
    )

    from ..kit.tiny import byte_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = CsmForConditionalGeneration(tiny_config()).eval()
    model.generation_config = GenerationConfig(
        _from_model_config=False, do_sample=True, temperature=0.9, top_k=50, max_new_tokens=MAX_NEW_FRAMES,
        bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id)
    model.depth_decoder.generation_config = GenerationConfig(_from_model_config=False, do_sample=True,
                                                             temperature=0.9, top_k=50)
    model.save_pretrained(path)
    tokenizer = byte_tokenizer(SPECIAL, SPECIAL_NAMES, CHAT_TEMPLATE, eos="<|end_of_text|>", pad="<|end_of_text|>")
    features = EncodecFeatureExtractor(feature_size=1, sampling_rate=SAMPLE_RATE)
    CsmProcessor(feature_extractor=features, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path

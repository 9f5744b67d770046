"""Write a tiny random Whisper checkpoint (``python -m omni_transformers.tiny DIR --family whisper``).

The checkpoint has the real checkpoint's file layout (``config.json``, ``generation_config.json``,
``model.safetensors``, ``preprocessor_config.json``, the tokenizer's files) written by transformers' own
``save_pretrained``: ``WhisperForConditionalGeneration`` (2 encoder and 2 decoder layers of width 64, 80 mel bins,
the 1,500 encoder positions of a 30 s window), a byte-level tokenizer (256 byte tokens, no merges) with the real
special tokens in the real order (``<|endoftext|>``, ``<|startoftranscript|>``, the 99 languages, ``<|translate|>``,
``<|transcribe|>``, ``<|startoflm|>``, ``<|startofprev|>``, ``<|nospeech|>``, ``<|notimestamps|>``, the 1,501
timestamps) and the generation config ``generate`` reads (language and task ids, no timestamps unless asked, a
``max_new_tokens`` so that a random decoder stops). Its weights are random (seeded), so its transcripts are noise:
it exists for tests, CI and a CPU demo.

Its weights are drawn wider than transformers' 0.02-std init (which makes every clip's text the same token over
and over) so that the text varies from clip to clip; the decoder's end-of-text row (the embedding is tied to the
output head) is the text tokens' mean row scaled up, so that a transcript ends after some tokens, and the
timestamp rows scaled down so that they appear only when timestamps are asked for.
"""

from __future__ import annotations

from pathlib import Path

#: Where the tiny vocabulary's special tokens start (after the 256 byte tokens).
FIRST_SPECIAL = 256
MAX_NEW_TOKENS = 48
EOS_SCALE = 20.0
TIMESTAMP_SCALE = 0.1
INIT_STD = 0.3


def special_tokens() -> list[str]:
    """Whisper's special tokens, in the real vocabulary's order."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return (["<|endoftext|>", "<|startoftranscript|>"] + [f"<|{code}|>" for code in LANGUAGES]
            + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
               "<|notimestamps|>"] + [f"<|{i * 0.02:.2f}|>" for i in range(1501)])


def tiny_tokenizer():
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import WhisperTokenizer

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = WhisperTokenizer(vocab=vocab, merges=[])
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens()], special_tokens=True)
    return tok


def _printable(text: str) -> bool:
    return text.isascii() and text.isprintable()


def tiny_generation_config(tok):
    from transformers import GenerationConfig
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    ids = tok.convert_tokens_to_ids
    eos, sot = ids("<|endoftext|>"), ids("<|startoftranscript|>")
    no_timestamps = ids("<|notimestamps|>")
    return GenerationConfig(
        decoder_start_token_id=sot, eos_token_id=eos, pad_token_id=eos, bos_token_id=eos,
        max_new_tokens=MAX_NEW_TOKENS, max_length=None, is_multilingual=True, return_timestamps=False,
        lang_to_id={f"<|{code}|>": ids(f"<|{code}|>") for code in LANGUAGES},
        task_to_id={"translate": ids("<|translate|>"), "transcribe": ids("<|transcribe|>")},
        no_timestamps_token_id=no_timestamps, prev_sot_token_id=ids("<|startofprev|>"),
        # as the real config: never the special tokens (timestamps aside) mid-text, nor a blank or the end first
        # (and, in this tiny vocabulary of bytes, every byte but printable ASCII: its text stays readable)
        suppress_tokens=[i for i in range(FIRST_SPECIAL) if not _printable(tok.decode([i]))]
        + list(range(sot, no_timestamps + 1)), begin_suppress_tokens=[ids("Ġ"), eos],
        alignment_heads=[[1, 0]])


def write_tiny_checkpoint(path, *, seed: int = 0) -> Path:
    import torch
    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer()
    gen = tiny_generation_config(tok)
    config = WhisperConfig(
        vocab_size=len(tok), num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=128, init_std=INIT_STD, pad_token_id=gen.pad_token_id,
        bos_token_id=gen.bos_token_id, eos_token_id=gen.eos_token_id,
        decoder_start_token_id=gen.decoder_start_token_id, begin_suppress_tokens=gen.begin_suppress_tokens,
        suppress_tokens=gen.suppress_tokens)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():
        embed = model.model.decoder.embed_tokens.weight
        text = [i for i in range(FIRST_SPECIAL) if i not in gen.suppress_tokens]
        embed[gen.eos_token_id] = embed[text].mean(0) * EOS_SCALE
        embed[gen.no_timestamps_token_id + 1:] *= TIMESTAMP_SCALE
    model.generation_config = gen
    model.save_pretrained(path)
    WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tok).save_pretrained(path)
    return path

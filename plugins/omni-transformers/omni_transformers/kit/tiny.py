"""What the families' tiny checkpoint writers share: a byte-level tokenizer over a tiny vocabulary.

Token id == byte value for the 256 bytes (no merges); then the family's special tokens and any extra
one-token words (e.g. chat roles), each one id as in the real tokenizers; a chat template.
"""

from __future__ import annotations


def bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2's)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer(special: dict[str, int], special_names: dict[str, str], chat_template: str,
                   words: dict[str, int] | None = None, eos: str = "<|im_end|>", pad: str = "<|endoftext|>"):
    """A ``PreTrainedTokenizerFast``: bytes 0..255, the ``special`` tokens (name -> id, in id order), the
    one-token ``words`` (name -> id, not special), ``special_names`` (what the processor reads as
    ``tokenizer.audio_token`` ...), ``eos`` / ``pad`` and ``chat_template``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}  # token id == byte value
    vocab.update(special)
    vocab.update(words or {})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # Every special token is one id (as in the real tokenizer): they are added to the tokenizer itself.
    # (Passing both additional_special_tokens= and extra_special_tokens= to the wrapper makes
    # transformers drop the first list silently: <|im_start|> was then 12 byte tokens.)
    tok.add_special_tokens(sorted(special, key=special.get))
    if words:
        tok.add_tokens([AddedToken(word, normalized=False) for word in sorted(words, key=words.get)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad,
                                   extra_special_tokens=special_names)
    fast.chat_template = chat_template
    return fast

"""Qwen2.5-Omni as omni stages: processor → thinker ==> talker ==> token2wav, one module each
(``qwen2_5_omni.processor``, ``.thinker``, ``.talker``, ``.token2wav``); this module names them all, for configs that
say ``omni_transformers.stages:Thinker``.

Each stage reproduces its part of ``Qwen2_5OmniForConditionalGeneration.generate(...,
return_audio=True)`` for one request (the same forward calls, logits processors and stop rules),
with everything per request: KV caches, explicit position ids (never ``rope_deltas`` on the
module), RNG (a ``torch.Generator`` seeded from the request's ``seed``). Model steps run in
worker threads, so concurrent requests interleave step by step and the event loop stays free.

Streams (the typed chunks of ``omni_transformers.kit.chunks``; docs/models.md lists every key):

- thinker → talker: chunk 0 ``{"step": 0, "token_id", "text", "prompt" [L, H], "text_bos",
  "text_eos", "text_pad" [H]}``, then per decoding step k ``{"step": k, "token_id", "text",
  "reply" [H]}`` (the thinker's input embedding + last hidden state of the token it just fed),
  then ``{"final": true, "text"}`` (text held back by incremental detokenisation).
- talker → token2wav: ``{"text", "token_ids"}`` as the thinker's text arrives, ``{"codes": [...]}``
  when the codes so far reach 1, 2, 4, 8 (``first_codes_per_chunk`` doubling), then every
  ``codes_per_chunk`` codes, then ``{"codes": [...], "final": true, "rng_state"}``.
- token2wav → caller: the text chunks and, as the codes arrive, ``{"audio", "sample_rate"}``
  chunks of the speech; its result is
  ``{"text", "token_ids", "codes", "audio", "sample_rate"}``.
"""

from .qwen2_5_omni.common import DEFAULT_SPEAKER, DEFAULT_SYSTEM_PROMPT
from .qwen2_5_omni.processor import Processor
from .qwen2_5_omni.talker import Talker
from .qwen2_5_omni.thinker import Thinker
from .qwen2_5_omni.token2wav import Token2Wav

__all__ = ["DEFAULT_SPEAKER", "DEFAULT_SYSTEM_PROMPT", "Processor", "Talker", "Thinker", "Token2Wav"]

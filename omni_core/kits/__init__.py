"""The batching kits: building blocks a stage uses to serve many requests with one model.

- :class:`MicroBatcher` (:mod:`omni_core.kits.batching`): concurrent one-shot calls (an encoder,
  a vocoder) made into batches.
- :class:`DecodeLoop` (:mod:`omni_core.kits.decode_loop`): continuous batching of autoregressive
  requests, one step call for every live request.

Both run on :class:`omni_core.kits.worker.Worker` (one worker task, the user's function on a
thread of its own, a close that fails whoever waits). docs/kits.md describes them.
"""

from .batching import BatcherClosed, BatchError, BatchStats, MicroBatcher
from .decode_loop import (
    NO_OUTPUT,
    DecodeLoop,
    DecodeSequence,
    DecodeStats,
    LoopClosed,
    Row,
    SequenceTooLarge,
    StepError,
)

__all__ = [
    "NO_OUTPUT",
    "BatchError",
    "BatchStats",
    "BatcherClosed",
    "DecodeLoop",
    "DecodeSequence",
    "DecodeStats",
    "LoopClosed",
    "MicroBatcher",
    "Row",
    "SequenceTooLarge",
    "StepError",
]

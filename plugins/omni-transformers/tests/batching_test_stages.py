"""Stages for the batching tests, imported by name in the stage processes (the tests folder is on
their path): a thinker whose batched step raises while one request (seed 666) is in it."""

from __future__ import annotations

from omni_transformers.qwen2_5_omni.thinker import Thinker, ThinkerEngine

POISON_SEED = 666


class FaultyEngine(ThinkerEngine):
    """Its batched decode forward raises whenever the poisoned request is one of the rows, as a
    model would on one bad row; alone, the other rows step normally."""

    def decode(self, states):
        if any(s.seed == POISON_SEED for s in states):
            raise RuntimeError(f"poisoned row (seed {POISON_SEED}) in a batch of {len(states)}")
        return super().decode(states)


class FaultyThinker(Thinker):
    engine_class = FaultyEngine

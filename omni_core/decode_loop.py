"""Alias of :mod:`omni_core.kits.decode_loop`, kept so that plugins importing
``omni_core.decode_loop`` go on working; new code imports from :mod:`omni_core.kits`
(docs/kits.md)."""

from .kits.decode_loop import (
    NO_OUTPUT,
    DecodeLoop,
    DecodeSequence,
    DecodeStats,
    LoopClosed,
    Row,
    SequenceTooLarge,
    StepError,
    StepFn,
)

__all__ = ["NO_OUTPUT", "DecodeLoop", "DecodeSequence", "DecodeStats", "LoopClosed", "Row", "SequenceTooLarge",
           "StepError", "StepFn"]

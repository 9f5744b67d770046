"""Alias of :mod:`omni_core.kits.batching`, kept so that plugins importing ``omni_core.batching``
go on working; new code imports from :mod:`omni_core.kits` (docs/kits.md)."""

from .kits.batching import BatcherClosed, BatchError, BatchFn, BatchStats, MicroBatcher

__all__ = ["BatchError", "BatchFn", "BatchStats", "BatcherClosed", "MicroBatcher"]

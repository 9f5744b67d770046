"""Per-process sharing of loaded models and their decode loops, owned by an explicit registry.

Stages of one process that load the same model with the same settings (a thinker that feeds a
talker and a text-only one, say) share one engine, so their requests batch together. The sharing
is counted: :meth:`EngineRegistry.acquire` hands out the engine and counts the holder,
:meth:`EngineRegistry.release` forgets it, and the last holder's release closes the engine and
removes it, so a stage built afterwards gets a fresh engine rather than a closed one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any


class EngineRegistry:
    """Engines by key (the model folder and every setting that shapes the engine), counted by holder.

    A stage takes ``engines=`` (a registry) or uses :meth:`process`, the one registry of its process."""

    _process: EngineRegistry | None = None

    def __init__(self) -> None:
        self._entries: dict[Hashable, list[Any]] = {}  # key -> [engine, holders]

    @classmethod
    def process(cls) -> EngineRegistry:
        """The registry the stages of this process share when they are given none."""
        if cls._process is None:
            cls._process = cls()
        return cls._process

    def acquire(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The engine of ``key``, built with ``make()`` when no holder has it; counts one more holder."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = [make(), 0]
        entry[1] += 1
        return entry[0]

    async def release(self, key: Hashable) -> None:
        """One holder less; the last one closes the engine (``await engine.close()``) and removes it."""
        entry = self._entries.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self._entries[key]
            await entry[0].close()

    def holders(self, key: Hashable) -> int:
        entry = self._entries.get(key)
        return 0 if entry is None else entry[1]

    def __len__(self) -> int:
        return len(self._entries)

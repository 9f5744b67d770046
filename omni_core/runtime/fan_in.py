"""A fan-in stage's payloads gathered per request: :class:`FanIn`."""

from __future__ import annotations

from typing import Any

import attrs

from ..config.schema import StageConfig
from .types import Inbound, StageFunctions, WiringError, chosen_names

__all__ = ["FanIn"]


@attrs.define
class _Parts:
    arrived: dict[str, Any] = attrs.Factory(dict)
    needed: list[str] | None = None
    started: bool = False
    inbound: Inbound = attrs.Factory(Inbound)


class FanIn:
    """The payloads a ``wait_for`` stage (``cfg``, with its ``wait_for_fn`` and ``merge_fn`` in
    ``fns``) received per request until its chosen sources have all sent theirs."""

    def __init__(self, cfg: StageConfig, fns: StageFunctions):
        self.cfg = cfg
        self.fns = fns
        self.parts: dict[int, _Parts] = {}

    def __len__(self) -> int:
        return len(self.parts)

    def __iter__(self):
        return iter(self.parts)

    def add(self, rid: int, request_id: str, src: str, payload: Any, inbound: Inbound) -> tuple[Any, Inbound] | None:
        """``src``'s payload for request ``rid``: the merged payload and everything received
        with the parts once the last needed one came, else None. What the user's functions
        raise is raised, the request's parts dropped."""
        state = self.parts.setdefault(rid, _Parts())
        if state.started:  # a source outside the chosen wait_for subset: not needed any more
            inbound.release()
            return None
        state.arrived[src] = payload
        state.inbound.merge(inbound)
        try:
            if self.fns.wait_for is not None and state.needed is None:
                state.needed = self._subset(request_id, src, payload)
            needed = state.needed if state.needed is not None else list(self.cfg.wait_for)
            if not all(name in state.arrived for name in needed):
                return None
            merge = self.fns.merge
            if merge is None:  # validation requires merge_fn with wait_for
                raise WiringError(f"stage {self.cfg.name!r} waits for several stages but has no merge_fn")
            merged = merge({name: state.arrived[name] for name in needed})
        except BaseException:  # noqa: B902 - user code: the caller fails the request
            self.drop(rid)
            raise
        state.started = True
        state.arrived.clear()
        inbound_all, state.inbound = state.inbound, Inbound()
        return merged, inbound_all

    def _subset(self, request_id: str, src: str, payload: Any) -> list[str] | None:
        wait_for = self.fns.wait_for
        assert wait_for is not None  # asked only of a stage with a wait_for_fn
        answer = wait_for(request_id, src, payload)
        if answer is None:
            return None
        return chosen_names(answer, self.cfg.wait_for, f"wait_for_fn {self.cfg.wait_for_fn!r} of stage {self.cfg.name!r}")

    def drop(self, rid: int) -> None:
        state = self.parts.pop(rid, None)
        if state is not None:
            state.inbound.release()

    def close(self) -> None:
        for rid in list(self.parts):
            self.drop(rid)

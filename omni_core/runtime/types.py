"""Types both sides of the runtime share: the parent (runner, coordinator) and the stage
processes (host, edges, routing, stages). A leaf module: it imports nothing from the runtime, so
the parent never imports the child's main and the runtime has no import circle."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..config.schema import CALLER_STAGE, PipelineConfig
from ..contracts import Bootstrap

__all__ = ["ALL_TARGETS", "CALLER", "INLINE_RELAY", "SPLIT_RELAY", "Bootstrap", "Inbound", "StageFunctions",
           "WiringError", "caller_edges", "chosen_names"]

#: omni-core's built-in relay, registered from code so that every process has it whatever
#: plugins load (omni_core.plugins.BUILTIN_PLUGINS): the relay of the caller's edges, of what a
#: split sends beside an edge's own relay, and of a TP leader's copies to its followers.
INLINE_RELAY = "inline"

#: The caller's process name in edges and addresses (its endpoint's inbox is ``""``).
CALLER = ""


def caller_edges(config: PipelineConfig) -> dict[tuple[str, str, str], str]:
    """The caller's edges, ``(src, dst, kind) → relay`` as the plan's edges between stages: its
    inputs to the entry stage (``work``), every terminal stage's result (``result``) and the
    chunks streamed to it (``stream``: a terminal stage's events, ``stream_to: [caller]``). Their
    relay is ``inline``: the caller may sit on any node."""
    edges = {(CALLER, config.entry, "work"): INLINE_RELAY}
    for stage in config.stages:
        if stage.terminal:
            edges[(stage.name, CALLER, "result")] = INLINE_RELAY
        if stage.terminal or CALLER_STAGE in stage.stream_to:
            edges[(stage.name, CALLER, "stream")] = INLINE_RELAY
    return edges

#: The wire name of a message whose tensors went through two relays (see ``Edges.put``).
SPLIT_RELAY = "+split"

#: Route/stream_done functions may return this to mean "every target".
ALL_TARGETS = "*"


class WiringError(Exception):
    """A user function broke its contract (returned an unknown stage, a wrong type, ...)."""


def chosen_names(answer: Any, allowed: Sequence[str], what: str, *,
                 none_is_all: bool = False, empty_ok: bool = True) -> list[str]:
    """The one check of the stage names a user function returned (``route``, ``stream_done_to``,
    ``wait_for``, ``terminal_stages``): a name, a list or tuple of names, or ``"*"`` for all of
    ``allowed``; None means all of them where ``none_is_all``, an empty answer is refused unless
    ``empty_ok``. Returns the names in the order given, without repeats; raises
    :class:`WiringError` naming ``what`` for anything else."""
    if answer == ALL_TARGETS or (answer is None and none_is_all):
        return list(allowed)
    names = [answer] if isinstance(answer, str) else answer
    if not isinstance(names, (list, tuple, set, frozenset)) or not all(isinstance(n, str) for n in names):
        raise WiringError(f"{what} returned {answer!r}; expected a stage name or a list of names "
                          f"from {list(allowed)}" + (" (or None for all)" if none_is_all else ""))
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise WiringError(f"{what} returned {unknown} which {'is' if len(unknown) == 1 else 'are'} "
                          f"not in {list(allowed)}")
    if not names and not empty_ok:
        raise WiringError(f"{what} returned {answer!r}; expected at least one of {list(allowed)}")
    return list(dict.fromkeys(names))


class Inbound:
    """What a request brought into this stage: relay buffers to release when the call is done,
    and the tensors that view relay memory (copied out if the result keeps them)."""

    __slots__ = ("releases", "storages")

    def __init__(self, releases: list[Callable[[], None]] | None = None, storages: set[Any] | None = None):
        self.releases: list[Callable[[], None]] = [] if releases is None else releases
        self.storages: set[Any] = set() if storages is None else storages  # relay.lifetime StorageKeys

    def merge(self, other: Inbound) -> None:
        self.releases += other.releases
        self.storages |= other.storages

    def release(self) -> None:
        if self.releases:
            releases, self.releases = self.releases, []
            for release in releases:
                release()

    def __bool__(self) -> bool:
        return bool(self.releases or self.storages)

    def __repr__(self) -> str:
        return f"Inbound(releases={self.releases!r}, storages={self.storages!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Inbound):
            return NotImplemented
        return self.releases == other.releases and self.storages == other.storages

    __hash__ = None  # type: ignore[assignment]  # mutable, as the attrs class it replaced


@attrs.define
class StageFunctions:
    """The stage's resolved wiring functions (None where the config sets none)."""

    route: Callable | None = None
    merge: Callable | None = None
    wait_for: Callable | None = None
    stream_done: Callable | None = None
    project: dict[str, Callable] = attrs.Factory(dict)
    project_stream: dict[str, Callable] = attrs.Factory(dict)  # stream target -> fn(chunk)

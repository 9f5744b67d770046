"""The stream chunks a stage reads, per request and source: :class:`Inflow`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from .flow import Grant, StreamBuffer, StreamClosed
from .types import Inbound

__all__ = ["Inflow"]


class Inflow:
    """Stage ``name``'s buffers of the chunks ``sources`` stream to it, ``size`` chunks each
    (see :mod:`.flow`); ``follower``: a TP follower's, whose leader gives the credits back."""

    def __init__(self, name: str, sources: frozenset[str], size: int, *, follower: bool = False):
        self.name = name
        self.sources = sources
        self.size = size
        self.follower = follower
        self.buffers: dict[int, dict[str, StreamBuffer]] = {}

    def __len__(self) -> int:
        return len(self.buffers)

    def __iter__(self) -> Iterator[int]:
        return iter(self.buffers)

    def __contains__(self, rid: object) -> bool:
        return rid in self.buffers

    def buffer(self, rid: int, src: str) -> StreamBuffer:
        per_request = self.buffers.get(rid)
        if per_request is None:
            per_request = self.buffers[rid] = {}
        buf = per_request.get(src)
        if buf is None:
            buf = per_request[src] = StreamBuffer(self.size)
        return buf

    def put(self, rid: int, src: str, chunk: Any, inbound: Inbound | None, grant: Grant | None) -> None:
        buf = self.buffer(rid, src)
        if buf.grant is None and not self.follower:
            buf.grant = grant
        buf.put(chunk, inbound)

    def reader(self, rid: int, src: str) -> AsyncIterator[Any]:
        if src not in self.sources:
            known = ", ".join(sorted(self.sources)) or "none"
            raise StreamClosed(f"stage {self.name!r} cannot stream_from({src!r}): that stage does not stream to it (sources: {known})")
        return self.buffer(rid, src).__aiter__()

    def storages(self, rid: int) -> set:
        """Relay memory the request's unreleased stream chunks still view."""
        out: set = set()
        for buf in self.buffers.get(rid, {}).values():
            out |= buf.storages()
        return out

    def close(self, rid: int) -> None:
        """The call ended: its streams read no more (the producers are told)."""
        for buf in self.buffers.pop(rid, {}).values():
            buf.close()

    def drop(self, rid: int) -> None:
        """The request is over everywhere: its streams close with nobody to tell."""
        for buf in self.buffers.pop(rid, {}).values():
            buf.grant = None
            buf.close()

    def drop_all(self) -> None:
        for rid in list(self.buffers):
            self.drop(rid)

"""What the stage processes send the caller about its requests: :class:`Replies`.

The coordinator's endpoint hands its data messages (results, the chunks streamed to the caller)
to ``Replies`` (the endpoint's :class:`~.endpoint.DataReceiver`), and ``Failed``, ``Dropped`` and
a stream-to-caller's ``StreamEnd`` in the request's order. A request completes when every stage
expected to answer did (:attr:`~.requests.Request.complete`); a streaming caller's chunks go to
its event queue, their credits back to the sending process in batches as it reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import StageError
from . import wire
from .endpoint import Endpoint
from .requests import Event, Graph, Request
from .types import CALLER, Inbound


class Replies:
    """``requests``: the coordinator's table (read only); ``finish(req, value=..., error=...)``
    ends a request; ``batch``: chunks read per credit message given back; ``edges``: the caller's
    edges and their relays (``caller_edges``)."""

    def __init__(self, endpoint: Endpoint, requests: Mapping[int, Request], graph: Graph,
                 finish: Callable[..., None], batch: int, edges: Mapping[tuple[str, str, str], str]):
        self.endpoint = endpoint
        self.edges = edges
        self.requests = requests
        self.graph = graph
        self._finish = finish
        self._batch = batch
        endpoint.on_data(self)
        endpoint.on(wire.Failed, self._on_failed)
        endpoint.on(wire.Dropped, self._on_dropped)
        endpoint.on(wire.StreamEnd, self._on_stream_end)

    def read(self, req: Request, stage: str, origin: str) -> None:
        """The caller consumed one chunk of ``stage``'s stream: its credit goes back (batched,
        as in :class:`~.flow.StreamBuffer`)."""
        key = (stage, origin)
        owed = req.owed.get(key, 0) + 1
        if owed >= self._batch:
            req.owed[key] = 0
            if origin in self.endpoint.addresses and req.rid in self.requests:
                self.endpoint.post(origin, wire.Credit(req.rid, "", stage, owed))
        else:
            req.owed[key] = owed

    # -- the endpoint's DataReceiver: results and the caller's stream chunks ------------------------

    def wanted(self, rid: int) -> bool:
        return rid in self.requests

    def accept(self, msg: wire.Data) -> bool:
        if msg.rid not in self.requests:
            return False
        if msg.relay:
            relay = self.edges.get((msg.src, CALLER, "result" if msg.kind == "result" else "stream"))
            if msg.relay != relay:
                where = f"its edge's relay, the {relay!r} relay" if relay else "no relay (it has no edge to the caller)"
                self.reject(msg, ValueError(f"a {msg.kind} of stage {msg.src!r} must come through {where}, "
                                            f"not {msg.relay!r}"))
                return False
        return True

    def reject(self, msg: wire.Data, exc: BaseException) -> None:
        req = self.requests.get(msg.rid)
        if req is not None:
            self._finish(req, error=StageError(f"cannot decode the result: {exc}", stage=msg.src,
                                               request_id=req.request_id, error_type=type(exc).__name__))

    def deliver(self, msg: wire.Data, payload: Any, inbound: Inbound | None) -> None:
        req = self.requests.get(msg.rid)
        if req is None:
            return
        if msg.kind == "result":
            if msg.stage in req.expected or (not req.expected and not req.results):
                req.results[msg.stage] = payload
            self._maybe_complete(req)
        elif msg.kind == "event":
            if msg.stage not in req.heard:
                req.heard.add(msg.stage)
            if req.events is not None:
                req.events.put_nowait((Event("chunk", msg.stage, payload), msg.origin))
            else:  # nobody reads chunks of a submitted request: their credit comes back at once
                self.read(req, msg.stage, msg.origin)
        else:
            self._finish(req, error=StageError(f"unexpected message kind {msg.kind!r}", stage=msg.src,
                                               request_id=req.request_id, error_type="ProtocolError"))

    # -- the other messages about a request, in its order -------------------------------------------

    def _on_failed(self, msg: wire.Failed) -> None:
        if msg.rid in self.requests:
            self.endpoint.in_order(msg.rid, lambda: self._failed(msg))

    def _on_dropped(self, msg: wire.Dropped) -> None:
        if msg.rid in self.requests:
            self.endpoint.in_order(msg.rid, lambda: self._dropped(msg))

    def _on_stream_end(self, msg: wire.StreamEnd) -> None:
        """A non-terminal stage ended its stream to the caller (after its last chunk)."""
        if msg.rid in self.requests:
            self.endpoint.in_order(msg.rid, lambda: self._stream_ended(msg))

    def _stream_ended(self, msg: wire.StreamEnd) -> None:
        req = self.requests.get(msg.rid)
        if req is not None:
            req.open_streams.discard(msg.src)
            self._maybe_complete(req)

    def _failed(self, msg: wire.Failed) -> None:
        req = self.requests.get(msg.rid)
        if req is not None:
            self._finish(req, error=StageError(msg.message, stage=msg.stage, request_id=req.request_id,
                                               error_type=msg.error_type, traceback=msg.traceback,
                                               invalid_input=msg.invalid_input, field=msg.field or None))

    def _dropped(self, msg: wire.Dropped) -> None:
        req = self.requests.get(msg.rid)
        if req is not None:
            self.graph.mark_dropped(req, msg.stage, msg.targets)
            self._maybe_complete(req)

    def _maybe_complete(self, req: Request) -> None:
        if not req.complete:
            return
        if not req.results:
            self._finish(req, error=StageError(
                "routing skipped every terminal stage, so the request produced no result",
                stage=req.last_dropper or "?", request_id=req.request_id, error_type="NoResult"))
            return
        self._finish(req, value=req.value())

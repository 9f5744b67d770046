"""What a stage uses of its process: :class:`StagePort`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Container, Mapping
from typing import Any

import attrs

__all__ = ["StagePort"]


@attrs.frozen
class StagePort:
    """What a stage uses of its process, handed to it by the host: fail a request (``fail(rid,
    stage, exc)``), whether a request ended (``is_ended``), free a request's relay memory
    (``release``), copy what views relay memory out of a result (``copy_out``), the trace
    context of requests (``traces``, read only), the router's ``finish`` (a call's result
    goes on) and ``emit`` (a stream chunk goes on), and the requests that came over the network
    (``networked``, read only: ``StageContext.from_network``)."""

    fail: Callable[[int, str, BaseException], None]
    is_ended: Callable[[int], bool]
    release: Callable[[int], None]
    copy_out: Callable[[Any, set], Any]
    traces: Mapping[int, str]
    # Their first argument is the calling StageRuntime (Any: this module sits below runtime/stage.py).
    finish: Callable[[Any, int, str, Any], Awaitable[None]]
    emit: Callable[[Any, int, str, Any], Awaitable[None]]
    networked: Container[int] = frozenset()

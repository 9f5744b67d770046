"""Control-plane messages: msgspec Structs, tagged so one decoder reads them all.

Every message travels as one zmq multipart message: the encoded struct first, then ``nframes``
tensor frames for relays that move data inline. Requests are identified on the wire by ``rid``, an
integer unique for the lifetime of a pipeline run; the caller's ``request_id`` string rides along
for logs, stage contexts and user functions, and may be reused once its request ended.
"""

from __future__ import annotations

import msgspec


class Data(msgspec.Struct, tag="d", array_like=True):
    """A payload or a stream chunk: ``kind`` is ``work`` (payload for ``stage``), ``chunk``
    (stream chunk for ``stage``), ``result`` (a terminal stage's result, to the coordinator) or
    ``event`` (a chunk a terminal stage emitted for the caller)."""

    kind: str
    rid: int
    request_id: str
    stage: str
    src: str
    skeleton: bytes
    relay: str = ""
    handle: bytes = b""
    nframes: int = 0
    trace: str = ""  # W3C traceparent of the request ("" unless tracing is on; omni_core.tracing)


class StreamEnd(msgspec.Struct, tag="e", array_like=True):
    """Stage ``src`` finished streaming to ``stage`` for request ``rid``."""

    rid: int
    stage: str
    src: str


class Failed(msgspec.Struct, tag="f", array_like=True):
    """Request ``rid`` failed in ``stage`` (to the coordinator)."""

    rid: int
    stage: str
    error_type: str
    message: str
    traceback: str


class Dropped(msgspec.Struct, tag="x", array_like=True):
    """``stage`` routed request ``rid`` away from ``targets`` (to the coordinator, so it knows
    which terminal stages can no longer answer)."""

    rid: int
    stage: str
    targets: list[str]


class Abort(msgspec.Struct, tag="a", array_like=True):
    """Cancel request ``rid`` everywhere and free what it holds."""

    rid: int


class Forget(msgspec.Struct, tag="g", array_like=True):
    """Request ``rid`` ended normally: drop leftover state (buffered chunks, partial fan-in)."""

    rid: int


class Ready(msgspec.Struct, tag="y", array_like=True):
    """A process built its stages and listens (to the coordinator)."""

    process: str
    pid: int


class StartFailed(msgspec.Struct, tag="z", array_like=True):
    """A process could not start (to the coordinator), with the child's traceback."""

    process: str
    pid: int
    message: str
    traceback: str


class Shutdown(msgspec.Struct, tag="s", array_like=True):
    """Stop serving, free everything, answer with Bye."""


class Bye(msgspec.Struct, tag="b", array_like=True):
    """A process freed its resources and is about to exit (to the coordinator)."""

    process: str


Message = Data | StreamEnd | Failed | Dropped | Abort | Forget | Ready | StartFailed | Shutdown | Bye

encode = msgspec.msgpack.Encoder().encode
_decoder = msgspec.msgpack.Decoder(Message)


def decode(frame: bytes | memoryview) -> Message:
    """Decode one control message; raises msgspec.DecodeError on anything malformed."""
    return _decoder.decode(frame)

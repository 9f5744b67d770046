"""Control-plane messages: msgspec Structs, tagged so one decoder reads them all.

Every message travels as one zmq multipart message: the encoded struct first, then ``nframes``
tensor frames for relays that move data inline. Requests are identified on the wire by ``rid``, an
integer unique for the lifetime of a pipeline run; the caller's ``request_id`` string rides along
for logs, stage contexts and user functions, and may be reused once its request ended.

Ordering: a receiver handles the messages of one request in the order they were sent, whether or
not they carry tensors (see :mod:`omni_core.runtime.ordered`).

Authentication: every message between the processes of one pipeline run carries proof of the
run's secret (made by the runner, handed to each stage process in its ``Bootstrap`` through the
launcher, never on a command line or in the environment): its first frame is a keyed BLAKE2b
MAC (:data:`MAC_BYTES` bytes) of the encoded message, then the message (:func:`seal`). A
receiver drops and logs a message whose MAC does not verify (:func:`unseal`), so a process of
the same user that does not hold the secret cannot forge a result, an abort or a ``Shutdown``.
The MAC covers the first frame; the tensor frames of a message travel in the same zmq message,
which zmq delivers whole from one sender.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec


class Data(msgspec.Struct, tag="d", array_like=True):
    """A payload or a stream chunk: ``kind`` is ``work`` (payload for ``stage``), ``chunk``
    (stream chunk for ``stage``), ``result`` (a terminal stage's result, to the coordinator) or
    ``event`` (a chunk a terminal stage emitted for the caller). ``origin`` is the sending
    process (``""``: the coordinator), where stream credits go back to."""

    kind: str
    rid: int
    request_id: str
    stage: str
    src: str
    skeleton: bytes
    relay: str = ""
    handle: bytes = b""
    nframes: int = 0
    origin: str = ""
    trace: str = ""  # W3C traceparent of the request ("" unless tracing is on; omni_core.tracing)
    from_network: bool = False  # the request came over the network (StageContext.from_network; omni_core.files)


class StreamEnd(msgspec.Struct, tag="e", array_like=True):
    """Stage ``src`` finished streaming to ``stage`` for request ``rid``."""

    rid: int
    stage: str
    src: str


class Credit(msgspec.Struct, tag="c", array_like=True):
    """The reader of the stream ``src`` → ``stage`` of request ``rid`` consumed ``n`` chunks
    (to the process that sent them). ``closed``: the reader will read no more (its call ended):
    the sender stops sending that stream."""

    rid: int
    stage: str
    src: str
    n: int
    closed: bool = False


class Failed(msgspec.Struct, tag="f", array_like=True):
    """Request ``rid`` failed in ``stage`` (to the coordinator)."""

    rid: int
    stage: str
    error_type: str
    message: str
    traceback: str
    invalid_input: bool = False  # an omni_core.errors.InvalidInput: the caller's mistake, about ``field``
    field: str = ""


class Dropped(msgspec.Struct, tag="x", array_like=True):
    """``stage`` routed request ``rid`` away from ``targets`` (to the coordinator, so it knows
    which terminal stages can no longer answer)."""

    rid: int
    stage: str
    targets: list[str]


class Abort(msgspec.Struct, tag="a", array_like=True):
    """Cancel request ``rid`` everywhere and free what it holds. ``floor``: every request below
    it has ended (late messages for them are dropped, and their memory of having ended too)."""

    rid: int
    floor: int = 0


class Forget(msgspec.Struct, tag="g", array_like=True):
    """Request ``rid`` ended normally: drop leftover state (buffered chunks, partial fan-in).
    ``rid`` 0 only moves ``floor`` (see ``Abort``)."""

    rid: int
    floor: int = 0


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
    stage: str = ""  # the stage it was building, and that stage's config path (``stages[1].args``)
    path: str = ""


class Heartbeat(msgspec.Struct, tag="h", array_like=True):
    """A process is alive (sent by a thread of its own every ``limits.heartbeat_interval``,
    whatever its event loop does). ``loop_lag``: seconds its event loop has been unresponsive."""

    process: str
    pid: int
    generation: int
    loop_lag: float = 0.0


class StateQuery(msgspec.Struct, tag="q", array_like=True):
    """Ask a process for its per-request state (answered with ``StateReport``)."""

    token: int


class StateReport(msgspec.Struct, tag="r", array_like=True):
    """How much per-request state a process holds: table name → entries."""

    token: int
    process: str
    state: dict[str, int]


class Shutdown(msgspec.Struct, tag="s", array_like=True):
    """Stop serving, free everything, answer with Bye."""


class Bye(msgspec.Struct, tag="b", array_like=True):
    """A process freed its resources and is about to exit (to the coordinator)."""

    process: str


Message = (Data | StreamEnd | Credit | Failed | Dropped | Abort | Forget | Ready | StartFailed | Heartbeat
           | StateQuery | StateReport | Shutdown | Bye)


class Batch(msgspec.Struct, tag="B", array_like=True):
    """Several messages to one peer in one zmq message (what a sender's loop turn posted to it).
    The tensor frames follow the encoded batch in order: each ``Data``'s ``nframes`` of them, in
    the order of ``messages``. A receiver handles the messages as if they came one by one."""

    messages: list[Message]


encode = msgspec.msgpack.Encoder().encode
_decoder = msgspec.msgpack.Decoder(Message | Batch)


def decode(frame: bytes | memoryview) -> Message | Batch:
    """Decode one control message; raises msgspec.DecodeError on anything malformed."""
    return _decoder.decode(frame)


#: Bytes of the MAC that starts every sealed message.
MAC_BYTES = 16
_same = hmac.compare_digest


class Sealer:
    """Seals and checks messages under one run's secret. The keyed hash state is made once and
    copied per message (a third of the cost of keying it each time)."""

    __slots__ = ("_keyed",)

    def __init__(self, secret: bytes):
        if len(secret) < 16:
            raise ValueError("the control plane's secret must have at least 16 bytes")
        self._keyed = hashlib.blake2b(key=secret, digest_size=MAC_BYTES)

    def seal(self, body: bytes) -> bytes:
        """``body`` (an encoded message) with its MAC in front."""
        h = self._keyed.copy()
        h.update(body)
        return h.digest() + body

    def unseal(self, frame: memoryview) -> memoryview | None:
        """The encoded message of a sealed ``frame``, or None when its MAC does not verify (not
        made with the run's secret, or altered)."""
        if len(frame) < MAC_BYTES:
            return None
        body = frame[MAC_BYTES:]
        h = self._keyed.copy()
        h.update(body)
        return body if _same(frame[:MAC_BYTES], h.digest()) else None


def seal(secret: bytes, body: bytes) -> bytes:
    """``body`` sealed under ``secret`` (see :class:`Sealer`, which keeps the key's state)."""
    return Sealer(secret).seal(body)


def unseal(secret: bytes, frame: memoryview) -> memoryview | None:
    """The message of ``frame`` if its MAC verifies under ``secret``, else None."""
    return Sealer(secret).unseal(frame)

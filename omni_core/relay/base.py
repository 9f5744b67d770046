"""The Relay protocol: how tensors travel between two stage processes.

The runtime splits a payload into a msgpack skeleton and a list of tensors
(:mod:`omni_core.relay.payload`); the skeleton rides in the control message and the tensors go
through the edge's relay::

    transfer = await relay.put(request_id, tensors, target)   # sender process
    # ... transfer.handle (bytes) and transfer.frames ride in the control message ...
    tensors = await relay.get(transfer.handle, frames)         # receiver process
    relay.release(transfer.handle)                             # receiver is done with them

Contracts every relay keeps (``omni_core.testing.relay_conformance`` checks them):

- ``put`` copies or pins what it needs before it returns: the caller may drop its tensors. (A
  relay that pins rather than copies, like ``inline``, may still send later in-place writes; one
  that copies, like ``shm``, never does.) It may wait (back-pressure) when the relay's credits for
  ``target`` are exhausted, and raises :class:`RelayTimeout` when none came back in time; it never
  buffers without bound.
- ``get`` returns tensors with the dtype, shape and values that were put (contiguous, in order).
  They may be zero-copy views into relay memory that stay valid until ``release``; ``owns(tensor)``
  says which (the runtime copies those out of anything that outlives the call, see
  :mod:`omni_core.relay.lifetime`). ``get`` validates the handle before it opens, maps or allocates
  anything it names, and raises :class:`InvalidHandle` for a forged or corrupted one
  (:mod:`omni_core.relay.checks`).
- ``release`` frees the sender's slot or credit; ``cleanup(request_id)`` frees everything still
  held for an aborted or failed request, on either side; both are idempotent.
- Data for an ended request is released: ``release(handle)`` without a ``get`` (the receiver
  dropped the message unread, its request having ended there) frees the sender's credit as a
  ``get`` then ``release`` would; ``cleanup_below(floor)`` frees what is held for every request
  below ``floor`` (all ended: a restarted receiver never saw their end).
- ``close`` frees every resource the relay holds in this process; nothing outlives it (no shm
  segment, no thread). ``sweep(run_id)`` removes what a crashed run of this relay left behind.
- A failure of one transfer raises from that ``put``/``get`` only; the relay keeps working.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

# RelayCapabilities and its parsing live in omni_core.capabilities (below the plugin loader);
# importable from here as before.
from ..capabilities import DEVICES, SCOPES, RelayCapabilities, as_capabilities  # noqa: F401
from ..errors import OmniError


class RelayError(OmniError):
    """A relay transfer failed; it fails the request it belongs to, and the relay goes on."""


class InvalidHandle(RelayError, ValueError):
    """A received handle (or its frames) failed validation: it names a resource outside this run,
    a size beyond its buffer or its declared tensors, or is malformed. Nothing it named was opened
    or allocated; the request it came with fails, the relay keeps working."""


class RelayTimeout(OmniError, TimeoutError):
    """``put`` waited longer than the relay's timeout for credits toward its target (the receiver
    holds them: it is slow, stuck or dead). The message says which target and who holds them."""


@attrs.frozen
class RelayContext:
    """What a relay instance knows about where it runs.

    ``run_id``: unique per pipeline run (name shared resources with it so a sweep finds them).
    ``process``: this process's name. ``runtime_dir``: the run's private 0700 directory.
    ``options``: the ``relay.options`` mapping from the config.
    """

    run_id: str
    process: str
    runtime_dir: str
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Transfer:
    """What ``put`` hands back: an opaque ``handle`` for the receiver and ``frames`` (buffers that
    travel as extra zmq frames with the control message; empty for out-of-band relays)."""

    handle: bytes
    frames: Sequence[Any] = ()


class Relay(abc.ABC):
    """Base class of relay backends (register subclasses with ``omni_register_relays``)."""

    name: ClassVar[str] = ""
    capabilities: ClassVar[RelayCapabilities] = RelayCapabilities()

    def __init__(self, ctx: RelayContext):
        self.ctx = ctx

    @abc.abstractmethod
    async def put(self, request_id: int, tensors: Sequence[Any], target: str) -> Transfer:
        """Make ``tensors`` available to process ``target``; may wait for credits."""

    @abc.abstractmethod
    async def get(self, handle: bytes, frames: Sequence[Any] = ()) -> list[Any]:
        """The tensors a ``put`` sent, on the receiving process."""

    def owns(self, tensor: Any) -> bool:
        """Whether ``tensor``, as returned by this relay's ``get``, views memory the relay reuses
        (or frees) after ``release``: a stage that keeps it past its call must get a copy.

        The default is conservative: a relay that overrides ``release`` owns every non-empty
        tensor it returned, whatever its device. Relays whose received tensors are the
        receiver's own (``inline``: views of received frames) say False."""
        return type(self).release is not Relay.release and bool(tensor.numel())

    def debug_state(self) -> dict[str, int]:
        """Per-request entries this relay holds in this process, by table (received transfers
        not released, credits held toward receivers, transfers parked for a later ``get``). All
        zero once no request is in flight; for tests and diagnostics
        (``Pipeline.debug_state``)."""
        return {}

    def release(self, handle: bytes) -> None:  # noqa: B027 - optional for relays without slots
        """The receiver is done with the tensors of ``handle``."""

    def cleanup(self, request_id: int) -> None:  # noqa: B027
        """Free everything held for ``request_id`` (abort, failure)."""

    def cleanup_below(self, floor: int) -> None:  # noqa: B027
        """Free everything held for every request below ``floor`` (they all ended). Relays with
        credits override it; the default frees nothing."""

    def close(self) -> None:  # noqa: B027
        """Free every resource of this relay in this process."""

    @classmethod
    def sweep(cls, run_id: str | None = None, *, dry_run: bool = False) -> list[str]:
        """Remove resources left behind by crashed runs (``run_id``: only that run's).

        Returns what was removed (with ``dry_run``: what would be), for ``omni clean``."""
        return []

"""Built-in relays, registered with their capabilities and options schemas
(:mod:`omni_core.relay.specs`) so that ``auto``, ``omni plan`` and ``omni validate`` never import
them (nor torch)."""

from __future__ import annotations

from ..plugins import hookimpl
from ..relay.specs import INLINE_CAPABILITIES, INLINE_MS_PER_MIB, SHM_CAPABILITIES, SHM_OPTIONS

__all__ = ["INLINE_CAPABILITIES", "INLINE_MS_PER_MIB", "SHM_CAPABILITIES", "SHM_OPTIONS", "omni_register_relays"]


@hookimpl
def omni_register_relays(register):
    register("inline", "omni_core.relay.inline:InlineRelay", description="tensors as zero-copy zmq frames; any edge",
             capabilities=INLINE_CAPABILITIES, options={})
    register(
        "shm",
        "omni_core.relay.shm:ShmRelay",
        description="same-node shared-memory pool per sender and target; one copy in, zero-copy out",
        capabilities=SHM_CAPABILITIES,
        options=SHM_OPTIONS,
    )

"""Built-in relays."""

from __future__ import annotations

from ..plugins import hookimpl


@hookimpl
def omni_register_relays(register):
    register("inline", "omni_core.relay.inline:InlineRelay", description="tensors as zero-copy zmq frames; any edge")
    register(
        "shm",
        "omni_core.relay.shm:ShmRelay",
        description="same-node shared-memory pool per sender and target; one copy in, zero-copy out",
    )

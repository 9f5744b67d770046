"""The built-in relays' registration metadata: capabilities and options schemas, in a module that
imports no torch, so that registering them (``omni_core.builtin.relays``), ``auto``, ``omni plan``
and ``omni validate`` never import the relays themselves."""

from __future__ import annotations

from ..capabilities import RelayCapabilities
from ..options import Option, positive_int, positive_number

#: inline's milliseconds per MiB between two nodes (tensors in CurveZMQ control messages), measured
#: by ``python -m bench --scenario ray`` (64 MiB, docs/performance.md "Tensors across nodes").
INLINE_MS_PER_MIB = 13.9
INLINE_CAPABILITIES = RelayCapabilities(
    devices=frozenset({"cpu", "cuda"}), scopes=frozenset({"node", "cluster"}), priority=0,
    ms_per_mib=INLINE_MS_PER_MIB,
)
SHM_CAPABILITIES = RelayCapabilities(devices=frozenset({"cpu"}), scopes=frozenset({"node"}), priority=10)

SHM_OPTIONS = {
    "slot_bytes": positive_int(4 << 20, "size of one slot in bytes (rounded up to 64)"),
    "slots": positive_int(32, "slots per pool: credits per sender and target process"),
    "timeout": positive_number(30.0, "seconds a put waits for credits before RelayTimeout"),
    "inline_below": Option("non_negative_int", 64 << 10, "transfers of fewer bytes travel as frames of the control "
                           "message, like inline (no slot, no credit); 0: every transfer through the pool"),
}

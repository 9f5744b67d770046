"""The plugin module behind omni-tcp's entry point: registers the ``tcp`` relay by dotted path,
with its capabilities and options schema, so listing plugins, planning and validating configs
never import the relay (nor torch)."""

from __future__ import annotations

from omni_core import hookimpl
from omni_core.options import Option, boolean, positive_int, positive_number, string
from omni_core.relay import RelayCapabilities

#: Milliseconds per MiB across nodes, from ``python -m bench --scenario ray``: the median request
#: time of a 64 MiB tensor between two nodes of a local Ray cluster on the 2-core reference
#: machine (load average 12 to 21), over 64; the run docs/performance.md reports ("Tensors across
#: nodes"). ``omni plan`` shows it for edges that cross nodes. Rerun the bench to update it.
MEASURED_MS_PER_MIB = 1.82

CAPABILITIES = RelayCapabilities(
    devices=frozenset({"cpu", "cuda"}),
    scopes=frozenset({"node", "cluster"}),
    priority=5,
    ms_per_mib=MEASURED_MS_PER_MIB,
)

OPTIONS = {
    "credits": positive_int(16, "unreleased transfers per target process"),
    "timeout": positive_number(30.0, "seconds a put waits for a credit before RelayTimeout, and a get "
                               "for its transfer to make progress"),
    "chunk_bytes": positive_int(1 << 20, "bytes sent of one transfer before the next transfer's turn"),
    "inline_below": Option("non_negative_int", 64 << 10, "transfers of fewer bytes travel as frames of the "
                           "control message, like inline (no connection, no credit); 0: every transfer "
                           "over the data connection"),
    "encrypt": boolean(False, "encrypt the data connection (AES-256-GCM; needs omni-tcp[encrypt]); "
                      "it is always authenticated"),
    "host": string("", "address the data listener binds (and receivers connect to); empty: this "
                   "node's address"),
    "connect_timeout": positive_number(10.0, "seconds to connect and authenticate a data connection"),
}


@hookimpl
def omni_register_relays(register):
    register(
        "tcp",
        "omni_tcp.relay:TcpRelay",
        description="an authenticated tcp data connection per process pair, chunked, with credits; "
        "across nodes",
        capabilities=CAPABILITIES,
        options=OPTIONS,
    )

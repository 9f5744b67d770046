"""The plugin module behind omni-nccl's entry point: registers the ``nccl`` relay by dotted path,
with its capabilities and options schema, so listing plugins, planning and validating configs
never import torch.distributed."""

from __future__ import annotations

from omni_core import hookimpl
from omni_core.options import positive_int, positive_number
from omni_core.relay import RelayCapabilities

CAPABILITIES = RelayCapabilities(devices=frozenset({"cpu", "cuda"}), scopes=frozenset({"node"}), priority=5)

OPTIONS = {
    "credits": positive_int(16, "unreleased transfers per target and device kind"),
    "timeout": positive_number(30.0, "seconds a put waits for a credit before RelayTimeout"),
    "link_timeout": positive_number(60.0, "seconds to connect a link or to complete one send or receive"),
}


@hookimpl
def omni_register_relays(register):
    register(
        "nccl",
        "omni_nccl.relay:NcclRelay",
        description="torch.distributed point-to-point per process pair; gloo for CPU tensors, "
        "NCCL for CUDA tensors; same node",
        capabilities=CAPABILITIES,
        options=OPTIONS,
    )

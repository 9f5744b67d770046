"""The plugin module behind omni-cuda-ipc's entry point: registers the ``cuda_ipc`` relay by dotted
path, with its capabilities and options schema, so listing plugins, planning and validating
configs never touch CUDA."""

from __future__ import annotations

from omni_core import hookimpl
from omni_core.options import positive_int, positive_number
from omni_core.relay import RelayCapabilities

CAPABILITIES = RelayCapabilities(devices=frozenset({"cuda"}), scopes=frozenset({"node"}), priority=20)

OPTIONS = {
    "credits": positive_int(32, "unreleased transfers per target and GPU"),
    "timeout": positive_number(30.0, "seconds a put waits for a credit before RelayTimeout"),
}


@hookimpl
def omni_register_relays(register):
    register(
        "cuda_ipc",
        "omni_cuda_ipc.relay:CudaIpcRelay",
        description="same-node GPU to GPU through CUDA IPC; zero copy on one GPU, peer copy across GPUs",
        capabilities=CAPABILITIES,
        options=OPTIONS,
    )

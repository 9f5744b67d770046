"""The plugin module behind omni-cuda-ipc's entry point: registers the ``cuda_ipc`` relay by dotted
path, so listing plugins and planning never touch CUDA."""

from __future__ import annotations

from omni_core import hookimpl


@hookimpl
def omni_register_relays(register):
    register(
        "cuda_ipc",
        "omni_cuda_ipc.relay:CudaIpcRelay",
        description="same-node GPU to GPU through CUDA IPC; zero copy on one GPU, peer copy across GPUs",
    )

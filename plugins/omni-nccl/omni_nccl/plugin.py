"""The plugin module behind omni-nccl's entry point: registers the ``nccl`` relay by dotted path, so
listing plugins and planning never import torch.distributed."""

from __future__ import annotations

from omni_core import hookimpl


@hookimpl
def omni_register_relays(register):
    register(
        "nccl",
        "omni_nccl.relay:NcclRelay",
        description="torch.distributed point-to-point per process pair; gloo for CPU tensors, "
        "NCCL for CUDA tensors; same node",
    )

"""The relay conformance kit against ``cuda_ipc`` on a GPU machine (skipped without CUDA).

The kit puts CPU tensors; ``KitCudaIpcRelay`` moves them to the GPU first, so every contract runs
over CUDA IPC: with one GPU, sender and receiver share it (the zero-copy path)."""

from __future__ import annotations

import pytest
import torch
from omni_core.testing.relay_conformance import RelayConformance

from omni_cuda_ipc.relay import CudaIpcRelay

pytestmark = pytest.mark.cuda(reason="cuda_ipc moves CUDA tensors: the conformance kit needs a CUDA device")


class KitCudaIpcRelay(CudaIpcRelay):
    """cuda_ipc with the kit's CPU tensors moved to the current GPU before they are put."""

    async def put(self, request_id, tensors, target):
        moved = [t.cuda() if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t for t in tensors]
        return await super().put(request_id, moved, target)


class TestCudaIpcRelay(RelayConformance):
    relay_class = KitCudaIpcRelay
    relay_options = {"credits": 4, "timeout": 1.0}
    credits = 4
    put_timeout = 1.0
    large_bytes = 64 << 20

"""Stages of the core GPU tests (imported by dotted path in the stage processes)."""

from __future__ import annotations

import os

import torch


class WhereAmI:
    """Reports where the runtime put it: the injected ``device``, what torch sees, the placement
    environment, and a tensor it made on its device."""

    def __init__(self, device: str = "cpu", gpu_id: int | None = None):
        self.device = device
        self.gpu_id = gpu_id

    def __call__(self, payload, ctx):
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        x = torch.arange(4.0, device=self.device) * 2
        return {
            "device": self.device,
            "gpu_id": self.gpu_id,
            "visible": visible,
            "current": torch.cuda.current_device() if visible else None,
            "name": torch.cuda.get_device_name(0) if visible else None,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "omni_gpu_id": os.environ.get("OMNI_GPU_ID"),
            "x_device": str(x.device),
            "x": x.cpu(),
        }


class ToDevice:
    """Moves the payload's tensors ``x`` and ``h`` (when there) to this stage's device, ``x``
    scaled by ``factor``: a GPU stage returns CUDA tensors."""

    def __init__(self, device: str = "cpu", factor: float = 2.0):
        self.device = device
        self.factor = factor

    def __call__(self, payload, ctx):
        out = {**payload, "x": payload["x"].to(self.device) * self.factor}
        if "h" in payload:
            out["h"] = payload["h"].to(self.device)
        return out


class Report:
    """Says on which device each tensor arrived and returns them on the host."""

    def __call__(self, payload, ctx):
        return {"n": payload["n"], "x_device": payload["x"].device.type, "x": payload["x"].cpu(),
                **({"h_device": payload["h"].device.type, "h": payload["h"].cpu()} if "h" in payload else {})}


class Echo:
    """Returns what it received as it is, plus a slice of it: received tensors that view relay
    memory leave the stage (the runtime must copy them out before the relay reuses the memory)."""

    def __call__(self, payload, ctx):
        return {**payload, "head": payload["x"][:3]}

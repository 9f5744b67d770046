"""Placement: which GPU (or the CPU) each stage's ranks run on. Pure functions, no I/O.

A placement strategy (registered through ``omni_register_placements``) receives a
:class:`PlacementRequest` and returns ``{stage: [gpu id or None, one per TP rank]}``;
:func:`place` runs the configured strategy and validates its answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from ..config.schema import PipelineConfig
from ..errors import ConfigError, ConfigIssue
from ..registry import Registry


@attrs.frozen
class Device:
    """One GPU as placement sees it: its index (as the stage processes will see it before
    remapping) and its memory in bytes (None when unknown)."""

    index: int
    memory: int | None = None


@attrs.frozen
class StageDemand:
    """What one stage asks of placement."""

    name: str
    tp_size: int = 1
    gpu: tuple[int, ...] | None = None
    memory: float | None = None
    process: str | None = None


@attrs.frozen
class PlacementRequest:
    """The input of a strategy: stages in config order, the devices, and the strategy's options."""

    stages: tuple[StageDemand, ...]
    devices: tuple[Device, ...]
    options: dict = attrs.field(factory=dict)


Placement = dict[str, tuple[int | None, ...]]


def request_from_config(cfg: PipelineConfig, devices: Sequence[Device]) -> PlacementRequest:
    return PlacementRequest(
        stages=tuple(
            StageDemand(name=s.name, tp_size=s.tp_size, gpu=s.gpu, memory=s.memory, process=s.process)
            for s in cfg.stages
        ),
        devices=tuple(devices),
        options=dict(cfg.placement.options),
    )


def simulated_devices(count: int, memory: int | None = None) -> tuple[Device, ...]:
    return tuple(Device(i, memory) for i in range(count))


def detect_devices(memory_override: int | None = None) -> tuple[Device, ...]:
    """The GPUs torch can see (none on a CPU-only machine); imports torch only if already loaded
    or cheaply available."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return ()
    if not torch.cuda.is_available():
        return ()
    return tuple(
        Device(i, memory_override or torch.cuda.get_device_properties(i).total_memory)
        for i in range(torch.cuda.device_count())
    )


def place(cfg: PipelineConfig, registry: Registry, devices: Sequence[Device]) -> Placement:
    """Run the configured strategy and check its answer; ConfigError names stage and GPU."""
    strategy = registry.resolve("placement", cfg.placement.strategy)
    request = request_from_config(cfg, devices)
    answer = strategy(request)
    issues = check_placement(request, answer)
    if issues:
        raise ConfigError(issues)
    return {name: tuple(ids) for name, ids in answer.items()}


def check_placement(request: PlacementRequest, answer: dict) -> list[ConfigIssue]:
    """Every stage placed, one id per rank, every id visible."""
    issues: list[ConfigIssue] = []
    visible = {d.index for d in request.devices}
    for i, stage in enumerate(request.stages):
        ids = answer.get(stage.name)
        path = f"stages[{i}].gpu"
        if ids is None or len(ids) != stage.tp_size:
            issues.append(ConfigIssue(path, f"placement gave stage {stage.name!r} {ids!r}, expected {stage.tp_size} entries"))
            continue
        for rank, gpu in enumerate(ids):
            if gpu is not None and gpu not in visible:
                seen = ", ".join(str(v) for v in sorted(visible)) or "none"
                issues.append(ConfigIssue(
                    path, f"stage {stage.name!r} rank {rank} is placed on GPU {gpu}, which is not visible (visible GPUs: {seen})",
                    "use a visible GPU id, or plan with --gpus N / placement.gpus",
                ))
    return issues


def explicit(request: PlacementRequest) -> Placement:
    """Place each stage where its ``gpu:`` field says; stages without one run on the CPU.
    A single id for a TP stage means consecutive GPUs starting there."""
    out: Placement = {}
    for stage in request.stages:
        if stage.gpu is None:
            out[stage.name] = (None,) * stage.tp_size
        elif len(stage.gpu) == stage.tp_size:
            out[stage.name] = tuple(stage.gpu)
        else:
            out[stage.name] = tuple(stage.gpu[0] + r for r in range(stage.tp_size))
    return out

"""Planning: config → placement → process topology → endpoints. Pure functions; no I/O and no
import of ``omni_core.runtime``."""

from .placement import (
    DEFAULT_MEMORY,
    Device,
    GpuLoad,
    PlacementRequest,
    StageDemand,
    check_placement,
    place,
)
from .topology import OBJECT_RELAY, EdgeSpec, Plan, ProcessSpec, build_plan, endpoints

__all__ = [
    "DEFAULT_MEMORY",
    "OBJECT_RELAY",
    "Device",
    "EdgeSpec",
    "GpuLoad",
    "Plan",
    "PlacementRequest",
    "ProcessSpec",
    "StageDemand",
    "build_plan",
    "check_placement",
    "endpoints",
    "place",
]

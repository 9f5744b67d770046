"""Planning: config → placement → process topology → endpoints. Pure functions; no I/O and no
import of ``omni_core.runtime``."""

from .placement import Device, PlacementRequest, StageDemand, place
from .topology import OBJECT_RELAY, EdgeSpec, Plan, ProcessSpec, build_plan, endpoints

__all__ = [
    "OBJECT_RELAY",
    "Device",
    "EdgeSpec",
    "Plan",
    "PlacementRequest",
    "ProcessSpec",
    "StageDemand",
    "build_plan",
    "endpoints",
    "place",
]

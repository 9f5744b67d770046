"""Placement ``ray``."""

from __future__ import annotations

from omni_core.plan.placement import PlacementRequest, pack


def ray_placement(request: PlacementRequest):
    return pack(request)

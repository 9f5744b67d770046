"""The plugin module behind omni-ray's entry point: registers launcher and placement ``ray`` by
dotted path, so listing plugins and planning never import Ray."""

from __future__ import annotations

from omni_core import hookimpl


@hookimpl
def omni_register_launchers(register):
    register(
        "ray",
        "omni_ray.launcher:RayLauncher",
        description="every stage process in a Ray actor on a Ray cluster; TP ranks in one placement group; "
        "tcp + CurveZMQ between nodes",
    )


@hookimpl
def omni_register_placements(register):
    register(
        "ray",
        "omni_ray.placement:ray_placement",
        description="processes to the nodes and GPUs of a Ray cluster (or a described inventory), with pack's memory model",
    )

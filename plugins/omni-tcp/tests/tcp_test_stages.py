"""Stages the cross-node tests wire into pipelines (imported by dotted path on the nodes)."""

from __future__ import annotations


class Scale:
    """``x * factor``, and the Ray node it ran on appended to ``nodes``."""

    def __init__(self, factor: float = 2.0):
        self.factor = factor

    async def __call__(self, payload, ctx):
        import ray

        nodes = payload.get("nodes", []) + [ray.get_runtime_context().get_node_id()]
        return {"x": payload["x"] * self.factor, "nodes": nodes}

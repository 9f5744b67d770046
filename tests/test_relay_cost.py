"""A relay's measured cost across nodes (``capabilities.ms_per_mib``): checked at registration,
carried to the edges that cross nodes, shown by ``omni plan``."""

from __future__ import annotations

import pytest

from omni_core.builtin.relays import INLINE_CAPABILITIES
from omni_core.config import load_config
from omni_core.plan import build_plan
from omni_core.plan.render import render_text
from omni_core.plan.topology import place_on_nodes
from omni_core.plugins import get_registry
from omni_core.relay.base import as_capabilities
from omni_core.relay.inline import InlineRelay


def test_ms_per_mib_is_optional_and_checked():
    caps = as_capabilities({"devices": ["cpu"], "scopes": ["cluster"], "priority": 3, "ms_per_mib": 0.5})
    assert caps.ms_per_mib == 0.5 and caps.to_dict()["ms_per_mib"] == 0.5
    assert "ms_per_mib" not in as_capabilities({"devices": ["cpu"]}).to_dict()
    for bad in (0, -1.0, "fast", True):
        with pytest.raises(ValueError, match="ms_per_mib must be a positive number"):
            as_capabilities({"ms_per_mib": bad})


def test_an_edge_across_nodes_carries_its_relays_cost_and_plan_shows_it():
    assert InlineRelay.capabilities == INLINE_CAPABILITIES and INLINE_CAPABILITIES.ms_per_mib
    cfg = load_config({
        "name": "two", "relay": "inline",
        "stages": [{"name": "a", "factory": "m:A", "next": "b"}, {"name": "b", "factory": "m:B", "terminal": True}],
    }, validate=False)
    registry = get_registry()
    plan = place_on_nodes(build_plan(cfg, registry=registry), {"": "x", "a": "x", "b": "y"}, registry)
    (edge,) = plan.edges
    assert (edge.relay, edge.crosses_nodes, edge.ms_per_mib) == ("inline", True, INLINE_CAPABILITIES.ms_per_mib)
    row = next(line.split() for line in render_text(plan).splitlines() if line.split()[:2] == ["a", "b"])
    assert row == ["a", "b", "next", "inline", "yes", f"{INLINE_CAPABILITIES.ms_per_mib:g}", "ms"]
    same = place_on_nodes(build_plan(cfg, registry=registry), {"": "x", "a": "x", "b": "x"}, registry)
    assert same.edges[0].ms_per_mib is None

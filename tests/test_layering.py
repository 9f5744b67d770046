"""The import graph's budget (tests/layering.py computes it): no import circle and no arrow
running back up the layers, across omni-core, contrib_stages and the plugins."""

from __future__ import annotations

import layering

#: None left: the last circle (the stage process's parts reaching back into the host) went when
#: they got narrow ports of their own (runtime/endpoint.py, StagePort).
ALLOWED_CIRCLES = 0
#: Arrows back up still allowed, each with why. The launcher contract (omni_core.contracts, low so
#: that config validation and the hooks can name it) names the Plan and ProcessSpec it is handed:
#: a type-only import of the plan layer.
ALLOWED_ARROWS_UP = {
    ("omni_core.contracts", "omni_core.plan.topology"): "Launcher.prepare/plan_nodes and Bootstrap name Plan, ProcessSpec",
}


def test_every_module_is_read():
    mods = layering.modules()
    assert "omni_core.runtime.host" in mods and "omni_core.cli" in mods
    assert any(m.startswith("omni_ray.") for m in mods) and any(m.startswith("omni_contrib_stages") for m in mods)


def test_the_graph_finds_a_circle_and_an_arrow_up_where_there_is_one():
    edges = {("omni_core.relay.inline", "omni_core.relay.checks"), ("omni_core.relay.checks", "omni_core.relay.inline"),
             ("omni_core.plugins", "omni_core.relay.base"), ("omni_core.relay.base", "omni_core.errors")}
    assert layering.circles(edges) == [["omni_core.relay.checks", "omni_core.relay.inline"]]
    assert layering.arrows_up(edges) == [("omni_core.plugins", "omni_core.relay.base")]


def test_type_only_and_function_imports_count():
    mods = layering.modules()
    every = layering.imports(mods)
    assert ("omni_core.contracts", "omni_core.plan.topology") in every  # under `if TYPE_CHECKING:` only
    assert ("omni_core.cli.plan", "omni_core.contracts") in every  # inside a function only


def test_no_circle_and_no_arrow_back_up():
    every = layering.imports(layering.modules())
    found = layering.circles(every)
    assert len(found) <= ALLOWED_CIRCLES, "import circles (every import, in functions and type-only ones included):\n" + \
        "\n".join(" <-> ".join(c) for c in found)
    up = [arrow for arrow in layering.arrows_up(every) if arrow not in ALLOWED_ARROWS_UP]
    assert not up, "imports from a lower layer to a higher one (tests/layering.py LAYERS; type-only ones included):\n" + \
        "\n".join(f"{a} -> {b}" for a, b in up)

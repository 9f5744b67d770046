"""The import graph's budget (tests/layering.py computes it): at most one import circle and one
arrow running back up the layers, across omni-core, contrib_stages and the plugins."""

from __future__ import annotations

import layering

#: The circle still allowed: the stage process's parts (host, routing, stage, context) reach back
#: into the host through type-only imports until they get narrow ports of their own.
ALLOWED_CIRCLES = 1
ALLOWED_ARROWS_UP = 1


def test_every_module_is_read():
    mods = layering.modules()
    assert "omni_core.runtime.host" in mods and "omni_core.cli" in mods
    assert any(m.startswith("omni_ray.") for m in mods) and any(m.startswith("omni_contrib_stages") for m in mods)


def test_the_graph_finds_a_circle_and_an_arrow_up_where_there_is_one():
    edges = {("omni_core.relay.inline", "omni_core.relay.checks"), ("omni_core.relay.checks", "omni_core.relay.inline"),
             ("omni_core.plugins", "omni_core.relay.base"), ("omni_core.relay.base", "omni_core.errors")}
    assert layering.circles(edges) == [["omni_core.relay.checks", "omni_core.relay.inline"]]
    assert layering.arrows_up(edges) == [("omni_core.plugins", "omni_core.relay.base")]


def test_at_most_one_circle_and_one_arrow_back_up():
    top, every = layering.imports(layering.modules())
    found = layering.circles(top)
    assert len(found) <= ALLOWED_CIRCLES, "import circles (module-level imports, type-only ones included):\n" + \
        "\n".join(" <-> ".join(c) for c in found)
    up = layering.arrows_up(every)
    assert len(up) <= ALLOWED_ARROWS_UP, "imports from a lower layer to a higher one (tests/layering.py LAYERS):\n" + \
        "\n".join(f"{a} -> {b}" for a, b in up)

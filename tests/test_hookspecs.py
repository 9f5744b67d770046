"""Meta-tests: every hook is documented, and exercised by a test plugin that really registers
through it, so a new hook cannot land undocumented or untested."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from omni_core import hookspecs
from omni_core.plugins import HOOK_NAMES
from omni_core.registry import HOOK_KINDS

SPECS = sorted(name for name, fn in vars(hookspecs).items() if hasattr(fn, "omni_spec"))
PLUGINS_DOC = Path(__file__).parent.parent / "docs" / "plugins.md"


def test_hookspecs_define_the_hooks_omni_knows():
    assert SPECS, "no hookspec found"
    assert set(SPECS) == set(HOOK_NAMES) == set(HOOK_KINDS)


@pytest.mark.parametrize("hook", SPECS)
def test_hook_has_a_docstring_with_a_register_example(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook))
    assert doc and "register(" in doc, f"{hook} needs a docstring showing a register(...) call"


@pytest.mark.parametrize("hook", SPECS)
def test_hook_takes_only_the_register_callback(hook):
    assert list(inspect.signature(getattr(hookspecs, hook)).parameters) == ["register"]


@pytest.mark.parametrize("hook", SPECS)
def test_hook_is_documented_in_the_plugin_guide(hook):
    assert f"`{hook}`" in PLUGINS_DOC.read_text()


@pytest.mark.parametrize("hook", SPECS)
def test_hook_implemented_by_an_installed_plugin_fills_the_registry(hook, load):
    plugins = load("good")
    info = plugins.info("good")
    assert hook in info.hooks, f"the 'good' test plugin must implement {hook}"
    contributed = {kind: names for kind, names in info.registered.items() if kind in HOOK_KINDS[hook]}
    assert contributed, f"{hook} registered nothing"
    for kind, names in contributed.items():
        for name in names:
            entry = plugins.registry.get(kind, name)
            assert (entry.plugin, entry.kind) == ("good", kind)

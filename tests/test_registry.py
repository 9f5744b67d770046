"""Name resolution: registered names, dotted paths, "did you mean", conflicts, lazy entries."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_core.errors import PluginError
from omni_core.registry import (
    KIND_LABELS,
    BrokenPlugin,
    Entry,
    Registry,
    is_dotted_path,
    normalize_distribution,
    signature_text,
)


def make_registry(*entries: tuple[str, str, object], plugin: str = "acme") -> Registry:
    registry = Registry()
    for kind, name, target in entries:
        assert registry.add(Entry(kind=kind, name=name, target=target, plugin=plugin)) is None
    return registry


class UpperStage:
    def __init__(self, prefix: str = ""):
        self.prefix = prefix


def test_registered_name_resolves_to_the_object():
    registry = make_registry(("stage", "acme.upper", UpperStage))
    assert registry.resolve("stage", "acme.upper") is UpperStage
    assert registry.problem("stage", "acme.upper") is None


def test_unknown_name_suggests_the_closest_and_lists_the_known_ones():
    registry = make_registry(("stage", "acme.upper", UpperStage), ("stage", "acme.lower", UpperStage))
    with pytest.raises(PluginError) as caught:
        registry.get("stage", "acme.uper")
    assert str(caught.value) == (
        "unknown stage factory 'acme.uper' (did you mean 'acme.upper'?); "
        "known: acme.lower, acme.upper"
    )


def test_unknown_name_without_a_close_match_still_lists_the_known_ones():
    registry = make_registry(("relay", "shm", object), ("relay", "inline", object))
    assert registry.problem("relay", "carrier-pigeon") == (
        "unknown relay 'carrier-pigeon'; known: inline, shm"
    )


def test_unknown_name_of_an_empty_kind_says_none_are_registered():
    assert Registry().problem("launcher", "local") == (
        "unknown launcher 'local'; known: (none registered)"
    )


def test_function_of_another_kind_says_which_kind_it_is():
    registry = make_registry(("route", "acme.pick", len), ("merge", "acme.join", len))
    assert registry.problem("merge", "acme.pick") == (
        "unknown merge function 'acme.pick' ('acme.pick' is registered as a route function, "
        "not a merge function); known: acme.join"
    )


def test_each_kind_is_named_in_the_users_words():
    registry = Registry()
    for kind, label in KIND_LABELS.items():
        assert registry.problem(kind, "x.y").startswith(f"unknown {label} 'x.y'")


def test_dotted_path_resolves_without_being_registered():
    registry = Registry()
    assert registry.resolve("stage", "collections:OrderedDict") is __import__("collections").OrderedDict
    assert registry.resolve("merge", "os.path:join.__name__") == "join"
    assert registry.problem("stage", "collections:OrderedDict") is None


def test_dotted_path_to_a_missing_module_says_which_module():
    registry = Registry()
    assert registry.problem("stage", "no_such_pkg.stages:Thinker") == (
        "cannot find module 'no_such_pkg.stages' of 'no_such_pkg.stages:Thinker': "
        "ModuleNotFoundError: No module named 'no_such_pkg'"
    )
    assert registry.problem("stage", "no_such_module:Thinker") == (
        "cannot find module 'no_such_module' of 'no_such_module:Thinker'; is its package installed?"
    )
    with pytest.raises(PluginError, match="cannot import module 'no_such_module' of 'no_such_module:Thinker'"):
        registry.resolve("stage", "no_such_module:Thinker")


def test_dotted_path_to_a_missing_attribute_says_which_attribute():
    with pytest.raises(PluginError) as caught:
        Registry().resolve("stage", "collections:OrderedDcit")
    assert str(caught.value) == (
        "module 'collections' has no attribute 'OrderedDcit' (from 'collections:OrderedDcit'); "
        "check the spelling, or that the installed version provides it"
    )


def test_dotted_path_to_a_missing_attribute_of_an_imported_module_is_a_problem():
    assert Registry().problem("merge", "collections:OrderedDcit") == (
        "module 'collections' has no attribute 'OrderedDcit' (from 'collections:OrderedDcit'); "
        "check the spelling, or that the installed version provides it"
    )


def test_dotted_path_whose_module_raises_on_import_is_a_plugin_error(tmp_path, monkeypatch):
    (tmp_path / "omnitest_explodes.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(PluginError, match=r"importing module 'omnitest_explodes' of "
                           r"'omnitest_explodes:Stage' failed: RuntimeError: no GPU here"):
            Registry().resolve("stage", "omnitest_explodes:Stage")
    finally:
        sys.modules.pop("omnitest_explodes", None)


def test_problem_does_not_import_the_module_of_a_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "omnitest_unimported.py").write_text("class Stage: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert Registry().problem("stage", "omnitest_unimported:Stage") is None
    assert "omnitest_unimported" not in sys.modules


def test_lazy_entry_is_imported_once_on_first_load(tmp_path, monkeypatch):
    (tmp_path / "omnitest_lazy.py").write_text("IMPORTS = []\nIMPORTS.append(1)\nclass Stage: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = make_registry(("stage", "acme.lazy", "omnitest_lazy:Stage"))
    try:
        assert registry.problem("stage", "acme.lazy") is None
        assert "omnitest_lazy" not in sys.modules
        first = registry.resolve("stage", "acme.lazy")
        assert registry.resolve("stage", "acme.lazy") is first
        assert sys.modules["omnitest_lazy"].IMPORTS == [1]
    finally:
        sys.modules.pop("omnitest_lazy", None)


def test_lazy_entry_that_cannot_be_imported_names_the_plugin():
    registry = make_registry(("stage", "acme.gone", "acme_omni.gone:Stage"))
    with pytest.raises(PluginError) as caught:
        registry.resolve("stage", "acme.gone")
    assert str(caught.value).startswith(
        "stage factory 'acme.gone' of plugin 'acme' cannot be loaded: cannot import module "
        "'acme_omni.gone'"
    )


def test_pipeline_strings_are_not_imported_by_the_registry():
    registry = make_registry(("pipeline", "demo", "acme_omni:demo.yaml"))
    assert registry.get("pipeline", "demo").load() == "acme_omni:demo.yaml"


def test_conflicting_name_is_an_error_naming_both_plugins():
    registry = make_registry(("stage", "shared", dict), plugin="first")
    clash = registry.add(Entry(kind="stage", name="shared", target=list, plugin="second"))
    assert clash is not None and clash.plugin == "first"
    expected = (
        "stage factory 'shared' is registered by more than one plugin: 'first' and 'second'; "
        "uninstall one of them or disable one with OMNI_DISABLED_PLUGINS"
    )
    assert registry.problem("stage", "shared") == expected
    with pytest.raises(PluginError, match="more than one plugin: 'first' and 'second'"):
        registry.resolve("stage", "shared")


def test_names_and_entries_are_sorted_and_per_kind():
    registry = make_registry(("stage", "b", dict), ("stage", "a", dict), ("relay", "c", dict))
    assert registry.names("stage") == ["a", "b"]
    assert [e.name for e in registry.entries("stage")] == ["a", "b"]
    assert [e.name for e in registry.entries()] == ["c", "a", "b"]
    assert registry.kind_of("c", ["stage", "relay"]) == "relay"
    assert registry.kind_of("zzz", ["stage", "relay"]) is None


@pytest.mark.parametrize(
    ("plugin", "distribution", "name", "attributed"),
    [
        ("acme", "acme-omni", "acme.upper", True),
        ("plugin", "omni-acme", "acme.upper", True),
        ("plugin", "acme-omni", "acme.upper", True),
        ("plugin", "acme_tools", "acme_tools.upper", True),
        ("plugin", "Omni_Acme", "acme.upper", True),
        ("plugin", "other", "acme.upper", False),
    ],
)
def test_missing_name_is_attributed_to_the_broken_plugin_it_belongs_to(
    plugin, distribution, name, attributed
):
    registry = Registry()
    registry.broken.append(BrokenPlugin(plugin, distribution, "ImportError: no torch"))
    message = registry.problem("stage", name)
    expected = f"plugin {plugin!r} (distribution {distribution}) failed to load: ImportError: no torch"
    assert expected in message
    assert message.startswith(f"stage factory {name!r} is not available") == attributed


@pytest.mark.parametrize(
    ("ref", "dotted"),
    [
        ("pkg.mod:attr", True),
        ("pkg:attr.sub", True),
        ("acme.upper", False),
        (":attr", False),
        ("pkg:", False),
        ("plain", False),
    ],
)
def test_dotted_path_is_module_colon_attribute(ref, dotted):
    assert is_dotted_path(ref) is dotted


@given(st.text(alphabet="abcXYZ-_.", min_size=1, max_size=12))
def test_normalized_distribution_names_compare_like_packaging(name):
    normal = normalize_distribution(name)
    assert normal == normal.lower()
    assert "_" not in normal and "." not in normal and "--" not in normal
    assert normalize_distribution(name.upper().replace("-", "_")) == normal


def test_signature_text_shows_the_callable_with_its_parameters():
    assert signature_text(UpperStage) == "UpperStage(prefix: str = '')"
    assert signature_text(42) == "42"

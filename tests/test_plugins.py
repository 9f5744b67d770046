"""Plugin discovery through real entry points, broken-plugin records, enable/disable, conflicts."""

from __future__ import annotations

import sys
from unittest import mock

import pluggy
import pytest
from plugin_fixtures import (
    BROKEN,
    GOOD,
)

import omni_core
from omni_core.errors import PluginError
from omni_core.plugins import (
    HOOK_NAMES,
    get_plugins,
    get_registry,
    hookimpl,
    load_plugins,
    reset_plugins,
)

#: omni-core's own plugins (more may be added; these are the ones the tests rely on).
BUILTINS = {"omni.functions", "omni.placements", "omni.relays", "omni.launchers"}


def builtin_names(plugins) -> set[str]:
    return {i.name for i in plugins.infos if i.builtin}


def test_hookimpl_is_the_omni_marker_exported_by_the_package():
    assert omni_core.hookimpl is hookimpl
    assert isinstance(hookimpl, pluggy.HookimplMarker)
    assert hookimpl.project_name == "omni"


# -- discovery -------------------------------------------------------------------------------------


def test_installed_plugin_is_discovered_with_its_distribution_version_and_hooks(load):
    plugins = load("good")
    info = plugins.info("good")
    assert info.error is None
    assert info.distribution == GOOD.name
    assert info.version == GOOD.version
    assert info.module == "omnitest_good"
    assert not info.builtin
    assert info.hooks == list(HOOK_NAMES)
    assert info.registered == {
        "stage": ["acme.upper", "acme.lazy"],
        "route": ["acme.pick"],
        "merge": ["acme.join"],
        "relay": ["acme.relay"],
        "placement": ["acme.cpu"],
        "launcher": ["acme.launcher"],
        "pipeline": ["acme.demo", "acme.inline"],
        "api": ["acme.api"],
        "family": ["acme.family"],
    }
    upper = plugins.registry.get("stage", "acme.upper")
    assert upper.plugin == "good"
    assert upper.description == "upper-cases text"
    assert upper.load()("x ").__call__("hi", None) == "x HI"


def test_builtins_provide_what_a_default_config_names(load):
    registry = load("").registry
    assert "local" in registry.names("launcher")
    assert "explicit" in registry.names("placement")
    assert {"inline", "shm"} <= set(registry.names("relay"))
    assert {"omni.merge_dicts", "omni.by_source"} <= set(registry.names("merge"))
    for entry in registry.entries():
        assert entry.plugin in {i.name for i in load("").infos if i.builtin}


def test_builtins_load_first_and_are_marked_builtin(load):
    plugins = load("good")
    assert [i.name for i in plugins.infos][-1] == "good"
    assert builtin_names(plugins) >= BUILTINS
    for info in plugins.infos:
        assert info.builtin == (info.name != "good")
        assert info.builtin == (info.distribution == "omni-core")
        assert info.error is None


def test_lazy_registration_is_not_imported_until_the_name_is_used(load):
    registry = load("good").registry
    assert "omnitest_good" in sys.modules
    assert "omnitest_good.heavy" not in sys.modules
    entry = registry.get("stage", "acme.lazy")
    assert registry.problem("stage", "acme.lazy") is None
    assert "omnitest_good.heavy" not in sys.modules
    assert entry.load().__name__ == "HeavyStage"
    assert "omnitest_good.heavy" in sys.modules


def test_loading_twice_gives_the_same_plugins_and_names(load):
    first, second = load("good,dup_a"), load("good,dup_a")
    assert first.names() == second.names()
    assert [i.registered for i in first.infos] == [i.registered for i in second.infos]
    assert first.registry.names("stage") == second.registry.names("stage")


def test_get_plugins_reads_the_environment_when_it_loads_not_at_import(plugin_site, monkeypatch):
    monkeypatch.setenv("OMNI_LOAD_PLUGINS", "")
    assert "good" not in get_plugins().names()
    assert get_plugins() is get_plugins()
    monkeypatch.setenv("OMNI_LOAD_PLUGINS", "good")
    assert "good" not in get_plugins().names(), "loaded once per process until reset"
    reset_plugins()
    assert "good" in get_plugins().names()
    assert "acme.upper" in get_registry().names("stage")


def test_extra_plugins_load_like_installed_ones():
    class Local:
        @hookimpl
        def omni_register_stages(self, register):
            register("local.stage", dict)

    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("local", Local())])
    info = plugins.info("local")
    assert info.error is None and info.distribution is None
    assert plugins.registry.get("stage", "local.stage").load() is dict


def test_info_of_an_unknown_plugin_lists_the_loaded_ones(load):
    with pytest.raises(PluginError, match=r"no plugin named 'nope'; loaded: omni.functions"):
        load("").info("nope")


# -- broken plugins ----------------------------------------------------------------------------------


def test_plugin_that_fails_to_import_is_recorded_with_distribution_entry_point_and_error(load):
    plugins = load("good,broken")
    info = plugins.info("broken")
    assert info.distribution == BROKEN.name
    assert info.version == BROKEN.version
    assert info.module == "omnitest_broken"
    assert info.error == (
        "ModuleNotFoundError: No module named 'omnitest_dependency_that_is_not_installed'"
    )
    assert "Traceback" in info.traceback and "omnitest_broken.py" in info.traceback
    assert info.hooks == [] and info.registered == {}
    # the others are unaffected
    assert plugins.info("good").error is None
    assert "acme.upper" in plugins.registry.names("stage")


def test_name_only_a_broken_plugin_would_provide_fails_with_its_error(load):
    registry = load("good,broken").registry
    with pytest.raises(PluginError) as caught:
        registry.get("stage", "broken.stage")
    assert str(caught.value) == (
        "stage factory 'broken.stage' is not available: plugin 'broken' (distribution "
        f"{BROKEN.name}) failed to load: ModuleNotFoundError: No module named "
        "'omnitest_dependency_that_is_not_installed'"
    )


def test_unknown_name_mentions_broken_plugins_that_might_have_provided_it(load):
    registry = load("good,broken").registry
    message = registry.problem("stage", "something.else")
    assert message.startswith("unknown stage factory 'something.else'; known: acme.lazy, acme.upper")
    assert "note: plugin 'broken' (distribution omnitest-broken) failed to load" in message


def test_plugin_whose_hook_raises_registers_nothing_and_names_the_hook(load):
    plugins = load("raises")
    info = plugins.info("raises")
    assert info.error == "hook omni_register_stages raised RuntimeError: model catalogue not found"
    assert info.registered == {}
    assert "raises.first" not in plugins.registry.names("stage")
    assert not plugins.pm.has_plugin("raises"), "a failed plugin's hooks must not stay registered"
    with pytest.raises(PluginError, match="plugin 'raises' .* model catalogue not found"):
        plugins.registry.get("stage", "raises.first")


def test_misspelled_hook_is_recorded_as_unknown_hook_and_does_not_break_loading(load):
    plugins = load("good,misspelled")
    info = plugins.info("misspelled")
    assert info.error.startswith(
        "unknown hook 'omni_register_stage' (did you mean 'omni_register_stages'?)"
    )
    assert info.registered == {}
    assert plugins.info("good").error is None
    plugins.pm.check_pending()  # nothing unknown was left registered


def test_marked_function_without_the_omni_prefix_is_an_unknown_hook_not_a_crash():
    class Plugin:
        @hookimpl
        def register_stages(self, register):
            register("x.stage", dict)

    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("noprefix", Plugin())])
    assert plugins.info("noprefix").error.startswith("unknown hook 'register_stages'")
    assert plugins.info("omni.functions").error is None


def test_hook_function_without_the_marker_is_an_error_not_silently_ignored():
    class Plugin:
        def omni_register_stages(self, register):
            register("x.stage", dict)

    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("unmarked", Plugin())])
    assert plugins.info("unmarked").error == (
        "function 'omni_register_stages' looks like a hook but is not marked with "
        "@omni_core.hookimpl"
    )


def test_objects_that_answer_every_attribute_are_not_taken_for_hooks():
    class Plugin:
        omni_helper = mock.MagicMock()  # hasattr(mock, "omni_impl") is True

        @hookimpl
        def omni_register_stages(self, register):
            register("mocked.stage", dict)

    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("mocked", Plugin())])
    assert plugins.info("mocked").error is None
    assert "mocked.stage" in plugins.registry.names("stage")


def test_hook_with_wrong_argument_name_is_recorded():
    class Plugin:
        @hookimpl
        def omni_register_stages(self, reg):
            reg("x.stage", dict)

    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("wrongarg", Plugin())])
    assert "reg" in plugins.info("wrongarg").error
    assert "x.stage" not in plugins.registry.names("stage")


def test_plugin_raising_system_exit_while_loading_is_recorded_not_fatal():
    class Loader:
        @property
        def omni_register_stages(self):  # looking the hook up exits, like some imports do
            raise SystemExit("cannot run here")

    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("exits", Loader())])
    assert plugins.info("exits").error == "SystemExit: cannot run here"


# -- what register() accepts ------------------------------------------------------------------------


def _register_error(hook: str, *args, **kwargs) -> str | None:
    class Plugin:
        pass

    def impl(register):
        register(*args, **kwargs)

    setattr(Plugin, hook, staticmethod(hookimpl(impl)))
    impl.__name__ = hook
    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("p", Plugin())])
    return plugins.info("p").error


@pytest.mark.parametrize(
    ("hook", "args", "kwargs", "fragment"),
    [
        ("omni_register_functions", ("p.f", len), {}, "needs kind= one of route, merge, wait_for"),
        ("omni_register_functions", ("p.f", len), {"kind": "reduce"}, "got 'reduce'"),
        ("omni_register_stages", ("p.s", dict), {"kind": "route"}, "cannot take kind='route'"),
        ("omni_register_stages", ("p:s", dict), {}, "invalid name 'p:s'"),
        ("omni_register_stages", (" p.s", dict), {}, "invalid name ' p.s'"),
        ("omni_register_stages", ("", dict), {}, "invalid name ''"),
        ("omni_register_stages", ("p.s", None), {}, "'p.s' registered None"),
        ("omni_register_stages", ("p.s", 42), {}, "'p.s' must be callable, got int"),
        ("omni_register_stages", ("p.s", "Upper"), {}, "pass the object or a 'package.module:attr'"),
        ("omni_register_stages", ("p.s", dict), {"colour": "red"}, "unexpected keyword(s) colour"),
        ("omni_register_pipelines", ("p.p", 42), {}, "pipeline 'p.p' must be a mapping, a file path"),
    ],
)
def test_register_rejects_bad_registrations_with_the_plugin_and_hook(hook, args, kwargs, fragment):
    error = _register_error(hook, *args, **kwargs)
    assert error is not None and fragment in error
    assert error.startswith(f"plugin 'p', hook {hook}: ")


@pytest.mark.parametrize("kind", omni_core.registry.FUNCTION_KINDS)
def test_every_function_kind_can_be_registered(kind):
    assert _register_error("omni_register_functions", f"p.{kind}", len, kind=kind) is None


def test_registering_one_name_twice_in_one_plugin_is_an_error():
    class Plugin:
        @hookimpl
        def omni_register_stages(self, register):
            register("p.s", dict)
            register("p.s", list)

    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("twice", Plugin())])
    assert "stage factory 'p.s' is registered twice" in plugins.info("twice").error


def test_same_name_under_different_kinds_is_not_a_conflict():
    class Plugin:
        @hookimpl
        def omni_register_functions(self, register):
            register("p.f", len, kind="route")
            register("p.f", len, kind="merge")

    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("kinds", Plugin())])
    assert plugins.info("kinds").registered == {"route": ["p.f"], "merge": ["p.f"]}


# -- selecting plugins ------------------------------------------------------------------------------


def test_disabled_plugin_is_never_imported_and_its_names_say_why(load):
    plugins = load("good,disabled", OMNI_DISABLED_PLUGINS="disabled")
    assert "disabled" not in plugins.names()
    assert "omnitest_disabled" not in sys.modules
    message = plugins.registry.problem("stage", "disabled.stage")
    assert message.startswith("unknown stage factory 'disabled.stage'")
    assert "not loaded: " in message
    assert "plugin 'disabled' (disabled by OMNI_DISABLED_PLUGINS)" in message


def test_plugins_can_be_disabled_by_distribution_name(load):
    plugins = load("good,disabled", OMNI_DISABLED_PLUGINS=" omnitest_disabled , other")
    assert "disabled" not in plugins.names()
    assert "good" in plugins.names()


def test_without_omni_load_plugins_every_installed_plugin_loads(plugin_site):
    plugins = load_plugins(env={})
    assert {"good", "broken", "raises", "misspelled", "disabled", "dup_a", "dup_b"} <= set(
        plugins.names()
    )


def test_omni_load_plugins_selects_third_party_plugins_but_keeps_builtins(load):
    plugins = load("good")
    assert set(plugins.names()) - builtin_names(plugins) == {"good"}
    assert "omnitest_broken" not in sys.modules


def test_empty_omni_load_plugins_loads_only_builtins(load):
    plugins = load("")
    assert set(plugins.names()) == builtin_names(plugins)
    assert builtin_names(plugins) >= BUILTINS
    assert "omni.merge_dicts" in plugins.registry.names("merge")


def test_omni_load_plugins_accepts_distribution_names(load):
    assert "good" in load("omnitest-good").names()


def test_builtins_can_be_disabled_too(load):
    plugins = load("", OMNI_DISABLED_PLUGINS="omni.functions")
    assert "omni.functions" not in plugins.names()
    assert plugins.registry.names("merge") == []


def test_builtins_are_registered_from_code_even_without_their_entry_points(load):
    """The built-ins do not depend on omni-core's installed metadata: with no entry point at all
    (an install that lost them, a source tree), every one is there, with its version."""
    with mock.patch("omni_core.plugins.metadata.entry_points", return_value=[]):
        plugins = load("")
    assert set(plugins.names()) == BUILTINS and all(i.builtin and not i.error for i in plugins.infos)
    assert {"inline", "shm"} <= set(plugins.registry.names("relay")) and "local" in plugins.registry.names("launcher")
    assert plugins.info("omni-core:omni.relays").distribution == "omni-core"


def test_a_builtin_the_runtime_needs_cannot_be_disabled(load):
    """omni.relays holds ``inline``, the relay of the caller's edges: disabling it is a warning."""
    plugins = load("", OMNI_DISABLED_PLUGINS="omni.relays,omni.placements")
    assert "omni.relays" in plugins.names() and "inline" in plugins.registry.names("relay")
    assert "omni.placements" not in plugins.names()
    assert plugins.warnings == ["OMNI_DISABLED_PLUGINS: 'omni.relays' cannot be disabled (the caller's edges, splits "
                                "and TP copies use its 'inline' relay); it is loaded"]


# -- conflicts ---------------------------------------------------------------------------------------


def test_two_plugins_registering_one_name_is_an_error_naming_both(load):
    plugins = load("dup_a,dup_b")
    second = plugins.info("dup_b")
    assert second.error == (
        "name conflict: stage 'shared.stage' is also registered by plugin 'dup_a'; "
        "uninstall one of them or disable one with OMNI_DISABLED_PLUGINS"
    )
    # what does not clash still works, from both plugins
    assert second.registered == {"stage": ["dup_b.own"]}
    assert plugins.info("dup_a").registered == {"stage": ["shared.stage", "dup_a.own"]}
    with pytest.raises(PluginError) as caught:
        plugins.registry.get("stage", "shared.stage")
    assert str(caught.value) == (
        "stage factory 'shared.stage' is registered by more than one plugin: 'dup_a' and "
        "'dup_b'; uninstall one of them or disable one with OMNI_DISABLED_PLUGINS"
    )


def test_disabling_one_of_two_conflicting_plugins_resolves_the_conflict(load):
    plugins = load("dup_a,dup_b", OMNI_DISABLED_PLUGINS="dup_a")
    assert plugins.registry.get("stage", "shared.stage").plugin == "dup_b"
    assert plugins.info("dup_b").error is None


def test_plugin_clashing_with_a_builtin_name_is_reported():
    class Plugin:
        @hookimpl
        def omni_register_functions(self, register):
            register("omni.merge_dicts", dict, kind="merge")

    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("clash", Plugin())])
    assert "also registered by plugin 'omni.functions'" in plugins.info("clash").error
    assert "more than one plugin: 'omni.functions' and 'clash'" in plugins.registry.problem(
        "merge", "omni.merge_dicts"
    )


def test_two_plugins_under_one_name_keep_the_first(load):
    class Impostor:
        @hookimpl
        def omni_register_stages(self, register):
            register("impostor.stage", dict)

    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("acme", object()), ("acme", Impostor())])
    impostor = [i for i in plugins.infos if i.name == "acme"][-1]
    assert impostor.error.startswith("another plugin is already loaded under the name 'acme'")
    assert "impostor.stage" not in plugins.registry.names("stage")


def test_a_third_party_entry_point_named_like_a_builtin_does_not_clash():
    class Relays:
        @hookimpl
        def omni_register_stages(self, register):
            register("relays.stage", dict)

    plugins = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("relays", Relays())])
    assert plugins.info("relays").error is None
    assert plugins.info("omni.relays").error is None
    assert plugins.info("omni-core:omni.relays").builtin
    assert "shm" in plugins.registry.names("relay")


def test_plugins_are_identified_by_distribution_and_entry_point(load):
    plugins = load("omnitest-good:good")
    assert plugins.info("good").id == "omnitest-good:good"
    assert plugins.info("omnitest-good:good") is plugins.info("good")
    assert plugins.info("omni-core:omni.functions").builtin


def test_disabling_by_id_and_by_plain_name(load):
    assert "omni.placements" not in load("", OMNI_DISABLED_PLUGINS="omni-core:omni.placements").names()
    assert "omni.placements" not in load("", OMNI_DISABLED_PLUGINS="omni.placements").names()
    assert "good" not in load("good", OMNI_DISABLED_PLUGINS="omnitest_good:good").names()


def test_unknown_plugin_names_in_the_environment_are_warnings_with_a_guess(load):
    plugins = load("godo", OMNI_DISABLED_PLUGINS="omni.relay")
    assert "OMNI_LOAD_PLUGINS: no installed plugin is called 'godo' (did you mean 'good'?)" in plugins.warnings
    assert "OMNI_DISABLED_PLUGINS: no installed plugin is called 'omni.relay' (did you mean 'omni.relays'?)" in plugins.warnings
    assert load("good").warnings == []


def test_test_file_basenames_are_unique_across_distributions():
    """The test folders have no ``__init__.py``: pytest imports each test file by its basename, so
    two distributions' ``test_x.py`` collected in one run clash ("import file mismatch")."""
    from pathlib import Path

    root = Path(__file__).parent.parent
    folders = [root / "tests", root / "contrib_stages" / "tests", *sorted((root / "plugins").glob("*/tests"))]
    seen: dict[str, list[str]] = {}
    for folder in folders:
        for path in folder.rglob("*.py"):
            if path.name != "conftest.py" and "__pycache__" not in path.parts:
                seen.setdefault(path.name, []).append(str(path.relative_to(root)))
    assert len(folders) > 3 and "test_plugins.py" in seen
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}

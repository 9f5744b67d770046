"""Capabilities and options schemas are registration metadata: ``auto`` planning and config
validation decide from them without importing any relay module (nor torch), and a relay plugin
whose module is broken breaks only the configs that name it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import pytest

from omni_core.config import collect_issues, structure
from omni_core.errors import PluginError
from omni_core.options import Option, OptionsError, parse_options, positive_int
from omni_core.plan import build_plan
from omni_core.plugins import hookimpl, load_plugins
from omni_core.relay import RelayCapabilities

CORE_ONLY = {"OMNI_LOAD_PLUGINS": ""}


def _core():
    return load_plugins(env=CORE_ONLY).registry


def _config(**pipeline):
    stages = pipeline.pop("stages", None) or [
        {"name": "a", "factory": "types:SimpleNamespace", "next": "b"},
        {"name": "b", "factory": "types:SimpleNamespace", "terminal": True},
    ]
    return structure({"name": "opts", "stages": stages, **pipeline})


def _messages(cfg, registry=None):
    return [str(i) for i in collect_issues(cfg, registry or _core())]


# -- options schemas -------------------------------------------------------------------------------


def test_a_forced_relay_s_options_are_checked_with_their_path():
    assert _messages(_config(relay={"backend": "shm", "options": {"slots": "8"}})) == [
        "relay.options.slots: expected a positive integer, got '8' (default 32) "
        "(slots per pool: credits per sender and target process)"
    ]


def test_an_unknown_option_gets_a_guess():
    (msg,) = _messages(_config(relay={"backend": "shm", "options": {"slot": 8}}))
    assert msg == "relay.options.slot: unknown option 'slot' for relay 'shm' (did you mean 'slots'?)"


def test_under_auto_each_relay_s_options_are_checked_against_its_own_schema():
    cfg = _config(relay={"backend": "auto", "options": {"shm": {"timeout": 0}, "inline": {"x": 1}}})
    assert [m.split(" (")[0] for m in _messages(cfg)] == [
        "relay.options.shm.timeout: expected a positive number, got 0",
        "relay.options.inline.x: unknown option 'x' for relay 'inline'",
    ]


def test_a_stage_s_relay_options_are_checked_too():
    stages = [
        {"name": "a", "factory": "types:SimpleNamespace", "next": "b", "relay": {"backend": "shm", "options": {"slots": -1}}},
        {"name": "b", "factory": "types:SimpleNamespace", "terminal": True},
    ]
    (msg,) = _messages(_config(stages=stages))
    assert msg.startswith("stages[0].relay.options.slots: expected a positive integer, got -1")


def test_placement_and_launcher_options_are_checked():
    cfg = _config(placement={"strategy": "pack", "options": {"cpu": 3}},
                  launcher={"name": "local", "options": {"start_method": "fork"}})
    assert [m.split(" (")[0] for m in _messages(cfg)] == [
        "placement.options.cpu: expected a string or a list of strings, got 3",
        "launcher.options.start_method: expected one of 'forkserver', 'spawn', got 'fork'",
    ]


def test_good_options_are_valid():
    cfg = _config(relay={"backend": "shm", "options": {"slots": 8, "timeout": 2.5}},
                  placement={"strategy": "spread", "options": {"cpu": ["a"], "default_memory": 0.2}},
                  launcher={"name": "local", "options": {"start_method": "spawn"}})
    assert _messages(cfg) == []


def test_parse_options_fills_defaults_and_raises_a_value_error_with_every_path():
    schema = {"slots": positive_int(4), "mode": Option("choice", "a", choices=("a", "b"))}
    assert parse_options(schema, {"slots": 2}) == {"slots": 2, "mode": "a"}
    with pytest.raises(OptionsError) as caught:
        parse_options(schema, {"slots": True, "mode": "c"}, "relay.options")
    assert isinstance(caught.value, ValueError)
    assert str(caught.value) == (
        "relay.options.slots: expected a positive integer, got True (default 4); "
        "relay.options.mode: expected one of 'a', 'b', got 'c' (default 'a')"
    )


# -- registration metadata -------------------------------------------------------------------------


def _plugin(**hooks):
    plugin = types.SimpleNamespace()
    for name, fn in hooks.items():
        setattr(plugin, name, hookimpl(fn))
    return plugin


def test_capabilities_and_options_are_kept_with_the_name():
    def omni_register_relays(register):
        register("meta.relay", "meta_pkg.relay:Relay", options={"slots": positive_int(2)},
                 capabilities={"devices": ["cuda"], "scopes": ["node"], "priority": 7})

    plugins = load_plugins(env=CORE_ONLY, extra=[("meta", _plugin(omni_register_relays=omni_register_relays))])
    entry = plugins.registry.get("relay", "meta.relay")
    assert entry.capabilities == RelayCapabilities(frozenset({"cuda"}), frozenset({"node"}), 7)
    assert entry.options["slots"].default == 2
    assert plugins.registry.get("relay", "shm").capabilities.priority == 10


@pytest.mark.parametrize("kwargs,error", [
    ({"capabilities": {"devices": ["tpu"]}}, "unknown value(s) 'tpu'"),
    ({"capabilities": {"speed": 1}}, "unknown key(s) speed"),
    ({"options": {"slots": 3}}, "option 'slots' must be an omni_core.options.Option or a mapping"),
    ({"options": {"slots": {"type": "integer"}}}, "unknown option type 'integer'"),
    ({"colour": "red"}, "unexpected keyword(s) colour for 'meta.relay'; a relay takes capabilities, options"),
])
def test_bad_metadata_is_a_plugin_error_naming_the_name(kwargs, error):
    def omni_register_relays(register):
        register("meta.relay", "meta_pkg.relay:Relay", **kwargs)

    plugins = load_plugins(env=CORE_ONLY, extra=[("meta", _plugin(omni_register_relays=omni_register_relays))])
    assert error in plugins.info("meta").error
    with pytest.raises(PluginError, match="meta.relay"):
        plugins.registry.get("relay", "meta.relay")


def test_stages_take_no_relay_metadata():
    def omni_register_stages(register):
        register("meta.stage", dict, capabilities={"devices": ["cpu"]})

    plugins = load_plugins(env=CORE_ONLY, extra=[("meta", _plugin(omni_register_stages=omni_register_stages))])
    assert "unexpected keyword(s) capabilities for 'meta.stage'" in plugins.info("meta").error


def test_a_relay_registered_lazily_without_capabilities_is_never_chosen_by_auto():
    def omni_register_relays(register):
        register("meta.fast", "meta_pkg.relay:Relay")  # no capabilities: auto cannot know

    registry = load_plugins(env=CORE_ONLY, extra=[("meta", _plugin(omni_register_relays=omni_register_relays))]).registry
    plan = build_plan(_config(), registry, gpus=0)
    assert [e.relay for e in plan.edges] == ["shm"]


# -- planning imports no relay ---------------------------------------------------------------------

PLAN_SCRIPT = textwrap.dedent("""
    import json, sys
    from omni_core.config import collect_issues, structure
    from omni_core.plan import build_plan
    from omni_core.plugins import load_plugins

    registry = load_plugins().registry
    cfg = structure({"name": "gpu", "relay": {"backend": "auto", "options": {"shm": {"slots": 4}}}, "stages": [
        {"name": "a", "factory": "types:SimpleNamespace", "gpu": 0, "next": ["b", "c"]},
        {"name": "b", "factory": "types:SimpleNamespace", "gpu": 1, "terminal": True},
        {"name": "c", "factory": "types:SimpleNamespace", "terminal": True},
    ]})
    issues = [str(i) for i in collect_issues(cfg, registry)]
    plan = build_plan(cfg, registry, gpus=2)
    heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")
                   or m.endswith(".relay") and m != "omni_core.relay" or m.startswith("omni_core.relay.")
                   and m not in ("omni_core.relay.base", "omni_core.relay.liveness",
                                 "omni_core.relay.specs"))  # the built-ins' registration metadata
    print(json.dumps({"edges": {f"{e.src}->{e.dst}": e.relay for e in plan.edges}, "issues": issues, "heavy": heavy}))
""")


def _plan_in_a_fresh_process(plugin_site_dir, selected):
    env = {"OMNI_LOAD_PLUGINS": selected, "PYTHONPATH": str(plugin_site_dir), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", PLAN_SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_auto_planning_and_validation_import_no_relay_module_nor_torch(plugin_site_dir):
    got = _plan_in_a_fresh_process(plugin_site_dir, "brokenrelay")
    assert got["heavy"] == []
    assert got["issues"] == []
    # the broken relay's module is never imported: it is not even noticed, and shm wins anyway
    assert got["edges"] == {"a->b": "shm", "a->c": "shm"}


def test_a_broken_relay_module_fails_only_configs_that_name_it(load):
    registry = load("brokenrelay").registry
    assert build_plan(_config(), registry, gpus=0).edges[0].relay == "shm"
    with pytest.raises(PluginError) as caught:
        registry.resolve("relay", "brokenrelay")
    assert str(caught.value).startswith(
        "relay 'brokenrelay' of plugin 'brokenrelay' (distribution omnitest-brokenrelay) cannot be "
        "loaded: cannot import module 'omnitest_brokenrelay.relay' of 'omnitest_brokenrelay.relay:BrokenRelay': "
        "omnitest_brokenrelay.relay needs a library that is not installed")
    cfg = _config(relay={"backend": "brokenrelay", "options": {"slots": 0}})
    assert [m.split(" (")[0] for m in _messages(cfg, registry)] == [
        "relay.options.slots: expected a positive integer, got 0"]


def test_an_unknown_name_that_an_omni_distribution_provides_says_what_to_install():
    problem = _core().problem("relay", "nccl")
    assert "'nccl' is provided by the distribution omni-nccl: install it from its folder in the omni " \
           "repository (pip install ./plugins/omni-nccl)" in problem
    assert "omni-contrib-stages" in _core().problem("stage", "contrib.tee")
    assert "provided by" not in _core().problem("relay", "nope")


def test_the_tp_backend_is_chosen_per_device_by_the_plan():
    from omni_core.plan.topology import TP_BACKENDS, ProcessSpec

    assert ProcessSpec(name="t.0", group="t", stages=("t",), tp_size=2).tp_backend == TP_BACKENDS["cpu"] == "gloo"
    assert ProcessSpec(name="t.1", group="t", stages=("t",), tp_size=2, gpu=1).tp_backend == "nccl"


def test_a_serve_api_s_options_are_checked_against_its_declared_schema():
    def omni_register_apis(register):
        register("meta.api", "meta_api:make_routes", options={"greeting": Option("str", "hi", "what it says"),
                                                              "limit": positive_int(8, "at most this many"),
                                                              "voice": Option("str", None, nullable=True)})

    registry = load_plugins(env=CORE_ONLY, extra=[("meta", _plugin(omni_register_apis=omni_register_apis))]).registry
    ok = _config(serve={"apis": ["meta.api"], "options": {"meta.api": {"greeting": "yo", "voice": None}}})
    assert _messages(ok, registry) == []
    bad = _config(serve={"apis": ["meta.api"], "options": {"meta.api": {"limit": "8", "greting": "x", "voice": 3}}})
    assert _messages(bad, registry) == [
        "serve.options.meta.api.limit: expected a positive integer, got '8' (default 8) (at most this many)",
        "serve.options.meta.api.greting: unknown option 'greting' for API 'meta.api' (did you mean 'greeting'?)",
        "serve.options.meta.api.voice: expected a string or null, got 3",
    ]


def test_an_api_s_chat_route_is_registration_metadata_and_a_bad_one_is_refused():
    def good(register):
        register("meta.chat", "meta_api:make_routes", chat="/v1/chat/completions")

    registry = load_plugins(env=CORE_ONLY, extra=[("meta", _plugin(omni_register_apis=good))]).registry
    assert registry.get("api", "meta.chat").meta["chat"] == "/v1/chat/completions"

    def bad(register):
        register("meta.chat", "meta_api:make_routes", chat="v1/chat")

    plugins = load_plugins(env=CORE_ONLY, extra=[("meta", _plugin(omni_register_apis=bad))])
    errors = [i.error for i in plugins.infos if i.error]
    assert len(errors) == 1 and "chat= takes the path of its OpenAI-style chat completions route" in errors[0]
    assert "'v1/chat'" in errors[0] and "meta.chat" not in plugins.registry.names("api")

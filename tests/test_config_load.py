"""Loading configs: YAML and TOML alike, mappings, registered pipelines, defaults, shorthands,
and the reference in docs/config.md kept in step with the schema."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plugin_fixtures import DEMO_PIPELINE

import omni_core
from omni_core.config import (
    LauncherConfig,
    PipelineConfig,
    RelayConfig,
    StageConfig,
    load_config,
    read_config_file,
    schema,
    structure,
    to_dict,
)
from omni_core.errors import ConfigError
from omni_core.plugins import hookimpl, load_plugins

GOOD = Path(__file__).parent / "configs" / "good"
DOCS = Path(__file__).parent.parent / "docs" / "config.md"


@pytest.mark.parametrize("name", sorted(p.stem for p in GOOD.glob("*.yaml")))
def test_yaml_and_toml_of_the_same_pipeline_load_to_equal_configs(name, registry):
    from_yaml = load_config(GOOD / f"{name}.yaml", registry=registry)
    from_toml = load_config(GOOD / f"{name}.toml", registry=registry)
    assert from_yaml == from_toml
    assert from_yaml.name and from_yaml.stages


def test_every_good_yaml_config_has_a_toml_twin():
    assert {p.stem for p in GOOD.glob("*.yaml")} == {p.stem for p in GOOD.glob("*.toml")}


def test_loaded_config_holds_what_the_file_says(registry):
    cfg = load_config(GOOD / "omni_like.yaml", registry=registry)
    assert cfg.entry == "router"
    assert cfg.relay == RelayConfig(backend="shm")
    assert cfg.launcher == LauncherConfig(name="local", options={"start_method": "spawn"})
    assert cfg.env_defaults == {"OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    assert cfg.endpoints.port_range == (20000, 20100)
    assert cfg.limits.startup_timeout == 30.0 and isinstance(cfg.limits.startup_timeout, float)
    assert cfg.restart.policy == "on-failure"
    thinker = cfg.stage("thinker")
    assert thinker.wait_for == ("audio", "vision")
    assert thinker.stream_to == ("talker",)
    assert thinker.gpu == (2, 3)
    assert cfg.stage("vision").gpu == (1,)
    assert cfg.stage("vision").memory == 2.5e9
    assert cfg.stage("vision").relay == RelayConfig(backend="shm", options={"slots": 8})
    assert cfg.stage("router").project_payload == {"audio": "acme.project"}
    assert cfg.terminal_stages == ["talker"]


def test_defaults_of_a_minimal_config(registry):
    cfg = load_config({"name": "m", "stages": [{"name": "only", "factory": "acme.upper", "terminal": True}]},
                      registry=registry)
    assert cfg.entry == "only"
    assert cfg.relay == RelayConfig(backend="auto")
    assert cfg.launcher.name == "local"
    assert cfg.placement.strategy == "explicit"
    assert cfg.restart.policy == "never"
    assert cfg.limits.max_in_flight == 1024
    assert not cfg.allow_cycles and not cfg.allow_pickle
    stage = cfg.stages[0]
    assert stage == StageConfig(name="only", factory="acme.upper", terminal=True)
    assert (stage.tp_size, stage.replicas, stage.gpu, stage.process) == (1, 1, None, None)


def test_a_pipeline_config_passes_through_unchanged(registry):
    cfg = load_config(GOOD / "linear.yaml", registry=registry)
    assert load_config(cfg, registry=registry) is cfg


def test_mapping_and_file_load_to_equal_configs(registry):
    data = read_config_file(GOOD / "linear.yaml")
    assert load_config(data, registry=registry) == load_config(GOOD / "linear.yaml", registry=registry)


def test_json_files_load_too(tmp_path, registry):
    path = tmp_path / "linear.json"
    path.write_text(json.dumps(read_config_file(GOOD / "linear.yaml")))
    assert load_config(path, registry=registry) == load_config(GOOD / "linear.yaml", registry=registry)


def test_yaml_exponent_numbers_are_numbers(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("name: p\nstages: [{name: a, factory: x:y, terminal: true, memory: 1e9}]\n")
    assert load_config(path, validate=False).stages[0].memory == 1e9


def test_validation_can_be_skipped():
    cfg = load_config({"name": "p", "stages": [{"name": "a", "factory": "nowhere.at_all"}]}, validate=False)
    assert cfg.stages[0].factory == "nowhere.at_all"


def test_load_config_is_exported_at_the_top_level():
    assert omni_core.load_config is load_config
    assert omni_core.PipelineConfig is PipelineConfig


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("missing.yaml", "cannot read missing.yaml: No such file or directory"),
        ("missing.toml", "cannot read missing.toml: No such file or directory"),
        ("missing", "'missing' is neither a config file nor a registered pipeline: unknown pipeline 'missing'"),
    ],
)
def test_missing_config_says_what_was_looked_for(name, message, tmp_path, monkeypatch, registry):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        load_config(name, registry=registry)
    assert message in str(caught.value)


def test_unknown_file_type_is_an_error(tmp_path):
    path = tmp_path / "pipeline.ini"
    path.write_text("[x]\n")
    with pytest.raises(ConfigError, match=r"unknown config file type '.ini' \(use .yaml, .yml, .toml or .json\)"):
        load_config(path)


def test_toml_syntax_error_names_the_file(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("name = [1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value).startswith(f"invalid pipeline config {path}: 1 error\n  - <config>: cannot parse: ")


def test_structure_and_graph_errors_of_a_mapping_are_config_errors():
    with pytest.raises(ConfigError) as caught:
        load_config({"name": "p", "stages": [{"name": "a", "factory": "x:y", "colour": "red"}]})
    found = [(i.path, i.message) for i in caught.value.issues]
    # the structural error first, then what the graph rules find in the rest, in the same pass
    assert found[0] == ("stages[0].colour", "unknown key")
    assert ("stages[0]", "stage 'a' has neither 'next' nor 'terminal: true'") in found
    with pytest.raises(ConfigError, match="expected a mapping at the top level, got 'p' \\(str\\)"):
        structure("p")


# -- registered pipelines -------------------------------------------------------------------------


def test_pipeline_shipped_as_a_package_file_loads_by_name(load):
    cfg = load_config("acme.demo", registry=load("good").registry)
    assert cfg.name == "acme-demo"
    assert cfg.stage("shout").args == {"prefix": "> "}


def test_pipeline_registered_as_a_mapping_loads_by_name(load):
    cfg = load_config("acme.inline", registry=load("good").registry)
    assert cfg.stage_names == ["up"]


def test_registered_pipeline_name_uses_the_installed_plugins_by_default(plugin_site, monkeypatch):
    monkeypatch.setenv("OMNI_LOAD_PLUGINS", "good")
    assert load_config("acme.demo").stage_names == ["shout", "echo"]


def test_registered_pipeline_errors_name_the_pipeline_and_plugin(plugin_site):
    class Plugin:
        @hookimpl
        def omni_register_pipelines(self, register):
            register("p.bad", {"name": "bad", "stages": [{"name": "a", "factory": "acme.upper", "nxt": "b"}]})

    registry = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("pp", Plugin())]).registry
    with pytest.raises(ConfigError) as caught:
        load_config("p.bad", registry=registry)
    assert caught.value.source == "'p.bad' (registered by plugin 'pp')"
    assert caught.value.issues[0].path == "stages[0].nxt"


def _pipelines_plugin(tmp_path: Path):
    path = tmp_path / "from_path.yaml"
    path.write_text("name: from-path\nstages: [{name: a, factory: acme.upper, terminal: true}]\n")

    class Plugin:
        @hookimpl
        def omni_register_pipelines(self, register):
            register("p.callable", lambda: DEMO_PIPELINE)
            register("p.dotted", "plugin_fixtures:DEMO_PIPELINE")
            register("p.path", str(path))
            register("p.pathlike", path)
            register("p.fails", lambda: 1 / 0)
            register("p.missing_resource", "plugin_fixtures:nothing.yaml")
            register("p.number", lambda: 42)

    return load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("pp", Plugin())]).registry


@pytest.mark.parametrize(
    ("name", "stage_names"),
    [
        ("p.callable", ["a", "b"]),
        ("p.dotted", ["a", "b"]),
        ("p.path", ["a"]),
        ("p.pathlike", ["a"]),
    ],
)
def test_pipeline_registrations_of_every_form_load(name, stage_names, tmp_path):
    cfg = load_config(name, registry=_pipelines_plugin(tmp_path), validate=False)
    assert cfg.stage_names == stage_names


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("p.fails", "pipeline 'p.fails' of plugin 'pp' could not be built: ZeroDivisionError"),
        ("p.missing_resource", "pipeline 'p.missing_resource' of plugin 'pp' names 'plugin_fixtures:nothing.yaml', which cannot be read"),
        ("p.number", "pipeline 'p.number' of plugin 'pp' is a int, not a mapping"),
    ],
)
def test_broken_pipeline_registrations_are_config_errors(name, fragment, tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_config(name, registry=_pipelines_plugin(tmp_path))
    assert fragment in str(caught.value)


# -- round trip ---------------------------------------------------------------------------------------

names = st.text(alphabet="abcdefgh", min_size=1, max_size=6)


@st.composite
def pipelines(draw):
    stage_names = draw(st.lists(names, min_size=1, max_size=5, unique=True))
    stages = []
    for i, name in enumerate(stage_names):
        later = stage_names[i + 1:]
        tp_size = draw(st.integers(1, 4))
        stages.append({
            "name": name,
            "factory": draw(st.sampled_from(["acme.upper", "pkg.mod:Factory"])),
            "args": draw(st.dictionaries(names, st.integers() | st.text(max_size=3), max_size=2)),
            **({"next": later[:1]} if later else {"terminal": True}),
            # a list gives one id per rank; a single id is the short form
            "gpu": draw(st.none() | st.integers(0, 7) | st.lists(st.integers(0, 7), min_size=tp_size, max_size=tp_size)),
            "tp_size": tp_size,
            "env": draw(st.dictionaries(names, names, max_size=2)),
            "relay": draw(st.none() | st.sampled_from(["shm", "inline"])),
            "process": draw(st.none() | names),
        })
    return {
        "name": draw(names),
        "stages": stages,
        "relay": draw(st.sampled_from(["auto", "shm", {"backend": "inline", "options": {"x": 1}}])),
        "endpoints": {"port_range": draw(st.none() | st.just([2000, 3000]))},
        "limits": {"request_timeout": draw(st.none() | st.floats(0.1, 100))},
    }


@settings(max_examples=50, deadline=None)
@given(pipelines())
def test_config_survives_to_dict_and_back(data):
    cfg = structure(data)
    assert structure(to_dict(cfg)) == cfg
    assert structure(json.loads(json.dumps(to_dict(cfg)))) == cfg


# -- docs/config.md -------------------------------------------------------------------------------------

HEADING = re.compile(r"^#+ .*\(`(?P<cls>[A-Za-z]+Config)`\)\s*$")
CELL = r"(?:[^|\\]|\\.)+"  # a table cell; "\|" inside it is a literal bar
ROW = re.compile(rf"^\| `(?P<field>[a-z_]+)` \| (?P<type>{CELL}) \| (?P<default>{CELL}) \| {CELL} \|$")


def documented_fields() -> dict[str, dict[str, tuple[str, str]]]:
    """``{class name: {field: (type, default)}}`` from the tables of docs/config.md."""
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    current = None
    for line in DOCS.read_text().splitlines():
        if heading := HEADING.match(line):
            current = tables.setdefault(heading["cls"], {})
        elif (row := ROW.match(line)) and current is not None:
            assert row["field"] not in current, f"{row['field']} documented twice"
            current[row["field"]] = (row["type"].strip(), row["default"].strip())
    return tables


def schema_classes() -> dict[str, type]:
    return {
        name: cls for name, cls in vars(schema).items()
        if isinstance(cls, type) and attrs.has(cls) and cls.__module__ == schema.__name__
    }


def test_every_schema_class_has_a_section_in_the_config_reference():
    assert set(documented_fields()) == set(schema_classes())


@pytest.mark.parametrize("cls_name", sorted(schema_classes()))
def test_config_reference_documents_exactly_the_fields_of_the_schema(cls_name):
    documented = documented_fields()[cls_name]
    fields = [f.name for f in attrs.fields(schema_classes()[cls_name])]
    assert sorted(documented) == sorted(fields), "docs/config.md and omni_core/config/schema.py differ"


def _default_text(field: attrs.Attribute) -> str | None:
    """How the reference writes a field's default; None when it is described in words."""
    if field.default is attrs.NOTHING:
        return "required"
    if isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
        made = field.default.factory()
        if attrs.has(type(made)):
            return None
        return "`{}`" if isinstance(made, dict) else "`[]`"
    value = field.default
    if value == ():
        return "`[]`"
    return f"`{json.dumps(value)}`"


@pytest.mark.parametrize("cls_name", sorted(schema_classes()))
def test_config_reference_shows_the_schema_defaults(cls_name):
    documented = documented_fields()[cls_name]
    for field in attrs.fields(schema_classes()[cls_name]):
        expected = _default_text(field)
        if expected is not None:
            assert documented[field.name][1] == expected, f"{cls_name}.{field.name}"


def test_config_reference_names_the_choices_of_literal_fields():
    for cls_name, cls in schema_classes().items():
        hints = typing.get_type_hints(cls)
        for field in attrs.fields(cls):
            if typing.get_origin(hints[field.name]) is typing.Literal:
                for choice in typing.get_args(hints[field.name]):
                    assert f"`{choice}`" in documented_fields()[cls_name][field.name][0]

"""`omni validate CONFIG`, `omni --version`, `omni --help`."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from plugin_fixtures import run_omni
from typer.testing import CliRunner

from omni_core import __version__
from omni_core.cli import app

runner = CliRunner()

GOOD_CONFIG = """
    name: speech
    launcher: acme.launcher
    stages:
      - {name: encoder, factory: acme.upper, next: [thinker, talker], process: front}
      - {name: thinker, factory: acme.upper, next: talker, process: front}
      - {name: talker, factory: acme.lazy, wait_for: [encoder, thinker], merge_fn: acme.join, terminal: true}
"""

BAD_CONFIG = """
    name: speech
    launcher: acme.launcher
    stages:
      - {name: encoder, factory: acme.uper, next: thinker}
      - {name: thinker, factory: acme.upper, wait_for: [encoder], terminal: true}
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_valid_config_exits_0_with_a_one_line_summary(tmp_path, plugin_site_dir):
    path = write(tmp_path, "speech.yaml", GOOD_CONFIG)
    result = run_omni("validate", str(path), pythonpath=plugin_site_dir, env={"OMNI_LOAD_PLUGINS": "good"})
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"{path}: valid pipeline 'speech': 3 stages, 2 process groups, entry 'encoder', terminal talker\n"
    )


def test_invalid_config_exits_1_with_every_error(tmp_path, plugin_site_dir):
    path = write(tmp_path, "speech.yaml", BAD_CONFIG)
    result = run_omni("validate", str(path), pythonpath=plugin_site_dir, env={"OMNI_LOAD_PLUGINS": "good"})
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == f"invalid pipeline config {path}: 2 errors"
    assert lines[1] == (
        "  - stages[1].wait_for: stage 'thinker' waits for ['encoder'] but has no merge_fn "
        "(add 'merge_fn: omni.merge_dicts' (or omni.by_source, or your own))"
    )
    assert lines[2].startswith(
        "  - stages[0].factory: unknown stage factory 'acme.uper' (did you mean 'acme.upper'?); known: acme.lazy, acme.upper"
    )


def test_config_naming_what_a_broken_plugin_provides_fails_with_that_plugins_error(tmp_path, plugin_site_dir):
    path = write(tmp_path, "p.yaml", """
        name: p
        launcher: acme.launcher
        stages: [{name: a, factory: broken.stage, terminal: true}]
    """)
    result = run_omni("validate", str(path), pythonpath=plugin_site_dir, env={"OMNI_LOAD_PLUGINS": "good,broken"})
    assert result.returncode == 1
    assert (
        "stages[0].factory: stage factory 'broken.stage' is not available: plugin 'broken' "
        "(distribution omnitest-broken) failed to load: ModuleNotFoundError"
    ) in result.stderr


def test_registered_pipeline_validates_by_name(plugin_site, monkeypatch):
    monkeypatch.setenv("OMNI_LOAD_PLUGINS", "good")
    result = runner.invoke(app, ["validate", "acme.demo"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("acme.demo: valid pipeline 'acme-demo': 2 stages")


def test_json_output_of_a_valid_config(tmp_path, plugin_site, monkeypatch):
    monkeypatch.setenv("OMNI_LOAD_PLUGINS", "good")
    result = runner.invoke(app, ["validate", "--json", str(write(tmp_path, "p.yaml", GOOD_CONFIG))])
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"valid": True, "name": "speech", "stages": ["encoder", "thinker", "talker"]}


def test_json_output_of_an_invalid_config_lists_path_message_and_hint(tmp_path, plugin_site, monkeypatch):
    monkeypatch.setenv("OMNI_LOAD_PLUGINS", "good")
    result = runner.invoke(app, ["validate", "--json", str(write(tmp_path, "p.yaml", BAD_CONFIG))])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["valid"] is False
    assert [e["path"] for e in report["errors"]] == ["stages[1].wait_for", "stages[0].factory"]
    assert report["errors"][0]["hint"].startswith("add 'merge_fn: omni.merge_dicts'")


def test_serve_apis_and_every_other_error_are_reported_in_one_run(tmp_path, plugin_site, monkeypatch):
    """An API no plugin registered (what `omni serve` refuses), a structural error and the graph
    errors of the rest: one run of `omni validate` names them all."""
    monkeypatch.setenv("OMNI_LOAD_PLUGINS", "good")
    text = BAD_CONFIG + "      - {name: tail, factory: acme.upper, terminal: yes, colour: red}\n    serve: {apis: [nope]}\n"
    result = runner.invoke(app, ["validate", "--json", str(write(tmp_path, "p.yaml", text))])
    assert result.exit_code == 1, result.output
    errors = {e["path"]: e["message"] for e in json.loads(result.stdout)["errors"]}
    assert errors.keys() == {"stages[2].colour", "stages[1].wait_for", "stages[2]", "stages[0].factory", "serve.apis[0]"}
    assert errors["serve.apis[0]"].startswith("unknown API 'nope'")
    assert "not reachable" in errors["stages[2]"]


def test_serve_apis_of_an_installed_plugin_validate(tmp_path, plugin_site, monkeypatch):
    monkeypatch.setenv("OMNI_LOAD_PLUGINS", "good")
    result = runner.invoke(app, ["validate", str(write(tmp_path, "p.yaml", GOOD_CONFIG + "    serve: {apis: [acme.api]}\n"))])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("nowhere.yaml", "cannot read nowhere.yaml: No such file or directory"),
        ("nowhere", "'nowhere' is neither a config file nor a registered pipeline"),
    ],
)
def test_missing_config_exits_1_and_says_what_was_looked_for(arg, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["validate", arg])
    assert result.exit_code == 1
    assert message in result.stderr


def test_version_option_prints_the_version():
    result = run_omni("--version")
    assert result.returncode == 0
    assert result.stdout == f"omni {__version__}\n"


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("plugins", "validate"):
        assert command in result.stdout
    assert "omni plugins list" in result.stdout


def test_validate_help_describes_the_argument():
    result = runner.invoke(app, ["validate", "--help"])
    assert result.exit_code == 0
    assert "registered pipeline name" in result.stdout


def test_validate_checks_placement_against_simulated_gpus(tmp_path):
    path = tmp_path / "gpu.yaml"
    path.write_text(textwrap.dedent("""
        name: gpu
        stages:
          - name: a
            factory: collections:Counter
            gpu: 3
            terminal: true
    """))
    too_few = runner.invoke(app, ["validate", str(path), "--gpus", "2"])
    assert too_few.exit_code == 1
    assert "stages[0].gpu" in too_few.stderr and "GPU 3" in too_few.stderr and str(path) in too_few.stderr
    assert runner.invoke(app, ["validate", str(path), "--gpus", "4"]).exit_code == 0

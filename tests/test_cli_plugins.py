"""`omni plugins list`: the table, --json and --hook, with real installed plugins, broken ones
included (listing never fails because of a plugin)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from plugin_fixtures import BROKEN, GOOD, FakeDistribution, install_distribution, run_omni
from typer.testing import CliRunner

from omni_core.cli import app
from omni_core.plugins import HOOK_NAMES

runner = CliRunner()


def omni_in_process(*args: str):
    return runner.invoke(app, list(args))


# -- in a fresh process, plugins found through PYTHONPATH ------------------------------------------


def test_table_lists_plugins_and_shows_a_broken_one_with_its_error(plugin_site_dir):
    result = run_omni("plugins", "list", pythonpath=plugin_site_dir,
                      env={"OMNI_LOAD_PLUGINS": "good,broken"})
    assert result.returncode == 0, result.stderr
    table = result.stdout
    for text in ("good", GOOD.name, GOOD.version, "acme.upper", "acme.pick", "ok (built-in)",
                 "broken", BROKEN.name, BROKEN.version, "error: ModuleNotFoundError"):
        assert text in table
    assert (
        "1 plugin(s) with errors; names they would provide are unavailable:\n"
        f"  broken (distribution {BROKEN.name} {BROKEN.version}, entry point broken = omnitest_broken): "
        "ModuleNotFoundError: No module named 'omnitest_dependency_that_is_not_installed'\n"
    ) in result.stderr


def test_json_lists_every_plugin_with_name_version_hooks_registered_and_error(plugin_site_dir):
    result = run_omni("plugins", "list", "--json", pythonpath=plugin_site_dir,
                      env={"OMNI_LOAD_PLUGINS": "good,broken,misspelled,raises"})
    assert result.returncode == 0, result.stderr
    listed = {p["name"]: p for p in json.loads(result.stdout)}
    for plugin in listed.values():
        assert {"name", "version", "hooks", "registered", "error", "distribution", "module"} <= set(plugin)
    good = listed["good"]
    assert good["version"] == GOOD.version and good["distribution"] == GOOD.name
    assert good["hooks"] == list(HOOK_NAMES)
    assert good["registered"]["stage"] == ["acme.upper", "acme.lazy"]
    assert good["registered"]["merge"] == ["acme.join"]
    assert good["error"] is None
    assert listed["broken"]["error"].startswith("ModuleNotFoundError: No module named")
    assert listed["broken"]["registered"] == {}
    assert "unknown hook 'omni_register_stage'" in listed["misspelled"]["error"]
    assert listed["raises"]["error"] == "hook omni_register_stages raised RuntimeError: model catalogue not found"
    assert all(listed[name]["builtin"] for name in ("omni.functions", "omni.placements", "omni.relays"))


def test_json_reports_a_name_conflict_naming_both_plugins(plugin_site_dir):
    result = run_omni("plugins", "list", "--json", pythonpath=plugin_site_dir,
                      env={"OMNI_LOAD_PLUGINS": "dup_a,dup_b"})
    assert result.returncode == 0
    listed = {p["name"]: p for p in json.loads(result.stdout)}
    assert "stage 'shared.stage' is also registered by plugin 'dup_a'" in listed["dup_b"]["error"]


def test_disabled_plugin_is_not_listed(plugin_site_dir):
    result = run_omni("plugins", "list", "--json", pythonpath=plugin_site_dir,
                      env={"OMNI_DISABLED_PLUGINS": "disabled,broken"})
    assert result.returncode == 0
    names = {p["name"] for p in json.loads(result.stdout)}
    assert {"good", "raises", "dup_a"} <= names
    assert not names & {"disabled", "broken"}


# -- in this process ---------------------------------------------------------------------------------


@pytest.mark.parametrize("hook", ["relays", "omni_register_relays"])
def test_hook_option_keeps_only_plugins_implementing_it(hook, plugin_site, monkeypatch):
    monkeypatch.setenv("OMNI_LOAD_PLUGINS", "good,dup_a")
    result = omni_in_process("plugins", "list", "--json", "--hook", hook)
    assert result.exit_code == 0, result.output
    names = [p["name"] for p in json.loads(result.stdout)]
    assert names == ["omni.relays", "good"]


def test_unknown_hook_option_is_a_usage_error_listing_the_hooks():
    result = omni_in_process("plugins", "list", "--hook", "omni_register_stage")
    assert result.exit_code == 2
    assert result.stderr.startswith(
        "error: unknown hook 'omni_register_stage' (did you mean 'omni_register_stages'?); hooks are: omni_register_stages,")


def test_a_short_hook_name_gets_a_short_guess():
    result = omni_in_process("plugins", "list", "--hook", "relay")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: unknown hook 'relay' (did you mean 'relays'?); hooks are:")


def test_errors_are_shown_as_text_never_as_markup(tmp_path, monkeypatch):
    install_distribution(tmp_path, FakeDistribution(
        name="omnitest-markup", version="1.0", entry_points={"markup": "omnitest_markup"},
        files={"omnitest_markup.py": '''
            raise ImportError("needs [/bold] and [red]x[/red]")
        '''},
    ))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("OMNI_LOAD_PLUGINS", "markup")
    try:
        result = omni_in_process("plugins", "list")
    finally:
        sys.modules.pop("omnitest_markup", None)
    assert result.exit_code == 0, result.output
    assert "needs [/bold] and [red]x[/red]" in result.stderr
    assert "[/bold]" in result.stdout


# -- a plugin really installed by pip ------------------------------------------------------------------

PIPPED_PYPROJECT = """
    [build-system]
    requires = ["setuptools>=64"]
    build-backend = "setuptools.build_meta"

    [project]
    name = "omnitest-pipped"
    version = "0.7.1"
    dependencies = []

    [project.entry-points.omni]
    pipped = "omnitest_pipped"

    [tool.setuptools]
    py-modules = ["omnitest_pipped"]
"""

PIPPED_MODULE = """
    import omni_core


    class Echo:
        def __call__(self, payload, ctx):
            return payload


    @omni_core.hookimpl
    def omni_register_stages(register):
        register("pipped.echo", Echo, description="returns its payload")


    @omni_core.hookimpl
    def omni_register_launchers(register):
        register("pipped.launcher", Echo)
"""


@pytest.mark.timeout(60)
def test_plugin_installed_with_pip_is_listed_and_usable_in_configs(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(textwrap.dedent(PIPPED_PYPROJECT))
    (project / "omnitest_pipped.py").write_text(textwrap.dedent(PIPPED_MODULE))
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--target", str(target), str(project)],
        check=True, capture_output=True, text=True, timeout=55,
    )
    assert list(target.glob("omnitest_pipped-0.7.1.dist-info/entry_points.txt"))

    listed = run_omni("plugins", "list", "--json", pythonpath=target, env={"OMNI_LOAD_PLUGINS": "pipped"})
    assert listed.returncode == 0, listed.stderr
    pipped = {p["name"]: p for p in json.loads(listed.stdout)}["pipped"]
    assert pipped["distribution"] == "omnitest-pipped"
    assert pipped["version"] == "0.7.1"
    assert pipped["registered"] == {"stage": ["pipped.echo"], "launcher": ["pipped.launcher"]}

    config = tmp_path / "echo.yaml"
    config.write_text("name: echo\nlauncher: pipped.launcher\nstages: [{name: e, factory: pipped.echo, terminal: true}]\n")
    validated = run_omni("validate", str(config), pythonpath=target)
    assert validated.returncode == 0, validated.stderr
    assert "valid pipeline 'echo'" in validated.stdout

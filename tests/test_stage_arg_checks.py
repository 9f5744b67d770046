"""A stage factory's argument check (``register(name, factory, check=fn)``): ``omni validate``
reports what it finds at the stage's config path, and ``omni run`` / ``Pipeline.start`` stop on it
before any process starts, with the message once and no traceback. The CLI cases run the real
``omni`` console script with a plugin distribution installed in a site directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_fixtures import FakeDistribution, install_distribution
from runtime_helpers import arun, no_leaks  # noqa: F401

from omni_core.errors import ConfigError, ConfigIssue
from omni_core.plugins import load_plugins

OMNI = str(Path(sys.executable).parent / "omni")

pytestmark = pytest.mark.timeout(240)

CHECKED = FakeDistribution(
    name="omnitest-checked",
    version="1.0.0",
    entry_points={"checked": "omnitest_checked.plugin"},
    files={
        "omnitest_checked/__init__.py": "",
        "omnitest_checked/plugin.py": '''
            import omni_core


            @omni_core.hookimpl
            def omni_register_stages(register):
                register("checked.model", "omnitest_checked.stages:Model", check="omnitest_checked.checks:check_model")
                register("checked.buggy", "omnitest_checked.stages:Model", check="omnitest_checked.checks:buggy")
                register("checked.plain", "omnitest_checked.stages:Model")
        ''',
        "omnitest_checked/checks.py": '''
            from pathlib import Path

            from omni_core.errors import ConfigIssue


            def check_model(args, *, env, stage_name):
                model = args.get("model") or env.get("CHECKED_MODEL")
                if not model:
                    yield ConfigIssue("model", f"stage {stage_name!r} has no model: neither args.model nor CHECKED_MODEL is set",
                                      "set args.model to a checkpoint folder, or export CHECKED_MODEL")
                elif not (Path(model) / "config.json").is_file():
                    yield ConfigIssue("model", f"{model!r} is not a checkpoint folder (no config.json in it)",
                                      "point it at the folder that holds config.json")


            def buggy(args):
                return 1 / 0
        ''',
        "omnitest_checked/stages.py": '''
            class Model:
                def __init__(self, model: str | None = None):
                    self.model = model

                async def __call__(self, payload, ctx):
                    return {"model": self.model, **payload}
        ''',
    },
)

CONFIG = """
name: checked
stages:
  - {name: first, factory: checked.plain, next: llm}
  - {name: llm, factory: checked.model, terminal: true%s}
"""


@pytest.fixture
def site(tmp_path: Path) -> Path:
    install_distribution(tmp_path / "site", CHECKED)
    return tmp_path / "site"


def omni(cwd: Path, site: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "PYTEST_", "PYTHONPATH", "CHECKED_"))}
    base.update(PYTHONPATH=str(site), OMNI_LOAD_PLUGINS="checked", OMNI_LOG_FORMAT="json", **env)
    return subprocess.run([OMNI, *args], cwd=cwd, env=base, capture_output=True, text=True, timeout=200)


def write_config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "checked.yaml"
    path.write_text(CONFIG % extra)
    return path


def test_validate_reports_the_check_at_the_config_path_and_passes_a_good_model(tmp_path, site):
    config = write_config(tmp_path)
    result = omni(tmp_path, site, "validate", str(config))
    assert result.returncode == 1
    assert ("stages[1].args.model: stage 'llm' has no model: neither args.model nor CHECKED_MODEL is set "
            "(set args.model to a checkpoint folder, or export CHECKED_MODEL)") in result.stderr
    assert "Traceback" not in result.stderr
    as_json = json.loads(omni(tmp_path, site, "validate", str(config), "--json").stdout)
    assert as_json["errors"] == [{"path": "stages[1].args.model",
                                  "message": "stage 'llm' has no model: neither args.model nor CHECKED_MODEL is set",
                                  "hint": "set args.model to a checkpoint folder, or export CHECKED_MODEL"}]
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = omni(tmp_path, site, "validate", str(config), CHECKED_MODEL=str(empty))
    assert bad.returncode == 1 and f"stages[1].args.model: {str(empty)!r} is not a checkpoint folder" in bad.stderr
    (empty / "config.json").write_text("{}")
    assert omni(tmp_path, site, "validate", str(config), CHECKED_MODEL=str(empty)).returncode == 0
    # The stage's own env counts, as it will in its process; --shallow skips the checks.
    good = write_config(tmp_path, f", env: {{CHECKED_MODEL: {str(empty)!r}}}")
    assert omni(tmp_path, site, "validate", str(good)).returncode == 0
    assert omni(tmp_path, site, "validate", str(config), "--shallow").returncode == 0


@pytest.mark.usefixtures("no_leaks")
def test_run_fails_before_starting_any_process_with_the_message_once(tmp_path, site):
    config = write_config(tmp_path)
    result = omni(tmp_path, site, "run", str(config), "--input", '{"text": "x"}', "--log-level", "info")
    assert result.returncode == 1
    message = "stages[1].args.model: stage 'llm' has no model"
    lines = result.stderr.splitlines()
    assert sum(message in line for line in lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    events = [json.loads(line)["event"] for line in lines if line.startswith("{")]
    assert "process started" not in events and "pipeline starting" not in events


def test_a_check_that_raises_is_a_plugin_bug_at_the_stage_args(site, monkeypatch):
    from omni_core import Pipeline
    from omni_core.config import load_config, validate_config
    from omni_core.plugins import reset_plugins

    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("OMNI_LOAD_PLUGINS", "checked")
    monkeypatch.delenv("CHECKED_MODEL", raising=False)
    reset_plugins()
    cfg = load_config({"name": "b", "stages": [{"name": "s", "factory": "checked.buggy", "terminal": True}]})
    with pytest.raises(ConfigError) as caught:
        validate_config(cfg, import_factories=True)
    (issue,) = caught.value.issues
    assert issue.path == "stages[0].args"
    assert "the argument check of factory 'checked.buggy' raised ZeroDivisionError" in issue.message
    assert "report it there" in issue.hint
    validate_config(cfg)  # without the deep validation (the planner's, omni plan's) no check runs

    pipeline = Pipeline({"name": "m", "stages": [{"name": "s", "factory": "checked.model", "terminal": True}]})
    with pytest.raises(ConfigError, match=r"stages\[0\]\.args\.model: stage 's' has no model"):
        arun(pipeline.start())
    assert pipeline.state == "new" and not pipeline.handles

    # The same problem in several stages (one model path for all) is one issue naming the others.
    empty = site / "no-checkpoint"
    empty.mkdir()
    two = load_config({"name": "two", "env_defaults": {"CHECKED_MODEL": str(empty)}, "stages": [
        {"name": "a", "factory": "checked.model", "next": "b"},
        {"name": "b", "factory": "checked.plain", "next": "c"},
        {"name": "c", "factory": "checked.model", "terminal": True}]})
    with pytest.raises(ConfigError) as caught:
        validate_config(two, import_factories=True)
    (issue,) = caught.value.issues
    assert issue.path == "stages[0].args.model"
    assert issue.message == f"{str(empty)!r} is not a checkpoint folder (no config.json in it) (also stages[2])"


def plugin_registering(hook: str, **kw):
    """An in-tree plugin whose ``hook`` registers one thing with the keywords ``kw``."""
    from types import SimpleNamespace

    from omni_core import hookimpl

    @hookimpl
    def impl(register):
        register("x.thing", lambda: None, **kw)

    return SimpleNamespace(**{hook: impl})


def test_check_is_registration_metadata_of_stages_only():
    def check(args):
        return [ConfigIssue("", "never")]

    ok = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("p", plugin_registering("omni_register_stages", check=check))])
    assert ok.registry.get("stage", "x.thing").load_check() is check
    for hook, kw, error in [
        ("omni_register_stages", {"check": 42}, "check= takes a function or a 'package.module:function' path, got 42"),
        ("omni_register_stages", {"check": "no_colon"}, "got 'no_colon'"),
        ("omni_register_launchers", {"check": check}, "unexpected keyword(s) check"),
    ]:
        info = load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=[("p", plugin_registering(hook, **kw))]).info("p")
        assert info.error and error in info.error, (hook, info.error)

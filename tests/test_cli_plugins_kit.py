"""`omni plugins new`, `omni plugins check` and `omni plugins list` at 80 columns, through the
real `omni` console script: generated plugins are pip-installed and their own tests run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_fixtures import omni_command, run_omni

pytestmark = pytest.mark.timeout(600)


def _install(project: Path, site: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--target", str(site), str(project)],
        check=True, capture_output=True, text=True, timeout=120,
    )


def _env(site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMNI_LOAD_PLUGINS", "OMNI_DISABLED_PLUGINS")}
    env.update(PYTHONPATH=str(site), OMNI_LOG_LEVEL="WARNING", NO_COLOR="1", **extra)
    return env


# -- omni plugins new ------------------------------------------------------------------------------


def test_new_writes_a_complete_distribution(tmp_path):
    result = run_omni("plugins", "new", "acme", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    root = tmp_path / "omni-acme"
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == [
        "README.md", "constraints.txt", "omni_acme/__init__.py", "omni_acme/pipelines/example.yaml", "omni_acme/plugin.py",
        "omni_acme/stages.py", "pyproject.toml", "tests/test_omni_acme.py", "tox.ini",
    ]
    pyproject = (root / "pyproject.toml").read_text()
    assert 'name = "omni-acme"' in pyproject and 'acme = "omni_acme.plugin"' in pyproject
    assert "$" not in (root / "omni_acme" / "plugin.py").read_text()
    assert "py{310,311,312,313}-omni{installed,min}" in (root / "tox.ini").read_text()


def test_new_kind_relay_and_placement_write_their_modules(tmp_path):
    assert run_omni("plugins", "new", "rel", "--dir", str(tmp_path), "--kind", "relay").returncode == 0
    assert "class RelRelay(Relay):" in (tmp_path / "omni-rel" / "omni_rel" / "relay.py").read_text()
    assert "RelayConformance" in (tmp_path / "omni-rel" / "tests" / "test_omni_rel.py").read_text()
    assert run_omni("plugins", "new", "pl", "--dir", str(tmp_path), "--kind", "placement").returncode == 0
    assert "def round_robin(request" in (tmp_path / "omni-pl" / "omni_pl" / "placement.py").read_text()


@pytest.mark.parametrize("args,code,message", [
    (["Bad-Name"], 1, "error: invalid plugin name 'Bad-Name': use lower-case letters"),
    (["acme", "--kind", "relays"], 2, "error: unknown --kind 'relays' (did you mean 'relay'?); kinds: stage, relay, placement, launcher, api"),
])
def test_new_refuses_bad_input_without_a_traceback(tmp_path, args, code, message):
    result = run_omni("plugins", "new", *args, "--dir", str(tmp_path))
    assert result.returncode == code
    assert result.stderr.startswith(message) and "Traceback" not in result.stderr


def test_new_never_overwrites(tmp_path):
    (tmp_path / "omni-acme").mkdir()
    result = run_omni("plugins", "new", "acme", "--dir", str(tmp_path))
    assert result.returncode == 1
    assert "omni-acme already exists" in result.stderr


@pytest.mark.slow
def test_a_generated_stage_plugin_installs_passes_its_tests_runs_and_checks_clean(tmp_path):
    assert run_omni("plugins", "new", "kitdemo", "--dir", str(tmp_path)).returncode == 0
    project, site = tmp_path / "omni-kitdemo", tmp_path / "site"
    _install(project, site)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project,
                           env=_env(site), capture_output=True, text=True, timeout=300)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "4 passed" in tests.stdout
    ran = subprocess.run([*omni_command(), "run", "kitdemo.example", "--input", '{"text": "hello omni", "shout": true}'],
                         env=_env(site), capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout) == {"text": "HELLO OMNI!", "words": 2, "shout": True}
    checked = subprocess.run([*omni_command(), "plugins", "check", "omni-kitdemo"], env=_env(site),
                             capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines()[0] == "omni-kitdemo: ok"


# -- omni plugins check ----------------------------------------------------------------------------


def _check(plugin_site_dir, *dists):
    result = subprocess.run([*omni_command(), "plugins", "check", "--json", *dists], env=_env(plugin_site_dir),
                            capture_output=True, text=True, timeout=300)
    assert "Traceback" not in result.stderr
    return result.returncode, json.loads(result.stdout)


def test_check_reports_each_problem_with_the_plugin_the_name_and_a_fix(plugin_site_dir):
    code, report = _check(plugin_site_dir, "omnitest-broken", "omnitest-good", "omnitest-brokenrelay")
    assert code == 1 and report["ok"] is False
    (broken,) = report["distributions"]["omnitest-broken"]
    assert broken["plugin"] == "omnitest-broken:broken" and broken["problem"].startswith("ModuleNotFoundError")
    assert "does not import" in broken["fix"]
    good = {p["name"]: p for p in report["distributions"]["omnitest-good"]}
    assert good["acme.upper"]["problem"] == "stage factory 'acme.upper' is not namespaced by the plugin"
    assert good["acme.upper"]["fix"].startswith("rename it good.acme.upper")
    assert good["acme.upper"]["severity"] == "error"
    # names users type (omni serve --api NAME, omni run NAME) may stay short: a warning
    assert (good["acme.api"]["severity"], good["acme.api"]["problem"]) == (
        "warning", "API 'acme.api' is not namespaced by the plugin")
    relay = [p for p in report["distributions"]["omnitest-brokenrelay"] if p["severity"] == "error"]
    assert [p["name"] for p in relay] == ["brokenrelay"]
    assert "cannot import module 'omnitest_brokenrelay.relay'" in relay[0]["problem"]


def test_check_of_the_built_ins_is_clean_and_an_unknown_distribution_is_a_usage_error(plugin_site_dir):
    code, report = _check(plugin_site_dir, "omni-core")
    assert (code, report) == (0, {"ok": True, "distributions": {"omni-core": []}}), report
    result = run_omni("plugins", "check", "omnitest-godo", pythonpath=plugin_site_dir)
    assert result.returncode == 2
    assert "(did you mean 'omnitest-good'?)" in result.stderr


# -- omni plugins list at 80 columns -----------------------------------------------------------------


def test_list_fits_80_columns_wraps_between_names_and_aligns_hooks(plugin_site_dir):
    result = run_omni("plugins", "list", pythonpath=plugin_site_dir, env={"COLUMNS": "80", "OMNI_LOAD_PLUGINS": "good"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    functions = lines[lines.index("omni-core:omni.functions  0.1.0  ok (built-in)") + 1:][:3]
    assert functions == [
        "  functions   route            omni.route_all, omni.route_by_key",
        "              merge            omni.merge_dicts, omni.by_source",
        "              terminal_stages  omni.terminal_stages_from_inputs",
    ]
    registered = {name for line in lines if line.startswith("  ") for name in line[31:].split(", ") if name}
    assert "omni.terminal_stages_from_inputs" in registered, "a name was broken across lines"
    assert all(n.strip(",") in registered for n in ("acme.upper", "acme.lazy", "acme.join"))

"""`omni plugins new --kind launcher`, `--kind api` and `--kind family`: what they write, and that what they write
works as generated: installed, its own tests pass with pytest in its folder, `omni plugins check`
is clean, and the commands `omni plugins new` prints next (`omni run`, `omni serve` and the request
to the API) do what they say, through the real `omni` console script.

docs/plugins.md's tutorial (tests/test_plugins_tutorial.py) follows the same kinds on the page. The
family kind's run needs omni-transformers (the plugin-template tox env installs it; elsewhere that
test skips)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from plugin_fixtures import omni_command, run_omni

from omni_core.scaffold import KINDS, curl_command, new_plugin, run_command
from omni_core.testing.leaks import alive
from omni_core.testing.serve import ServerProcess

pytestmark = pytest.mark.timeout(600)

LAYOUT = {
    "launcher": ["omni_NAME/launcher.py", "omni_NAME/pipelines/example.yaml", "omni_NAME/plugin.py", "omni_NAME/stages.py"],
    "api": ["omni_NAME/api.py", "omni_NAME/pipelines/example.yaml", "omni_NAME/plugin.py", "omni_NAME/stages.py"],
    "family": ["omni_NAME/family.py", "omni_NAME/pipelines/example.yaml", "omni_NAME/plugin.py", "omni_NAME/stages.py",
               "omni_NAME/tiny.py"],
}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _install(site: Path, *projects: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(site), *map(str, projects)],
        check=True, capture_output=True, text=True, timeout=180,
    )


def _env(site: Path, *dists: str) -> dict[str, str]:
    """The generated plugins in ``site`` and nothing else installed (hermetic)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMNI_LOAD_PLUGINS", "OMNI_DISABLED_PLUGINS")}
    env.update(PYTHONPATH=str(site), OMNI_LOG_LEVEL="WARNING", NO_COLOR="1", OMNI_LOAD_PLUGINS=",".join(dists))
    return env


def test_the_kinds_are_known():
    assert list(KINDS) == ["stage", "relay", "placement", "launcher", "api", "family"]


@pytest.mark.parametrize("kind", ["launcher", "api", "family"])
def test_new_writes_a_complete_distribution_of_the_kind(tmp_path, kind):
    name = f"new{kind}"
    result = run_omni("plugins", "new", name, "--dir", str(tmp_path), "--kind", kind)
    assert result.returncode == 0, result.stderr
    root = tmp_path / f"omni-{name}"
    expected = ["README.md", "constraints.txt", f"omni_{name}/__init__.py", "pyproject.toml",
                f"tests/test_omni_{name}.py", "tox.ini"]
    expected += [f.replace("NAME", name) for f in LAYOUT[kind]]
    assert _files(root) == sorted(expected)
    for path in root.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert "$name" not in text and "$pkg" not in text and "${" not in text, path
            if path.suffix == ".py":
                compile(text, str(path), "exec")  # valid Python, whatever the name
    pyproject = (root / "pyproject.toml").read_text()
    assert f'name = "omni-{name}"' in pyproject and f'{name} = "omni_{name}.plugin"' in pyproject
    assert "py{310,311,312,313}-omni{installed,min}" in (root / "tox.ini").read_text()
    readme = (root / "README.md").read_text()
    hook = "families" if kind == "family" else f"{kind}s"
    assert f"omni plugins new {name} --kind {kind}" in readme and f"omni plugins list --hook {hook}" in readme
    lines = result.stdout.splitlines()
    assert f"  pip install -e '{root}[test]'" in lines and f"  omni plugins check omni-{name}" in lines
    if kind == "family":  # its pipeline runs on a checkpoint: the tiny one, served by its folder
        run = (f"python -m omni_transformers.tiny {name}-tiny --family {name} && "
               f"omni run {name}-tiny --input '{{\"text\": \"hello omni\"}}'")
        assert f"$ {run}" in readme and f"  {run}" in lines
        return
    assert f"$ omni run {name}.example" in readme
    assert f"  omni run {name}.example --input '{{\"text\": \"hello omni\"}}'" in lines


def test_the_family_kind_depends_on_omni_transformers_and_tox_finds_it_where_no_index_has_it(tmp_path):
    root = new_plugin("fam", tmp_path, "family")
    pyproject = (root / "pyproject.toml").read_text()
    assert '"omni-transformers>=0.1"' in pyproject and '"transformers>=5.24,<6"' in pyproject
    assert "    {env:OMNI_TRANSFORMERS:omni-transformers>=0.1}\n" in (root / "tox.ini").read_text()
    assert "OMNI_TRANSFORMERS" in (root / "README.md").read_text()
    assert "OMNI_TRANSFORMERS" not in (new_plugin("notfam", tmp_path, "stage") / "tox.ini").read_text()
    family = (root / "omni_fam" / "family.py").read_text()
    assert 'default_pipeline="fam.example"' in family and 'write_tiny="omni_fam.tiny:write_tiny"' in family


@pytest.mark.slow
def test_a_generated_family_passes_its_tests_checks_clean_and_serves_its_tiny_checkpoint(tmp_path):
    pytest.importorskip("omni_transformers", reason="the family kind is built on omni-transformers")
    site = tmp_path / "site"
    project = new_plugin("kitfam", tmp_path, "family")
    _install(site, project)
    env = _env(site, "omni-kitfam")
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project, env=env,
                           capture_output=True, text=True, timeout=500)
    assert tests.returncode == 0 and "3 passed" in tests.stdout, tests.stdout + tests.stderr
    checked = subprocess.run([*omni_command(), "plugins", "check", "omni-kitfam"], env=env, capture_output=True,
                             text=True, timeout=300)
    assert checked.returncode == 0 and checked.stdout.splitlines()[0] == "omni-kitfam: ok", checked.stdout
    # what `omni plugins new` prints next: the tiny checkpoint, then omni run on its folder
    ran = subprocess.run(["bash", "-c", run_command("kitfam", "family")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout.splitlines()[-1])
    assert result["sample_rate"] == 8000 and 1 <= len(result["token_ids"]) <= 8
    assert result["codes"] == [c for t in result["token_ids"] for c in (t % 16, t // 16 % 16)]


def test_the_api_kind_declares_what_its_tests_import_and_tells_how_to_serve_it(tmp_path):
    root = new_plugin("webby", tmp_path, "api")
    pyproject = (root / "pyproject.toml").read_text()
    assert 'test = ["pytest>=8", "pytest-timeout>=2.2", "httpx>=0.27"]' in pyproject
    assert '"starlette>=0.37"' in pyproject
    readme = (root / "README.md").read_text()
    assert "$ omni serve webby.example --port 8000" in readme and f"$ {curl_command('webby')}" in readme
    result = run_omni("plugins", "new", "webbier", "--dir", str(tmp_path), "--kind", "api")
    assert "  omni serve webbier.example --port 8000    # then, from another terminal:" in result.stdout.splitlines()


@pytest.mark.slow
def test_generated_launcher_and_api_plugins_pass_their_tests_check_clean_and_do_what_new_prints(tmp_path):
    site = tmp_path / "site"
    launcher, api = new_plugin("kitlaunch", tmp_path, "launcher"), new_plugin("kitapi", tmp_path, "api")
    _install(site, launcher, api)
    env = _env(site, "omni-kitlaunch", "omni-kitapi")
    for project, passed in ((launcher, "4 passed"), (api, "7 passed")):
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=project,
                               env=env, capture_output=True, text=True, timeout=400)
        assert tests.returncode == 0, tests.stdout + tests.stderr
        assert passed in tests.stdout, tests.stdout
    checked = subprocess.run([*omni_command(), "plugins", "check", "omni-kitlaunch", "omni-kitapi"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines()[:2] == ["omni-kitlaunch: ok", "omni-kitapi: ok"]

    # omni run through the launcher: its environment reached both stage processes
    ran = subprocess.run([*omni_command(), "run", "kitlaunch.example", "--input", '{"text": "hello omni"}'],
                         env=env, capture_output=True, text=True, timeout=180)
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)
    assert result["greetings"] == ["hello from kitlaunch.local"] * 2 and len(set(result["pids"])) == 2
    assert not any(alive(pid) for pid in result["pids"])

    # omni serve, then the request `omni plugins new` prints (sent to the server's actual port)
    curl = shlex.split(curl_command("kitapi"))
    url, body = curl[curl.index("-X") + 2], curl[curl.index("-d") + 1]
    with ServerProcess("kitapi.example", env=env) as server:
        port_url = url.replace("http://127.0.0.1:8000", server.url)
        answer = httpx.post(port_url, content=body, headers={"content-type": "application/json"}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"text": "HELLO OMNI", "stages": ["first", "last"], "pipeline": "kitapi-example"}
    assert server.returncode == 0, server.output()
    server.assert_nothing_left()


@pytest.mark.parametrize("kind", ["stage", "relay", "api"])
def test_the_generated_plugin_is_portable_no_path_of_this_checkout_no_local_torch_label(kind, tmp_path):
    """The generated files can be committed and used on another machine: tox.ini installs
    omni-core by requirement (OMNI_CORE / OMNI_CORE_MIN say where, when no index has it),
    constraints.txt pins torch's release without a local label (``+cpu`` is on no default index),
    and no generated file names a path of the checkout or the folder it was generated in
    (tests/generated_tox.py runs such a tox for real in the plugin-template env)."""
    from importlib import metadata

    from omni_core import __version__

    root = new_plugin("toxy", tmp_path, kind=kind)
    tox_ini = (root / "tox.ini").read_text()
    assert f"omniinstalled: {{env:OMNI_CORE:omni-core>={__version__}}}" in tox_ini
    assert f"omnimin: {{env:OMNI_CORE_MIN:omni-core=={__version__}}}" in tox_ini
    assert "PIP_CONSTRAINT = {toxinidir}/constraints.txt" in tox_ini
    pins = [line for line in (root / "constraints.txt").read_text().splitlines() if not line.startswith("#")]
    release = metadata.version("torch").split("+")[0]
    assert pins == [f"torch=={release}"]
    checkout = str(Path(__file__).resolve().parent.parent)
    for path in root.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert checkout not in text and str(tmp_path) not in text, f"{path.relative_to(root)} names a local path"
            assert "+cpu" not in text, f"{path.relative_to(root)} names the local label +cpu"
    readme = (root / "README.md").read_text()
    assert "$ pip install -e './omni-toxy[test]'" in readme
    assert "OMNI_CORE=/path/to/omni" in readme and "pytorch.org" in readme

"""docs/plugins/ has one page per distribution of this repository (plugins/* and contrib_stages),
every YAML config a page shows is valid as written (the checks of ``omni validate``: structure,
graph, names, options, factories imported and their arguments checked), every name the
distribution registers is on its page, and the distribution's README links to the page.

The checks load plugins the way omni does, in a fresh process. A distribution of the repository
that is not installed here is loaded from its folder instead (its plugin module, as its entry
point names it), so the pages are checked in every environment; a check skips only when what it
must import is missing here (transformers for omni-transformers' stages, say), and says what.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PAGES_DIR = ROOT / "docs" / "plugins"
#: Every distribution of the repository, by name: its folder and its ``[project]`` table.
PROJECTS = {}
for _folder in [*sorted((ROOT / "plugins").iterdir()), ROOT / "contrib_stages"]:
    if (_folder / "pyproject.toml").is_file():
        _project = tomllib.loads((_folder / "pyproject.toml").read_text())["project"]
        PROJECTS[_project["name"]] = (_folder, _project)
DISTRIBUTIONS = sorted(PROJECTS)
YAML = re.compile(r"^```yaml\n(.*?)^```", re.S | re.M)
#: A code span ``prefix.{a,b}`` on a page stands for the two names ``prefix.a`` and ``prefix.b``.
BRACES = re.compile(r"`([\w.]+)\.\{([\w,]+)\}`")
MISSING_MODULE = re.compile(r"No module named '([\w.]+)'")

#: Run in a fresh process: load the plugins (those of ``extra`` from their folders), then report
#: what each plugin registered and every config's problems.
CHECK = """
import importlib, json, sys
from omni_core.config.load import load_config
from omni_core.errors import ConfigError
from omni_core.plugins import load_plugins

job = json.loads(sys.argv[1])
extra = [(name, importlib.import_module(module)) for name, module in job["extra"]]
plugins = load_plugins(extra=extra)
errors = []
for path in job["configs"]:
    try:
        load_config(path, registry=plugins.registry, import_factories=True, serve=True)
        errors.append(None)
    except ConfigError as exc:
        errors.append(str(exc))
print(json.dumps({"plugins": [info.to_dict() for info in plugins.infos], "errors": errors}))
"""

pytestmark = pytest.mark.timeout(300)


def expand(text: str) -> str:
    return BRACES.sub(lambda m: " ".join(f"`{m[1]}.{part}`" for part in m[2].split(",")), text)


def installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def skip_if_missing(text: str, distributions: set[str]) -> None:
    """Skip when ``text`` (an import error) names a module this environment does not have."""
    for module in MISSING_MODULE.findall(text):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.skip(f"checking {', '.join(sorted(distributions))} needs the module {module!r}, which is not "
                        f"installed here (pip install -c constraints.txt the distribution's folder)")


def check(distributions: set[str], configs: list[Path], cwd: Path, **env: str) -> dict:
    """Load the plugins (the ``distributions`` not installed from their folders) and validate ``configs``."""
    extra, paths = [], []
    for name in sorted(d for d in distributions if not installed(d)):
        folder, project = PROJECTS[name]
        paths.append(str(folder))
        extra += [[entry, module] for entry, module in project["entry-points"]["omni"].items()]
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "PYTEST_", "PYTHONPATH"))}
    environment.update(env, PYTHONPATH=os.pathsep.join(paths))
    job = json.dumps({"extra": extra, "configs": [str(c) for c in configs]})
    result = subprocess.run([sys.executable, "-c", CHECK, job], cwd=cwd, env=environment, capture_output=True,
                            text=True, timeout=240)
    if result.returncode != 0:
        skip_if_missing(result.stderr, distributions)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_distribution_has_a_page():
    pages = {p.stem for p in PAGES_DIR.glob("*.md")}
    assert sorted(set(DISTRIBUTIONS) - pages) == [], "add docs/plugins/<distribution>.md for each"
    assert sorted(pages - set(DISTRIBUTIONS)) == [], "a page of docs/plugins/ names no distribution of the repository"


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_the_readme_links_its_page(distribution):
    folder, _ = PROJECTS[distribution]
    target = os.path.relpath(PAGES_DIR / f"{distribution}.md", folder)
    assert f"]({target})" in (folder / "README.md").read_text(encoding="utf-8"), \
        f"{distribution}'s README has no link to {target}"


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_the_page_names_every_entry_point_and_what_it_registers(distribution, tmp_path):
    page = expand((PAGES_DIR / f"{distribution}.md").read_text(encoding="utf-8"))
    entry_points = PROJECTS[distribution][1]["entry-points"]["omni"]
    for name, module in entry_points.items():
        assert f"`{name}`" in page and f"`{module}`" in page, f"entry point {name} = {module} is not on the page"
    found = check({distribution}, [], tmp_path)
    mine = [p for p in found["plugins"] if p["module"] in entry_points.values()]
    assert [p["error"] for p in mine] == [None] * len(entry_points), mine
    registered = {name for plugin in mine for names in plugin["registered"].values() for name in names}
    assert registered, f"{distribution} registers nothing"
    missing = sorted(name for name in registered if f"`{name}`" not in page)
    assert missing == [], f"docs/plugins/{distribution}.md does not name {missing}"


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_every_config_on_the_page_validates(distribution, tmp_path):
    blocks = YAML.findall((PAGES_DIR / f"{distribution}.md").read_text(encoding="utf-8"))
    assert blocks, f"docs/plugins/{distribution}.md shows no ```yaml config"
    needs = {distribution} | ({"omni-contrib-stages"} if any("contrib." in b for b in blocks) else set())
    configs = []
    for i, block in enumerate(blocks):
        configs.append(tmp_path / f"config{i + 1}.yaml")
        configs[-1].write_text(block)
    # The transformers stages' argument check wants a checkpoint folder (config.json in it);
    # validating loads nothing from it.
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    errors = check(needs, configs, tmp_path, OMNI_TRANSFORMERS_MODEL=str(checkpoint))["errors"]
    for error in filter(None, errors):
        skip_if_missing(error, needs)
    assert [f"{block}\n{error}" for block, error in zip(blocks, errors, strict=True) if error] == [], \
        f"docs/plugins/{distribution}.md shows configs that do not validate"

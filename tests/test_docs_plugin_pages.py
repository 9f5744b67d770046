"""docs/plugins/ has one page per distribution of this repository (plugins/* and contrib_stages),
every YAML config a page shows is valid for ``omni validate`` as written, every name the
distribution registers is on its page, and the distribution's README links to the page.

A page's configs need its distribution installed (and omni-contrib-stages where they use its
stages): where one is not, that page's checks skip, naming what to install. The development
environment has them all but omni-ray (Ray is large); its own tox env, ``ray``, has it.
"""

from __future__ import annotations

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
OMNI = str(Path(sys.executable).parent / "omni")
#: Every distribution of the repository, by name, with its folder.
DISTRIBUTIONS = {tomllib.loads((folder / "pyproject.toml").read_text())["project"]["name"]: folder
                 for folder in [*sorted((ROOT / "plugins").iterdir()), ROOT / "contrib_stages"]
                 if (folder / "pyproject.toml").is_file()}
YAML = re.compile(r"^```yaml\n(.*?)^```", re.S | re.M)
#: A code span ``prefix.{a,b}`` on a page stands for the two names ``prefix.a`` and ``prefix.b``.
BRACES = re.compile(r"`([\w.]+)\.\{([\w,]+)\}`")

pytestmark = pytest.mark.timeout(300)


def expand(text: str) -> str:
    return BRACES.sub(lambda m: " ".join(f"`{m[1]}.{part}`" for part in m[2].split(",")), text)


def installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def require(*distributions: str) -> None:
    missing = [d for d in distributions if not installed(d)]
    if missing:
        folders = " ".join(f"./{DISTRIBUTIONS[d].relative_to(ROOT)}" for d in missing)
        pytest.skip(f"{', '.join(missing)} not installed here (pip install -c constraints.txt {folders}); "
                    "the page's configs and names are checked where it is")


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "PYTEST_", "PYTHONPATH"))}
    env.update(extra)
    return env


def test_every_distribution_has_a_page():
    pages = {p.stem for p in PAGES_DIR.glob("*.md")}
    assert sorted(set(DISTRIBUTIONS) - pages) == [], "add docs/plugins/<distribution>.md for each"
    assert sorted(pages - set(DISTRIBUTIONS)) == [], "a page of docs/plugins/ names no distribution of the repository"


@pytest.mark.parametrize("distribution", sorted(DISTRIBUTIONS))
def test_the_readme_links_its_page(distribution):
    readme = (DISTRIBUTIONS[distribution] / "README.md").read_text(encoding="utf-8")
    target = os.path.relpath(PAGES_DIR / f"{distribution}.md", DISTRIBUTIONS[distribution])
    assert f"]({target})" in readme, f"{distribution}'s README has no link to {target}"


@pytest.mark.parametrize("distribution", sorted(DISTRIBUTIONS))
def test_the_page_names_every_entry_point_and_what_it_registers(distribution):
    page = expand((PAGES_DIR / f"{distribution}.md").read_text(encoding="utf-8"))
    project = tomllib.loads((DISTRIBUTIONS[distribution] / "pyproject.toml").read_text())["project"]
    for name, module in project["entry-points"]["omni"].items():
        assert f"`{name}`" in page and f"`{module}`" in page, f"entry point {name} = {module} is not on the page"
    require(distribution)
    listed = subprocess.run([OMNI, "plugins", "list", "--json"], capture_output=True, text=True, timeout=170,
                            env=environment(), check=True)
    registered = {name for plugin in json.loads(listed.stdout) if plugin["distribution"] == distribution
                  for names in plugin["registered"].values() for name in names}
    assert registered, f"{distribution} registers nothing"
    missing = sorted(name for name in registered if f"`{name}`" not in page)
    assert missing == [], f"docs/plugins/{distribution}.md does not name {missing}"


@pytest.mark.parametrize("distribution", sorted(DISTRIBUTIONS))
def test_every_config_on_the_page_validates(distribution, tmp_path):
    blocks = YAML.findall((PAGES_DIR / f"{distribution}.md").read_text(encoding="utf-8"))
    assert blocks, f"docs/plugins/{distribution}.md shows no ```yaml config"
    needs = {distribution} | ({"omni-contrib-stages"} if any("contrib." in b for b in blocks) else set())
    require(*sorted(needs))
    # The transformers stages' argument check wants a checkpoint folder (config.json in it); validating
    # loads nothing from it.
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    for i, block in enumerate(blocks):
        config = tmp_path / f"config{i}.yaml"
        config.write_text(block)
        result = subprocess.run([OMNI, "validate", str(config)], cwd=tmp_path, capture_output=True, text=True,
                                timeout=170, env=environment(OMNI_TRANSFORMERS_MODEL=str(checkpoint)))
        assert result.returncode == 0, f"docs/plugins/{distribution}.md, config {i + 1}:\n{block}\n{result.stderr}"
        assert "valid pipeline" in result.stdout

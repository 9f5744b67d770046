"""tox.ini and .ci/run: what `tox -e ENV -- ARGS` runs, which envs CI runs, and the README's test command.

`tox -e core -- tests/test_x.py` must run that file only: in every env the test paths are the
default of ``{posargs}``, so arguments given after ``--`` replace them instead of adding to them.
"""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
POSARGS = re.compile(r"\{posargs(?::(?P<default>[^}]*))?\}")


def tox_ini() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "tox.ini")
    return parser


def pytest_commands() -> list[tuple[str, str]]:
    ini = tox_ini()
    found = []
    for section in ini.sections():
        for line in ini[section].get("commands", "").splitlines():
            if line.strip().startswith("pytest") and "{posargs" in line:
                found.append((section, line.strip()))
    return found


def test_every_env_runs_pytest_with_posargs():
    envs = {section for section, _ in pytest_commands()}
    assert {"testenv:core", "testenv:contrib", "testenv:transformers", "testenv:ray", "testenv:tcp", "testenv:gpu-relays"} <= envs


@pytest.mark.parametrize(("section", "command"), pytest_commands(), ids=lambda v: v if v.startswith("testenv") else "")
def test_test_paths_are_the_default_of_posargs_so_arguments_narrow_the_run(section, command):
    match = POSARGS.search(command)
    assert match and match.group("default"), f"[{section}] {command!r}: the test paths belong in {{posargs:PATHS}}"
    outside = shlex.split(POSARGS.sub("", command))[1:]
    paths = [word for word in outside if not word.startswith("-") and ("/" in word or word.startswith("test"))]
    # "-p no:cacheprovider" has an argument that is no path
    paths = [word for word in paths if not word.startswith("no:")]
    assert not paths, (f"[{section}] {command!r} runs {paths} whatever is given after --; "
                       "put them in {posargs:...} so that `tox -e ENV -- FILE` runs FILE only")
    assert shlex.split(match.group("default")), f"[{section}] {command!r}: no default test path"


def test_ci_runs_the_readmes_test_command():
    """.ci/run runs the command the README tells a contributor to run, envs in parallel."""
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    ci_tox = [line.strip() for line in ci.splitlines() if re.match(r"\s*tox\b", line)]
    assert ci_tox, ".ci/run does not run tox"
    readme_tox = re.search(r"pip install [^\n]*tox[^\n]*&& (tox[^\n#]*)", readme)
    assert readme_tox, "README.md has no `pip install tox && tox ...` command"
    assert ci_tox[-1] == readme_tox.group(1).strip()
    assert ci_tox[-1].split()[:2] == ["tox", "p"], "CI runs the envs in parallel (tox p)"


def test_the_slow_env_runs_what_the_default_envs_leave_out():
    """The slow tests are not skipped: env core-slow runs exactly the tests core leaves out."""
    ini = tox_ini()
    env_list = ini["tox"]["env_list"].replace("\n", " ")
    assert "core-slow" in [e.strip() for e in env_list.split(",")]
    core = ini["testenv:core"]["commands"]
    slow = ini["testenv:core-slow"]["commands"]
    assert '-m "not slow"' in core and "-m slow" in slow

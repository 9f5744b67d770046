"""docs/plugins.md's tutorial works literally: every command of its ``<!-- tutorial -->`` blocks
runs in order, in a fresh folder, through the real ``omni`` console script, and the outputs the
page shows for ``omni run`` are what the commands print.

One substitution keeps the test hermetic: ``pip install -e ./omni-NAME`` installs into a private
site directory (``pip install --target``) instead of the test's environment, and each command
loads the plugins the page created so far and nothing else installed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).parent.parent / "docs" / "plugins.md"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def tutorial_steps() -> list[tuple[str, list[str]]]:
    """``(command, expected output lines)`` of every ``$`` line in the tutorial blocks."""
    steps: list[tuple[str, list[str]]] = []
    for block in re.findall(r"<!-- tutorial -->\n```console\n(.*?)```", DOC.read_text(), re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            elif steps:
                steps[-1][1].append(line)
    return steps


NEW = re.compile(r"^omni plugins new (\w+)(?: --kind (\w+))?$")
INSTALL = re.compile(r"^pip install -e \./(omni-[\w-]+)$")


def test_the_tutorial_has_the_steps_a_new_author_follows():
    commands = [c for c, _ in tutorial_steps()]
    assert commands[0] == "omni plugins new acme"
    assert "pip install -e ./omni-acme" in commands
    assert any(c.startswith("omni run acme.example") for c in commands)
    assert any(c.startswith("cd omni-acme && pytest") for c in commands)
    # every kind the page walks through is created, installed, checked and tested
    created = {m.group(1): m.group(2) or "stage" for c in commands if (m := NEW.match(c))}
    assert sorted(created.values()) == ["api", "launcher", "stage"]
    for name in created:
        dist = f"omni-{name}"
        assert {f"pip install -e ./{dist}", f"omni plugins check {dist}"} <= set(commands), name
        assert any(c.startswith(f"cd {dist} && pytest") for c in commands), name


def test_the_tutorial_works_command_by_command(tmp_path):
    site = tmp_path / "site"
    bindir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k not in ("OMNI_LOAD_PLUGINS", "OMNI_DISABLED_PLUGINS")}
    env.update(PYTHONPATH=str(site), PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", NO_COLOR="1",
               OMNI_LOG_LEVEL="WARNING")
    work = tmp_path / "work"
    work.mkdir()
    created: list[str] = []
    for command, expected in tutorial_steps():
        shell = command
        if new := NEW.match(command):
            created.append(f"omni-{new.group(1)}")
        if install := INSTALL.match(command):
            shell = (f"{sys.executable} -m pip install --quiet --no-deps --no-build-isolation --no-index "
                     f"--disable-pip-version-check --target {site} ./{install.group(1)}")
        env["OMNI_LOAD_PLUGINS"] = ",".join(created)  # the page's plugins, nothing else installed
        done = subprocess.run(["bash", "-c", shell], cwd=work, env=env, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, f"$ {command}\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr, f"$ {command}\n{done.stderr}"
        if command.startswith("omni run"):
            assert [json.loads(line) for line in done.stdout.splitlines()] == [json.loads(e) for e in expected]
        if command.startswith("omni plugins list"):
            assert "omni-acme:acme  0.1.0  ok" in done.stdout
        if command.startswith("omni plugins check"):
            assert done.stdout.splitlines()[0] == f"{command.split()[-1]}: ok"
        if " && pytest" in command:
            assert re.search(r"^\d+ passed", done.stdout.splitlines()[-1]), done.stdout

"""docs/plugins.md's tutorial works literally: every command of its ``<!-- tutorial -->`` blocks
runs in order, in a fresh folder, through the real ``omni`` console script, and the outputs the
page shows for ``omni run`` are what the commands print.

One substitution keeps the test hermetic: ``pip install -e ./omni-acme`` installs into a private
site directory (``pip install --target``) instead of the test's environment."""

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


def test_the_tutorial_has_the_steps_a_new_author_follows():
    commands = [c for c, _ in tutorial_steps()]
    assert commands[0] == "omni plugins new acme"
    assert "pip install -e ./omni-acme" in commands
    assert any(c.startswith("omni run acme.example") for c in commands)
    assert any(c.startswith("cd omni-acme && pytest") for c in commands)


def test_the_tutorial_works_command_by_command(tmp_path):
    site = tmp_path / "site"
    bindir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k not in ("OMNI_LOAD_PLUGINS", "OMNI_DISABLED_PLUGINS")}
    env.update(PYTHONPATH=str(site), PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", NO_COLOR="1",
               OMNI_LOG_LEVEL="WARNING", OMNI_LOAD_PLUGINS="omni-acme")
    work = tmp_path / "work"
    work.mkdir()
    for command, expected in tutorial_steps():
        shell = command
        if command == "pip install -e ./omni-acme":
            shell = (f"{sys.executable} -m pip install --quiet --no-deps --no-build-isolation --no-index "
                     f"--disable-pip-version-check --target {site} ./omni-acme")
        done = subprocess.run(["bash", "-c", shell], cwd=work, env=env, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, f"$ {command}\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr, f"$ {command}\n{done.stderr}"
        if command.startswith("omni run"):
            assert [json.loads(line) for line in done.stdout.splitlines()] == [json.loads(e) for e in expected]
        if command.startswith("omni plugins list"):
            assert "omni-acme:acme  0.1.0  ok" in done.stdout
        if command.startswith("omni plugins check"):
            assert done.stdout.splitlines()[0] == "omni-acme: ok"

"""docs/plugins.md's tutorial works literally, as a new author follows it: every command of its
``<!-- tutorial -->`` blocks runs in order, through bash, in a fresh folder and a fresh virtual
environment (``python3 -m venv``, no system site packages) holding only what the page installs
(omni-core from this checkout via ``$OMNI``, as the page writes it, then each generated plugin with
its ``[test]`` extra); the outputs the page shows for ``omni run`` are what the commands print.
Then the generated plugin's README: its console commands, in the same environment, from the
folder it is written for.

Like a terminal, each command starts in the folder the previous one ended in, and the venv the
page activates stays active. Nothing of the test's own environment leaks in: its ``bin`` is off
``PATH``, and ``OMNI_*``, ``PIP_CONSTRAINT``, ``PYTHONPATH`` and ``VIRTUAL_ENV`` are unset. pip's
cache is shared (the CPU torch is not downloaded again). The README's ``tox`` runs as ``tox
config`` (that it installs omni-core by requirement and pins torch, without building its
environments): the plugin-template tox env runs a generated plugin's tox for real
(tests/generated_tox.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOC = ROOT / "docs" / "plugins.md"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def console_steps(text: str, marker: str = "<!-- tutorial -->\n") -> list[tuple[str, list[str]]]:
    """``(command, expected output lines)`` of every ``$`` line in the ``marker``ed console blocks."""
    steps: list[tuple[str, list[str]]] = []
    for block in re.findall(re.escape(marker) + r"```console\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            elif steps:
                steps[-1][1].append(line)
    return steps


def tutorial_steps() -> list[tuple[str, list[str]]]:
    return console_steps(DOC.read_text())


NEW = re.compile(r"^omni plugins new (\w+)(?: --kind (\w+))?$")
VENV = "python3 -m venv .venv && . .venv/bin/activate"


def test_the_tutorial_has_the_steps_a_new_author_follows():
    commands = [c for c, _ in tutorial_steps()]
    assert commands[:3] == [VENV, 'pip install -c "$OMNI/constraints.txt" "$OMNI"', "omni plugins new acme"]
    assert "pip install -e './omni-acme[test]'" in commands
    assert any(c.startswith("omni run acme.example") for c in commands)
    assert any(c.startswith("cd omni-acme && pytest") for c in commands)
    # every kind the page walks through is created, installed with its tests' extra, checked and tested
    created = {m.group(1): m.group(2) or "stage" for c in commands if (m := NEW.match(c))}
    assert sorted(created.values()) == ["api", "launcher", "stage"]
    for name in created:
        dist = f"omni-{name}"
        assert {f"pip install -e './{dist}[test]'", f"omni plugins check {dist}"} <= set(commands), name
        assert any(c.startswith(f"cd {dist} && pytest") for c in commands), name


class Terminal:
    """One user's shell, a command at a time: the folder and the activated venv carry over."""

    def __init__(self, cwd: Path, env: dict[str, str]):
        self.cwd, self.env = cwd, env

    def run(self, command: str, timeout: float = 600) -> subprocess.CompletedProcess:
        where = self.cwd / ".." / f".cwd-{os.getpid()}"
        script = f"{command}\nrc=$?\npwd > {where}\nexit $rc\n"
        done = subprocess.run(["bash", "-c", script], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if where.exists():
            self.cwd = Path(where.read_text().strip())
            where.unlink()
        if command.endswith(". .venv/bin/activate") and done.returncode == 0:  # what activate does
            venv = self.cwd / ".venv"
            self.env["VIRTUAL_ENV"] = str(venv)
            self.env["PATH"] = f"{venv / 'bin'}{os.pathsep}{self.env['PATH']}"
        return done


def fresh_terminal(work: Path) -> Terminal:
    """A shell like a new user's: the Python that runs the tests only as a plain interpreter."""
    ours = {os.path.realpath(Path(sys.prefix) / "bin"), os.path.realpath(Path(sys.executable).parent)}
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and os.path.realpath(p) not in ours]
    base = Path(getattr(sys, "_base_executable", sys.executable)).parent  # python3 -m venv needs a python3
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("OMNI_") and k not in ("PIP_CONSTRAINT", "PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=os.pathsep.join([str(base), *path]), NO_COLOR="1", OMNI=str(ROOT))
    return Terminal(work, env)


def check_step(command: str, expected: list[str], done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"$ {command}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert "Traceback" not in done.stderr, f"$ {command}\n{done.stderr}"
    if command.startswith("omni run") and expected:
        assert [json.loads(line) for line in done.stdout.splitlines()] == [json.loads(e) for e in expected]
    if command.startswith("omni plugins list"):
        assert "omni-acme:acme  0.1.0  ok" in done.stdout
    if command.startswith("omni plugins check"):
        assert done.stdout.splitlines()[0] == f"{command.split()[-1]}: ok"
    if re.match(r"(cd \S+ && )?pytest\b", command):
        summary = done.stdout.splitlines()[-1]  # "4 passed in 9.1s", or framed by "=" without -q
        assert re.search(r"\b\d+ passed\b", summary) and not re.search(r"failed|error", summary), done.stdout


def test_the_tutorial_and_the_generated_readme_work_in_a_fresh_venv(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shell = fresh_terminal(work)
    for command, expected in tutorial_steps():
        check_step(command, expected, shell.run(command))

    # the generated README, in the same environment, from the folder it is written for
    readme = (work / "omni-acme" / "README.md").read_text()
    shell.cwd = work
    ran = []
    for command, expected in console_steps(readme, marker=""):
        if command.split("#")[0].strip() == "tox":
            command = f"tox config -e py{sys.version_info[0]}{sys.version_info[1]}-omniinstalled -k deps set_env"
            done = shell.run(command)
            check_step(command, expected, done)
            # by requirement, never a path of this checkout (OMNI_CORE says where when no index has it)
            assert re.search(r"^deps = omni-core>=\S+$", done.stdout, re.M), done.stdout
            assert f"PIP_CONSTRAINT={shell.cwd}/constraints.txt" in done.stdout, done.stdout
            continue
        check_step(command, expected, shell.run(command))
        ran.append(command.split("#")[0].strip())
    assert ran[:2] == ["pip install -e './omni-acme[test]'", "omni plugins list --hook stages"] and "pytest" in ran

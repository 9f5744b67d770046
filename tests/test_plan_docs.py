"""The `omni plan` examples in docs/placement.md and docs/cli/plan.md show real output.

Each YAML block whose first line is ``# NAME.yaml`` is a config file; each ``console`` block holds
``$ omni plan ...`` commands, each followed by exactly what the command prints (stdout and stderr)
on a machine with 16 cores, no ``CUDA_VISIBLE_DEVICES`` unless the command sets it, and the
configs' stage module importable. ``python tests/test_plan_docs.py`` rewrites the outputs.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from omni_core.cli import app

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = [DOCS / "placement.md", DOCS / "cli" / "plan.md"]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```\n", re.S | re.M)
CORES = 16
STAGE_MODULE = "my_models"


def config_files(text: str) -> dict[str, str]:
    """``{file name: content}`` of every YAML block that starts with ``# NAME.yaml``."""
    files = {}
    for lang, body in FENCE.findall(text):
        first = body.split("\n", 1)[0]
        if lang == "yaml" and re.fullmatch(r"# [\w.-]+\.yaml", first):
            files[first[2:]] = body
    return files


def commands(text: str) -> list[tuple[str, str]]:
    """``(command, output)`` for every ``$ omni ...`` line in a console block."""
    found = []
    for lang, body in FENCE.findall(text):
        if lang != "console":
            continue
        for chunk in re.split(r"^(?=\$ )", body, flags=re.M):
            if chunk.startswith("$ "):
                command, _, output = chunk[2:].partition("\n")
                found.append((command, output))
    return found


def run(command: str) -> str:
    """What ``command`` (``[VAR=value ...] omni ARGS``) prints, stdout and stderr together."""
    words = shlex.split(command)
    env = {}
    while "=" in words[0]:
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    assert words[0] == "omni", command
    result = CliRunner().invoke(app, words[1:], env=env)
    return result.output


def prepare_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The machine the documented output comes from, with the docs' configs written out."""
    (tmp_path / f"{STAGE_MODULE}.py").write_text("raise RuntimeError('omni plan must not import stage code')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: CORES)
    for page in PAGES:
        for name, body in config_files(page.read_text()).items():
            (tmp_path / name).write_text(body)
    return tmp_path


@pytest.fixture
def docs_machine(tmp_path, monkeypatch):
    return prepare_machine(tmp_path, monkeypatch)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_documented_plan_output_is_what_omni_plan_prints(docs_machine, page):
    examples = commands(page.read_text())
    assert examples, f"{page} shows no omni command"
    for command, output in examples:
        assert run(command) == output, f"{page.name}: $ {command}"


def test_the_parsers_find_configs_and_commands():
    text = "```yaml\n# a.yaml\nname: a\n```\n\n```console\n$ omni plan a.yaml\nout 1\n$ X=1 omni plan a.yaml\n```\n"
    assert config_files(text) == {"a.yaml": "# a.yaml\nname: a\n"}
    assert commands(text) == [("omni plan a.yaml", "out 1\n"), ("X=1 omni plan a.yaml", "")]


def rewrite(page: Path) -> None:
    """Replace the output after each command of ``page`` with what the command prints now."""

    def fill(match: re.Match) -> str:
        lang, body = match.group(1), match.group(2)
        if lang != "console":
            return match.group(0)
        parts = [chunk for chunk in re.split(r"^(?=\$ )", body, flags=re.M) if chunk.startswith("$ ")]
        out = "".join(f"$ {c}\n{run(c)}" for c in (p[2:].partition("\n")[0] for p in parts))
        return f"```console\n{out}```\n"

    page.write_text(FENCE.sub(fill, page.read_text()))


if __name__ == "__main__":  # pragma: no cover
    import tempfile

    patch = pytest.MonkeyPatch()
    with tempfile.TemporaryDirectory() as tmp:
        prepare_machine(Path(tmp), patch)
        for page in PAGES:
            rewrite(page)
        patch.undo()
    sys.exit(0)

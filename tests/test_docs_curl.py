"""Every curl command the README and docs tell users to run is silent: without ``-s`` curl prints
its progress meter between the server-sent events of a streamed request."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
COMMAND = re.compile(r"(?:^\s*(?:\$ )?|\buntil |; )curl (.*)")


def curl_commands() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        in_code = False
        for line in path.read_text().splitlines():
            if line.lstrip().startswith("```"):
                in_code = not in_code
                continue
            match = COMMAND.search(line) if in_code else None
            if match:
                found.append((f"{path.relative_to(ROOT)}: {line.strip()}", match.group(1)))
    return found


def test_the_docs_show_curl_commands():
    where = {w.split(":")[0] for w, _ in curl_commands()}
    assert {"README.md", "docs/serving.md", "docs/cli/serve.md"} <= where


@pytest.mark.parametrize(("where", "args"), curl_commands(), ids=lambda v: v.split(": ")[0] if ": " in v else "")
def test_every_curl_command_is_silent(where, args):
    flags = [a for a in shlex.split(args.split(";")[0], comments=True) if a.startswith("-")]
    silent = any(f == "--silent" or (not f.startswith("--") and "s" in f[1:]) for f in flags)
    assert silent, f"{where}: add -s, or curl's progress meter gets in the way of the output"

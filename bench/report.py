"""Regenerate the measured parts of the performance pages (docs/performance/) from result files.

The pages are prose written by hand around blocks the bench writes: every scenario's tables sit
between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``. ``python -m bench ... --doc
docs/performance`` (the folder, or one page of it) replaces each block whose scenario it ran (or, with ``--replot``, read back
from ``--out``) with that run's summary tables and a line saying when, where and under what load
it was measured. Blocks of other scenarios, and everything outside the blocks, stay as they are.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from . import common


def _begin(name: str) -> str:
    return f"<!-- bench:{name} -->"


def _end(name: str) -> str:
    return f"<!-- /bench:{name} -->"


def provenance(doc: dict[str, Any]) -> str:
    """One line: the run's kind, time, commit, machine and load."""
    m = doc.get("machine", {})
    git = m.get("git") or {}
    commit = (git.get("commit") or "?")[:10] + (" (uncommitted changes)" if git.get("dirty") else "")
    load = m.get("load_average") or []
    load_end = m.get("load_average_end") or []
    load_text = f"load average {load[0]:.1f} at the start, {load_end[0]:.1f} at the end" if load and load_end else "load average unknown"
    kind = "`--quick` run" if doc.get("quick") else "full run"
    return (f"_Measured by a {kind} of `python -m bench --scenario {doc['scenario']}` on {doc.get('started', '?')} "
            f"(commit {commit}), {m.get('cpus_usable', m.get('cpus', '?'))} CPUs ({m.get('cpu', '?')}), Python {m.get('python', '?')}, "
            f"{load_text}; {doc.get('wall_s', 0):.0f} s._")


def markdown(text: str) -> str:
    """A summary (title lines and tables) as markdown: a blank line before and after each table."""
    out: list[str] = []
    for line in text.splitlines():
        is_table = line.startswith("|")
        if line and out and out[-1] and is_table != out[-1].startswith("|"):
            out.append("")
        out.append(line)
    return "\n".join(out)


def block(module: Any, doc: dict[str, Any]) -> str:
    failed = [k for k, ok in doc.get("checks", {}).items() if not ok]
    checks = doc.get("checks", {})
    lines = [provenance(doc), "", markdown(module.summary(doc))]
    if checks:
        lines += ["", f"Checks met: {len(checks) - len(failed)} of {len(checks)}" + (":" if failed else ".")]
        lines += [""] * bool(failed) + [f"- not met: {k}" for k in failed]
    notes = [_first_line(n) for n in doc.get("notes", []) if "Ray peer not run" not in n]
    if notes:
        lines += [""] + [f"- note: {n}" for n in notes]
    return "\n".join(lines)


def _first_line(note: str, limit: int = 400) -> str:
    line = note.strip().splitlines()[0] if note.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def update(path: Path, docs: dict[str, dict[str, Any]], modules: dict[str, Any]) -> list[str]:
    """Replace the block of every scenario in ``docs`` in the page at ``path``, or in every page of the
    folder at ``path`` (docs/performance/: each topic page holds its scenarios' blocks); returns the
    names of the scenarios whose markers are on no page."""
    pages = sorted(path.rglob("*.md")) if path.is_dir() else [path]
    written: set[str] = set()
    for page in pages:
        text = page.read_text()
        new = text
        for name, doc in docs.items():
            pattern = re.compile(re.escape(_begin(name)) + r".*?" + re.escape(_end(name)), re.S)
            if not pattern.search(new):
                continue
            body = block(modules[name], doc)
            new = pattern.sub(lambda _m, body=body, name=name: f"{_begin(name)}\n{body}\n{_end(name)}", new, count=1)
            written.add(name)
        if new != text:
            page.write_text(new)
    missing = [name for name in docs if name not in written]
    for name in missing:
        common.log(f"{path}: no '{_begin(name)}' ... '{_end(name)}' block: the {name} tables were not written there")
    return missing

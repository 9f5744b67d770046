"""Every relative link of README.md and the docs pages resolves: the file or folder it names
exists in the repository and, where it names a heading (``page.md#anchor``), that page has the
heading (GitHub's anchor of it). Links to other sites and ``mailto:`` are not checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "plugins").glob("*/README.md"),
                ROOT / "contrib_stages" / "README.md"])
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
#: ``[text](target)`` and ``![alt](target)``, the target up to a space or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
#: ``[text]: target`` reference definitions.
REFERENCE = re.compile(r"^\s*\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The page without its fenced blocks and inline code (links there are examples, not links)."""
    return CODE.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    body = prose(text)
    return LINK.findall(body) + REFERENCE.findall(body)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    parts = text.split("`")  # HTML tags are markup outside code spans, text inside them
    text = "".join(part if i % 2 else re.sub(r"<[^>]+>", "", part) for i, part in enumerate(parts)).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page`` (a repeated heading gets -1, -2... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for _, heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = anchor(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    found |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", page.read_text(encoding="utf-8")))
    return found


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if path and not resolved.exists():
            problems.append(f"{target}: no file {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved}")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            problems.append(f"{target}: {resolved.relative_to(ROOT)} has no heading with anchor #{fragment}")
    return problems


def test_the_anchor_of_a_heading_is_githubs():
    assert anchor("Running the tests") == "running-the-tests"
    assert anchor("`omni serve`: routes, SSE & more") == "omni-serve-routes-sse--more"
    assert anchor("Adding a model family (the kit)") == "adding-a-model-family-the-kit"
    assert anchor("[docs/x.md](docs/x.md) it") == "docsxmd-it"
    assert anchor("`contrib.split.<part>`") == "contribsplitpart"
    assert anchor("A <em>b</em> c") == "a-b-c"


def test_links_in_code_are_not_links_and_references_are():
    text = "see [a](a.md) and `[b](b.md)`\n```\n[c](c.md)\n```\n[d]: d.md\n![e](img/e.png \"title\")\n"
    assert links(text) == ["a.md", "img/e.png", "d.md"]


def test_a_missing_file_and_a_missing_heading_are_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n## Some part\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#some-part) [gone](nowhere.md) [bad](other.md#no-such) [self](#top)\n# Top\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        problems = broken_links(page)
    finally:
        ROOT = saved
    assert problems == ["nowhere.md: no file nowhere.md", "other.md#no-such: other.md has no heading with anchor #no-such"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    assert broken_links(page) == [], f"{page.relative_to(ROOT)}: broken links (fix the path or the heading)"


def test_the_index_lists_every_page():
    """docs/README.md, the index by audience, links every page of docs/ (a new page is added there)."""
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / target.partition("#")[0]).resolve() for target in links(index.read_text(encoding="utf-8"))
              if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)}
    pages = {p.resolve() for p in (ROOT / "docs").rglob("*.md") if p != index}
    missing = sorted(str(p.relative_to(ROOT)) for p in pages - linked)
    assert missing == [], f"docs/README.md does not list {missing}: add each under its audience, with one line"

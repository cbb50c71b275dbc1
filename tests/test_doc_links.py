"""Every link between the repository's documents resolves: the file it names exists, and so does the heading its
anchor names (as GitHub makes a heading's anchor), so a section moved to another page keeps the links into it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.fast

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, inline markup and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower())
    return text.replace(" ", "-")


def outside_code(text: str) -> list[str]:
    """The lines of a Markdown text that are not inside a fenced code block."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def anchors(text: str) -> set[str]:
    """The anchors of every heading of a Markdown text (a repeated heading's get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in outside_code(text):
        m = HEADING.match(line)
        if m:
            base = anchor(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(pages: dict[Path, str], root: Path = ROOT) -> list[str]:
    """`page: target` for each relative link of a page whose file or heading does not exist (pages by their path;
    named relative to `root`)."""
    bad = []
    for page, text in sorted(pages.items()):
        for line in outside_code(text):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"[a-z]+:", target):
                    continue  # http:, https:, mailto:
                path, _, fragment = target.partition("#")
                file = (page.parent / path).resolve() if path else page
                if not file.exists():
                    bad.append(f"{page.relative_to(root)}: {target}")
                elif fragment and file.suffix == ".md":
                    text_of = pages.get(file) or file.read_text(encoding="utf-8")
                    if fragment not in anchors(text_of):
                        bad.append(f"{page.relative_to(root)}: {target}")
    return bad


def test_every_link_between_the_documents_resolves_to_a_file_and_a_heading():
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"]
    names = subprocess.run(listed, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    pages = {(ROOT / n).resolve(): (ROOT / n).read_text(encoding="utf-8")
             for n in names.split() if not n.startswith("tests/data/")}
    assert (ROOT / "docs" / "benchmarks-history.md").resolve() in pages and len(pages) > 10
    assert broken_links(pages) == []


def test_the_check_would_see_a_missing_page_or_heading(tmp_path):
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    pages = {
        a: "# A\n\nSee [b](b.md#the-tests-rounds), [gone](b.md#moved-away), [none](c.md) and [here](#a).\n"
           "```\n[in code](nowhere.md)\n```\n",
        b: "# B\n\n## The test's rounds, 2026-12-05\n\n## The test's rounds\n",
    }
    for path, text in pages.items():
        path.write_text(text)
    assert anchors(pages[b]) == {"b", "the-tests-rounds-2026-12-05", "the-tests-rounds"}
    assert broken_links(pages, tmp_path) == ["a.md: b.md#moved-away", "a.md: c.md"]


def test_the_readme_stays_the_front_door():
    """Under 300 lines, with its two commands: set up and run the demo, set up and run the tests."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 300, f"README.md has {len(text.splitlines())} lines; keep it under 300"
    assert "bash scripts/demo.sh" in text and "bash scripts/test.sh" in text

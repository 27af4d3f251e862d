"""The documentation is current and self-contained: generated references match the code, the README stays a front
page (short, no dated history), every relative link resolves inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

from server.config import flags_reference

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "loadtests" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b(first|second|third|fourth|\w+teenth|twenty-\w+) session\b|\bissue \d+\b")


def between(text: str, start: str, end: str) -> str:
    begin = text.index(start)
    return text[text.index("\n", begin) + 1 : text.index(end)].strip()


def test_the_flags_reference_is_generated_from_the_configuration() -> None:
    page = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    assert between(page, "<!-- flags", "<!-- /flags -->") == flags_reference(), \
        "docs/flags.md is stale: regenerate it with `python -m server.config`"
    assert "| `--listen` | `NMT_LISTEN` |" in page and "### Device rules" in page


def test_the_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    assert not DATED.findall(readme), "dated history belongs in git, figures in benchmarks/README.md"


def test_benchmarks_readme_is_a_table_per_benchmark() -> None:
    assert len((ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8").splitlines()) <= 500


def test_docs_tell_no_history() -> None:
    """Pages say how things are; when a figure was measured is in benchmarks/README.md's stamps and decisions.md."""
    for page in PAGES:
        if page.name == "decisions.md" or page.parent.name in ("benchmarks", "loadtests"):  # stamped tables
            continue
        assert not DATED.findall(page.read_text(encoding="utf-8")), page.relative_to(ROOT)


def test_every_relative_link_resolves_inside_the_repository() -> None:
    for page in PAGES:
        for target, _ in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (page.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), f"{page.name} points outside the repository: {target}"
            assert resolved.exists(), f"{page.name}: {target} does not exist"


def test_nothing_points_to_the_shared_folder_outside_the_repository() -> None:
    for path in [*PAGES, *ROOT.glob("benchmarks/*.sh"), *ROOT.glob("docker/*")]:
        assert "../shared" not in path.read_text(encoding="utf-8"), path.relative_to(ROOT)


def test_the_decisions_page_gives_a_figure_and_a_commit_for_each_line() -> None:
    rows = [line for line in (ROOT / "docs" / "decisions.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| ") and not line.startswith(("| option", "|---"))]
    assert len(rows) >= 8
    for row in rows:
        assert re.search(r"\d", row) and re.search(r"`[0-9a-f]{7,}`", row), row

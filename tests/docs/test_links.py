"""Every link of README.md and docs/ lands inside the repository, on a file that exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.markdown import ROOT, anchors, links, pages, path_spans


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_inside_the_repository(page: Path) -> None:
    problems = []
    for target in links(page):
        if "://" in target or target.startswith(("mailto:", "//")):
            problems.append(f"{target}: points outside the repository")
            continue
        path_part, _, fragment = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.is_relative_to(ROOT):
            problems.append(f"{target}: climbs out of the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            problems.append(f"{target}: no heading #{fragment} in {resolved.name}")
    assert not problems, problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_named_in_code_spans_exist(page: Path) -> None:
    missing = [span for span in path_spans(page) if not (ROOT / span.rstrip("/")).exists()]
    assert not missing, f"{page.name} names paths the repository does not have: {missing}"


def test_the_readme_leads_to_every_page() -> None:
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(ROOT / "README.md")}
    unlinked = [p.name for p in pages()[1:] if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link {unlinked}"


def test_the_link_check_catches_what_it_should(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "[a](../shared/DESIGN.md) [b](https://example.com) `x`\n```\n[c](nowhere.md)\n```\n"
    )
    assert links(page) == ["../shared/DESIGN.md", "https://example.com"]

"""The repository's Markdown pages, and what their links and code spans point at."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Inline links and images: [text](target) and ![alt](target); the target up to a space or ")".
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
#: Code spans naming a file or folder of the repository (`deploy/kubernetes/service.yaml`).
_PATH_SPAN = re.compile(
    r"`((?:service|tests|bench|deploy|scripts|protos|docs|\.ci)/[\w./-]*?)(?:[*:#][^`]*)?`"
)
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(page: Path) -> str:
    """The page without its fenced code blocks (commands there are not links)."""
    return _FENCE.sub("", page.read_text())


def links(page: Path) -> list[str]:
    return _LINK.findall(prose(page))


def path_spans(page: Path) -> list[str]:
    return _PATH_SPAN.findall(prose(page))


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {
        anchor(line.lstrip("#")) for line in prose(page).splitlines() if re.match(r"#{1,6} ", line)
    }

"""The docs point only at files that are in this repository: every relative Markdown link and
every path written in backticks under one of the project's folders names something that exists
(the docs move with the code; a refactor that renames a module must fix the pages naming it)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.collector import ROOT

FOLDERS = ("fleet_min/", "tests/", "docs/", "bench/", "deploy/", "scripts/", "agent/")
TOP_FILES = ("zipapp.py", "pyproject.toml", "constraints.txt", "README.md")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CODE = re.compile(r"`([^`\s]+)`")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _named_path(text: str) -> str | None:
    """A repository path written in backticks (`fleet_min/db.py`, `tests/support/`), without a
    trailing function or line (`fleet_min/db.py:12`, `...py::test_x`), or None."""
    path = re.split(r"::|:(?=\d)|\s", text, maxsplit=1)[0].rstrip(".,;")
    if path.startswith(FOLDERS) or path in TOP_FILES:
        return None if any(ch in path for ch in "*<>{}$") else path
    return None


def test_every_path_the_docs_name_exists():
    missing = []
    for page in _pages():
        text = page.read_text()
        for target in LINK.findall(text):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: link {target}")
        for code in CODE.findall(text):
            path = _named_path(code)
            if path and not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: `{code}`")
    assert not missing, "\n".join(sorted(set(missing)))

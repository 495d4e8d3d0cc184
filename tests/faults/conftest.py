"""Fixtures of the fault suite: a figures book written out at the end of the session, a small
tmpfs, and the collector data directory it holds."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.faults import mount_tmpfs, unmount


class Figures:
    """What each fault test measured; printed at the end and written to $FLEET_FAULT_REPORT."""

    def __init__(self) -> None:
        self.book: dict[str, dict[str, Any]] = {}

    def record(self, test: str, **values: Any) -> None:
        self.book.setdefault(test, {}).update(values)


@pytest.fixture(scope="session")
def figures() -> Iterator[Figures]:
    book = Figures()
    yield book
    if not book.book:
        return
    text = json.dumps(book.book, indent=1, sort_keys=True)
    print("\nfault suite figures:\n" + text)
    target = os.environ.get("FLEET_FAULT_REPORT")
    if target:
        Path(target).write_text(text + "\n")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs to use as a data directory (skipped where mount is not permitted)."""
    where = tmp_path / "small-disk"
    mount_tmpfs(where, "8m")
    try:
        yield where
    finally:
        unmount(where)

"""Chromium for the browser tests (Debian's /usr/bin/chromium, driven by Playwright; never a
downloaded browser), a watch on a page's console errors, screenshots, and a seeded collector."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.collector import ROOT, CollectorProcess
from tests.support.web_seed import Seeded

CHROMIUM = Path(os.environ.get("FLEET_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
SHOTS = ROOT / "test-artifacts" / "screenshots"
DESKTOP = {"width": 1280, "height": 860}
PHONE = {"width": 390, "height": 844}


def skip_reason() -> str | None:
    # Only a missing browser skips; a missing playwright package is an error (CI installs it).
    if not CHROMIUM.exists():
        return (f"{CHROMIUM} is missing: install Debian's chromium package "
                "(apt-get install -y chromium) to run the browser tests")
    return None


@dataclass
class Watch:
    """Console errors and uncaught exceptions of one page."""

    errors: list[str] = field(default_factory=list)

    def console(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(f"console: {message.text} ({message.location.get('url')})")

    def exception(self, error: Any) -> None:
        self.errors.append(f"uncaught: {error}")


def shot(page: Any, name: str, full_page: bool = True) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    return path


@dataclass
class SeededCollector:
    proc: CollectorProcess
    ids: Seeded

    @property
    def url(self) -> str:
        return self.proc.url

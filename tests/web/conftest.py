"""Browser tests: Playwright for Python driving Debian's Chromium (/usr/bin/chromium), never a
downloaded browser, against real collector processes with real data.

Fixtures:
- `browser`: one headless Chromium per test module (skipped, with the reason, when
  /usr/bin/chromium is missing). Not per session: Playwright's sync API keeps an event loop
  on the main thread while it runs, and later asyncio tests (pytest-aiohttp) need that thread.
- `open_page(path_or_url, ...)`: a fresh context and page that records console errors and
  uncaught exceptions (`page.watch.errors`); `shot(page, name)` writes a screenshot to
  test-artifacts/screenshots/.
- `seeded`: a collector process with devices, jobs in every status, results, schedules,
  artifacts, alerts and topics (tests/web/seed.py), shared by the session.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, CollectorProcess
from tests.web.seed import Seeded, seed

CHROMIUM = Path(os.environ.get("FLEET_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
SHOTS = ROOT / "test-artifacts" / "screenshots"
DESKTOP = {"width": 1280, "height": 860}
PHONE = {"width": 390, "height": 844}


def _skip_reason() -> str | None:
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


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def open_page(browser: Any) -> Iterator[Callable[..., Any]]:
    contexts: list[Any] = []

    def open_(url: str, viewport: dict[str, int] | None = None, scheme: str = "light",
              wait: str | None = None) -> Any:
        context = browser.new_context(viewport=viewport or DESKTOP, color_scheme=scheme)
        context.set_default_timeout(15000)
        contexts.append(context)
        page = context.new_page()
        page.watch = Watch()
        page.on("console", page.watch.console)
        page.on("pageerror", page.watch.exception)
        page.goto(url)
        if wait:
            page.wait_for_selector(wait)
        return page

    yield open_
    for context in contexts:
        with contextlib.suppress(Exception):
            context.close()


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


@pytest.fixture(scope="session")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeededCollector]:
    root = tmp_path_factory.mktemp("web-collector")
    proc = CollectorProcess(root / "data").start()
    try:
        yield SeededCollector(proc, seed(proc.client))
    finally:
        proc.stop()

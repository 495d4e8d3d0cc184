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
  artifacts, alerts and topics (tests/support/web_seed.py), shared by the session.
- `cp_busy`, `cp_empty`: control-plane daemons for looking only (no test acts on them): runners
  on three hosts with weeks of history, admission and autoscale decisions
  (tests/support/cp_fixtures.busy_scene), and one with no runner and no history; shared by
  the session.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    DESKTOP,
    SeededCollector,
    Watch,
    skip_reason,
)
from tests.support import cp_fakes
from tests.support.collector import CollectorProcess
from tests.support.cp_fixtures import UiDaemon, busy_scene, empty_scene
from tests.support.fake_github import FakeGitHub
from tests.support.web_seed import seed

@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    reason = skip_reason()
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


@pytest.fixture(scope="session")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeededCollector]:
    root = tmp_path_factory.mktemp("web-collector")
    proc = CollectorProcess(root / "data").start()
    try:
        yield SeededCollector(proc, seed(proc.client))
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def cp_github() -> Iterator[FakeGitHub]:
    fake = FakeGitHub()
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture(scope="session")
def cp_busy(tmp_path_factory: pytest.TempPathFactory, cp_github: FakeGitHub
            ) -> Iterator[UiDaemon]:
    daemon = busy_scene(tmp_path_factory.mktemp("cp-busy"), cp_github)
    yield daemon
    daemon.stop()
    cp_fakes.kill_all_listeners(daemon.host.root)


@pytest.fixture(scope="session")
def cp_empty(tmp_path_factory: pytest.TempPathFactory, cp_github: FakeGitHub
             ) -> Iterator[UiDaemon]:
    daemon = empty_scene(tmp_path_factory.mktemp("cp-empty"), cp_github)
    yield daemon
    daemon.stop()

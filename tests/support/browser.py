"""Chromium for the browser tests (Debian's /usr/bin/chromium, driven by Playwright; never a
downloaded browser), a watch on a page's console errors, screenshots, and a seeded collector."""

from __future__ import annotations

import contextlib
import os
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

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


@contextlib.contextmanager
def chromium(extra_args: Sequence[str] = ()) -> Iterator[Any]:
    """One headless Chromium (skipped when /usr/bin/chromium is missing). Used for a module at
    most: Playwright's sync API holds an event loop on the main thread while it runs.

    `extra_args` are Chromium switches, e.g. `--host-resolver-rules=MAP evil.test 127.0.0.1`
    to give a test a name of its own that resolves to this machine (Chromium's own resolver
    takes it; nothing on the system changes)."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM),
                                     args=[*CHROMIUM_ARGS, *extra_args])
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def page_server(pages: dict[str, str]) -> Iterator[int]:
    """A web site elsewhere: a plain HTTP server on a free loopback port answering each path
    in `pages` with that HTML (404 otherwise); yields the port."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            body = pages.get(self.path.split("?")[0])
            if body is None:
                self.send_error(404)
                return
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def live_page_asking(open_page: Callable[..., Any], url: str, wait: str, path: str
                     ) -> tuple[Any, list[str]]:
    """The page at `url` (once `wait` shows) with its live stream connected, and the URLs of
    the requests it makes to `path` from then on: what a screen reloads as events arrive."""
    page = open_page(url, wait=wait)
    page.wait_for_selector(".live.live")  # the stream is connected: events reach the page
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url)
            if urllib.parse.urlsplit(r.url).path == path else None)
    return page, asked

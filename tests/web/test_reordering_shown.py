"""Free text that no label rule covers (a result's error, a metric's text, a spec member such as
suite.name) is stored as sent, and a page shows each character that reorders text (U+202A-202E,
U+2066-2069) written out as [U+202E]: the dashboard and the control plane through their one
htm binding (fleet_min/web/common/shown.js), the legacy pages through legacy.esc. Checked in
headless Chromium on a real collector and a real control plane."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.collector import CollectorProcess, job, registration, result_row
from tests.support.cp_fixtures import UiDaemon
from tests.support.web_seed import claim

pytestmark = pytest.mark.slow

OVERRIDE = "\u202e"  # RIGHT-TO-LEFT OVERRIDE: "report\u202efdp.exe" reads "reportexe.pdf"
ISOLATE = "\u2066"  # LEFT-TO-RIGHT ISOLATE
ERROR = f"wrote report{OVERRIDE}fdp.exe then stopped"
SUITE = f"smoke{ISOLATE}suite"
REORDERING = [chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))]


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorProcess]:
    proc = CollectorProcess(Path(tmp_path_factory.mktemp("reordering")) / "data").start()
    try:
        client = proc.client
        assert client.post("/devices/register", registration("pi5"))[0] == 200
        assert client.post("/jobs", job("tricky", targets={"device_id": "pi5"},
                                         suite={"name": SUITE}))[0] == 201
        claim(client, "pi5")
        assert client.post("/results", result_row("tricky", "pi5", 0, ok=False, final=True,
                                                  error=ERROR))[0] == 200
        stored = client.get("/api/jobs/tricky")[1]
        assert stored["spec"]["suite"]["name"] == SUITE  # stored as sent
        yield proc
    finally:
        proc.stop()


def no_reordering(text: str) -> None:
    assert not [c for c in text if c in REORDERING], ascii(text)


def test_the_dashboard_writes_reordering_characters_out(
        collector: CollectorProcess, open_page: Callable[..., Any]) -> None:
    page = open_page(collector.url + "/dash/jobs/tricky", wait="#job-status >> text=failed")
    page.wait_for_selector("text=fdp.exe")
    text = page.inner_text("body")
    no_reordering(text)
    assert "report[U+202E]fdp.exe" in text, text
    no_reordering(page.title())
    assert page.watch.errors == []


def test_the_legacy_page_writes_reordering_characters_out(
        collector: CollectorProcess, open_page: Callable[..., Any]) -> None:
    page = open_page(collector.url + "/dash/legacy/jobs/tricky", wait="text=fdp.exe")
    text = page.inner_text("body")
    no_reordering(text)
    assert "report[U+202E]fdp.exe" in text and "smoke[U+2066]suite" in text, text


def test_the_control_planes_binding_writes_them_out_in_text_and_titles(
        cp_empty: UiDaemon, open_page: Callable[..., Any]) -> None:
    """Every view of the control plane renders through js/html.js; a value in a text child
    and in a title comes out written, a form field's value as it is."""
    page = open_page(cp_empty.url + "/")
    shown = page.evaluate("""async (value) => {
        const { html, render } = await import('/public/js/html.js');
        const box = document.createElement('div');
        document.body.append(box);
        render(html`<p title=${value}>${value}<b>${[value]}</b></p><input value=${value} />`,
               box);
        return { text: box.querySelector('p').textContent,
                 title: box.querySelector('p').title,
                 field: box.querySelector('input').value };
    }""", ERROR)
    assert shown["text"] == 2 * "wrote report[U+202E]fdp.exe then stopped", shown
    assert shown["title"] == "wrote report[U+202E]fdp.exe then stopped"
    assert shown["field"] == ERROR  # a form saves what it was given

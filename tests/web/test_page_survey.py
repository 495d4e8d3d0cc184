"""Every page of the collector (each dashboard screen and tab, a device, a job, an artifact, the
legacy pages, the browser runner) and of the control plane (runners, a runner and an agent's
runner, analytics, a repository, concurrency, a simulation run, forecast, hosts with autoscale and
admission, billing, settings, the phone menu) at a phone width (390 px) and a laptop width
(1280 px), on a service with realistic data and on an empty one. A page fails on a document that
scrolls sideways, raw data in its visible text, a wide table that does not keep its first
column, a console error, or a failed request or unexpected error answer
(tests/support/survey.py). Screenshots: test-artifacts/screenshots/survey-<page>-<width>.png
(survey-empty-... for the empty collector), survey-cp-<page>-<width>.png and
survey-cp-empty-<page>-<width>.png for the control plane."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.collector import CollectorProcess
from tests.support.cp_fixtures import UiDaemon
from tests.support.survey import PREFIX, STOPS, WIDTHS, visit
from tests.support.web_seed import seed_shelf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def collectors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Two collectors for the whole module: one with a busy shelf, one that holds nothing."""
    root: Path = tmp_path_factory.mktemp("survey")
    full = CollectorProcess(root / "full").start()
    empty = CollectorProcess(root / "empty").start()
    try:
        seed_shelf(full.client)
        yield {"shelf": full.url, "empty": empty.url}
    finally:
        full.stop()
        empty.stop()


# Every page at one width, each loaded and read: about half a minute alone on a slow
# hour of this machine, more beside the other browser worker; the suite's 120 s is
# for a test that hangs, and this one must not be mistaken for one.
@pytest.mark.timeout(360)
@pytest.mark.parametrize("width", sorted(WIDTHS))
@pytest.mark.parametrize("data", ["shelf", "empty"])
def test_collector_pages_read_at_a_glance(browser: Any, collectors: dict[str, str], data: str,
                                          width: int) -> None:
    context = browser.new_context(viewport=WIDTHS[width], has_touch=True,
                                  is_mobile=width < 600)
    context.set_default_timeout(15000)
    try:
        problems: list[str] = []
        for stop in STOPS["collector"]:
            problems += visit(context, collectors[data], stop, width, empty=data == "empty")
    finally:
        context.close()
    assert problems == [], "\n".join(problems)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("width", sorted(WIDTHS))
@pytest.mark.parametrize("data", ["busy", "empty"])
def test_control_plane_pages_read_at_a_glance(browser: Any, cp_busy: UiDaemon,
                                              cp_empty: UiDaemon, data: str, width: int) -> None:
    """Runners on three hosts with weeks of history, and a daemon with nothing (both from
    tests/web/conftest.py)."""
    base = (cp_busy if data == "busy" else cp_empty).url
    context = browser.new_context(viewport=WIDTHS[width], has_touch=True,
                                  is_mobile=width < 600)
    context.set_default_timeout(20000)
    try:
        problems: list[str] = []
        for stop in STOPS["controlplane"]:
            problems += visit(context, base, stop, width, empty=data == "empty",
                              prefix=PREFIX["controlplane"], times=True)
    finally:
        context.close()
    assert problems == [], "\n".join(problems)

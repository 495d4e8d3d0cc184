"""How often a dashboard screen reloads while the stream says its data changed, in headless
Chromium against a real collector. Anyone who reaches the collector may enqueue jobs and post
result rows, and each screen reloaded its listings 200 ms after any event that concerned it: a
job every 250 ms had the Overview fetch its four answers four times a second for every viewer.
A reload the stream causes now comes at least a second after the one before."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import live_page_asking
from tests.support.collector import CollectorProcess, job, registration

pytestmark = pytest.mark.slow

RELOAD_GAP_S = 1.0  # hooks.js RELOAD_GAP_MS


def test_a_trickle_of_jobs_reloads_the_overview_at_most_once_a_second(
        tmp_path: Path, open_page: Callable[..., Any]) -> None:
    proc = CollectorProcess(tmp_path / "overview").start()
    try:
        assert proc.client.post("/devices/register", registration("pixel-7"))[0] == 200
        page, overviews = live_page_asking(open_page, proc.url + "/dash", "#ov-devices",
                                           "/api/overview")
        started = time.monotonic()
        for n in range(24):  # a job every 250 ms for six seconds
            assert proc.client.post("/jobs", job(f"trickle-{n}"))[0] == 201
            page.wait_for_timeout(250)
        elapsed = time.monotonic() - started
        page.wait_for_timeout(1500)  # the last reload the trickle asked for
        assert overviews, "the overview never reloaded"
        bound = int(elapsed / RELOAD_GAP_S) + 2
        assert len(overviews) <= bound, (len(overviews), bound, elapsed)
        assert page.watch.errors == []
    finally:
        proc.stop()

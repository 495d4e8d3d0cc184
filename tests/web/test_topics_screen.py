"""The dashboard's Topics screen under a stream of publishes, in headless Chromium against a real
collector. Anyone who reaches the collector may publish, and GET /api/events answers up to 500
topics with their newest payloads (megabytes when they are large): the screen reloaded it at
every topic event, coalesced over 200 ms, so a publish every 250 ms cost each viewer a listing
every quarter second. It now updates a listed topic in place from the stream event and reloads
only for a topic it does not list, at most every 2 s."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import live_page_asking
from tests.support.collector import CollectorProcess

pytestmark = pytest.mark.slow

LISTED = [f"burst-{i:02d}" for i in range(40)]
RELOAD_S = 2.0  # the screen's RELOAD_MS


def publish(proc: CollectorProcess, topic: str, payload: Any, source: str = "pixel-7") -> None:
    status, body = proc.client.post(f"/api/events/{topic}?source={source}", payload)
    assert status == 201, (status, body)


def row(page: Any, topic: str) -> Any:
    return page.locator("table tr", has=page.locator(f"a:text-is('{topic}')"))


def test_a_burst_of_publishes_updates_the_topics_screen_without_reloading_the_listing(
        tmp_path: Path, open_page: Callable[..., Any]) -> None:
    from playwright.sync_api import expect

    proc = CollectorProcess(tmp_path / "topics").start()
    try:
        for topic in LISTED:
            publish(proc, topic, {"n": 0, "pad": "x" * 1000})
        page, listings = live_page_asking(open_page, proc.url + "/dash/topics",
                                          f"a:text-is('{LISTED[0]}')", "/api/events")

        # A burst over many listed topics: 5 rounds of 40 publishes, one every 30 ms or so.
        started = time.monotonic()
        for n in range(1, 6):
            for topic in LISTED:
                publish(proc, topic, {"n": n, "pad": "x" * 1000})
                page.wait_for_timeout(20)
        # One payload too large to ride on the stream, and a topic the page has never listed.
        publish(proc, LISTED[3], {"big": "y" * 5000})
        publish(proc, "brand-new", {"hello": "world"})
        page.wait_for_selector("a:text-is('brand-new')", timeout=10000)
        elapsed = time.monotonic() - started

        # Every listed topic shows the count the collector holds, its newest payload first.
        status, listing = proc.client.get("/api/events")
        assert status == 200
        counts = {t["topic"]: t["count"] for t in listing["topics"]}
        assert counts[LISTED[0]] == 6 and counts[LISTED[3]] == 7 and counts["brand-new"] == 1
        for topic in (LISTED[0], LISTED[17], LISTED[-1], LISTED[3]):
            expect(row(page, topic).locator("td").nth(1)).to_have_text(str(counts[topic]),
                                                                      timeout=10000)
        assert '"n":5' in row(page, LISTED[17]).locator("li").first.inner_text()
        assert "open the topic" in row(page, LISTED[3]).locator("li").first.inner_text()
        assert row(page, "brand-new").locator("td").nth(1).inner_text() == "1"

        # 202 publishes in `elapsed` seconds: at most one listing per RELOAD_S, and one more for
        # the new topic (the old screen fetched it every few hundred milliseconds).
        bound = int(elapsed / RELOAD_S) + 2
        assert len(listings) <= bound, (len(listings), bound, elapsed)
        assert len(listings) >= 1  # the new topic came with a reload of the listing
        assert page.watch.errors == []
    finally:
        proc.stop()


def test_publishes_to_topics_it_does_not_list_reload_the_listing_at_most_every_two_seconds(
        tmp_path: Path, open_page: Callable[..., Any]) -> None:
    """A topic the page does not list needs the listing (its count may be older than the page):
    a stream of new topics still costs one reload per RELOAD_S, and each shows within it."""
    proc = CollectorProcess(tmp_path / "topics").start()
    try:
        publish(proc, "first", {"n": 0})
        page, listings = live_page_asking(open_page, proc.url + "/dash/topics",
                                          "a:text-is('first')", "/api/events")
        started = time.monotonic()
        for i in range(60):
            publish(proc, f"new-{i:02d}", {"i": i, "pad": "x" * 1000})
            page.wait_for_timeout(80)
        page.wait_for_selector("a:text-is('new-59')", timeout=10000)
        elapsed = time.monotonic() - started
        assert page.locator("table.topics tbody tr").count() == 61
        bound = int(elapsed / RELOAD_S) + 2
        assert 1 <= len(listings) <= bound, (len(listings), bound, elapsed)
        assert page.watch.errors == []
    finally:
        proc.stop()


def test_a_topics_page_reads_large_events_at_most_once_a_second(
        tmp_path: Path, open_page: Callable[..., Any]) -> None:
    """An event too large to ride on the stream is read with the page's next reload of the
    topic's latest 100 events (up to 1 MiB); each one reloaded them at once."""
    proc = CollectorProcess(tmp_path / "topic-page").start()
    try:
        publish(proc, "frames", {"small": 1})
        page, reads = live_page_asking(open_page, proc.url + "/dash/topics/frames",
                                       "text=pixel-7", "/api/events/frames")
        started = time.monotonic()
        for n in range(20):
            publish(proc, "frames", {"n": n, "pad": "z" * 5000})
            page.wait_for_timeout(100)
        elapsed = time.monotonic() - started
        page.wait_for_selector("text=21 events", timeout=10000)  # the last one read too
        assert len(reads) <= int(elapsed) + 2, (len(reads), elapsed)
        assert page.watch.errors == []
    finally:
        proc.stop()

"""A poll's look records its device's sighting instead of writing last_seen; the collector
writes the sightings of a second together (fleet_min.collector.jobs.sightings). Driven through
a real collector: its HTTP API, its metrics and its SQLite file."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

from fleet_min.collector.jobs.sightings import Sightings, record
from tests.support.collector import age_rows, registration, wait_for_polls
from tests.support.metrics import parse


def stored_last_seen(db_path: Path, device_id: str) -> float:
    conn = sqlite3.connect(db_path, timeout=30)
    try:
        return float(conn.execute("SELECT last_seen FROM devices WHERE device_id = ?",
                                  (device_id,)).fetchone()[0])
    finally:
        conn.close()


async def test_a_renewal_is_answered_without_a_commit_and_the_device_is_seen_soon(client,
                                                                                  db_path):
    """The device was last seen long ago, so its poll used to rewrite last_seen in its own
    durable transaction; now the look writes nothing and the sighting follows within a
    second or so."""
    await client.post("/devices/register", json=registration("d"))
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 100 WHERE device_id = 'd'")
    before = parse(await (await client.get("/metrics")).text())
    poll = asyncio.ensure_future(client.get("/devices/d/next-job"))
    await wait_for_polls(client, 1)
    after = parse(await (await client.get("/metrics")).text())
    assert after.value("fleet_collector_db_unwritten_transactions_total") == \
        before.value("fleet_collector_db_unwritten_transactions_total") + 1
    for _ in range(60):
        record_ = await (await client.get("/api/devices/d")).json()
        if record_["last_seen_age_s"] < 5:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"the poll's sighting was never written: {record_}")
    assert time.time() - stored_last_seen(db_path, "d") < 5
    assert (await poll).status == 204  # the hold (1 s here) ran out with no job


async def test_the_last_sightings_are_written_when_the_collector_stops(collector_factory,
                                                                       db_path):
    client = await collector_factory(long_poll_s=30.0)
    await client.post("/devices/register", json=registration("d"))
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 100 WHERE device_id = 'd'")
    poll = asyncio.ensure_future(client.get("/devices/d/next-job"))
    await wait_for_polls(client, 1)
    await client.close()  # stops the service: open polls answered, the database closed
    poll.cancel()
    await asyncio.gather(poll, return_exceptions=True)
    assert time.time() - stored_last_seen(db_path, "d") < 5


async def test_recording_never_moves_last_seen_backwards(client, db_path):
    await client.post("/devices/register", json=registration("fresh"))
    await client.post("/devices/register", json=registration("old"))
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 100 WHERE device_id = 'old'")
    fresh, old = stored_last_seen(db_path, "fresh"), stored_last_seen(db_path, "old")
    conn = sqlite3.connect(db_path, timeout=30, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        # A sighting older than what a beacon wrote since, one newer, one of a deleted device.
        record(conn, [("fresh", fresh - 50), ("old", old + 60), ("gone", time.time())])
        conn.execute("COMMIT")
    finally:
        conn.close()
    assert stored_last_seen(db_path, "fresh") == fresh
    assert stored_last_seen(db_path, "old") == old + 60


def test_the_newest_sighting_of_a_device_wins_and_a_clock_step_moves_them():
    seen = Sightings()
    seen.note([("a", 10.0), ("b", 5.0)])
    seen.note([("a", 8.0), ("b", 7.0)])  # an older look of a, answered after a newer one
    assert len(seen) == 2
    seen.shift(-3.0)  # the wall clock was stepped back 3 s: stored times moved with it
    assert sorted(seen.take()) == [("a", 7.0), ("b", 4.0)]
    assert len(seen) == 0 and seen.take() == []

"""Storage stays bounded by default: retention is on, and on a simulated clock a shelf's beacons
never outgrow the window, the file gives back the space of a big prune, and a big prune runs in
many small writer transactions. A real database file made by the collector's migrations;
bench/retention.py runs the same for a whole year."""

from __future__ import annotations

import math
import os
import sqlite3
import time
from pathlib import Path

from fleet_min.collector.insight import system
from fleet_min.collector.storage.schema import MIGRATIONS
from fleet_min.config import COLLECTOR_SETTINGS, resolve
from fleet_min.db import Database

DAY_S = 86400.0
DEVICES = 20
PER_DAY = DEVICES * 1440  # one beacon a minute
BODY = '{"charging":true,"ac":true,"thermal":"nominal","temp_c":47.2,"mem_mb":2711,"load":0.4}'


def beacons_of_day(path: Path, day_start: float) -> None:
    """A day of the shelf's beacons, written straight into the file with their own times."""
    conn = sqlite3.connect(path, timeout=30)
    try:
        with conn:
            conn.executemany("INSERT INTO beacons (device_id, at, body) VALUES (?, ?, ?)",
                             [(f"pi-{n:02d}", day_start + minute * 60.0 + n, BODY)
                              for minute in range(1440) for n in range(DEVICES)])
    finally:
        conn.close()


def size(path: Path) -> int:
    return sum(os.path.getsize(f"{path}{s}") for s in ("", "-wal") if os.path.exists(f"{path}{s}"))


async def opened(tmp_path: Path) -> Database:
    db = Database(tmp_path / "fleet.sqlite3", MIGRATIONS, "NORMAL")
    await db.open()
    return db


def test_retention_runs_by_default() -> None:
    config = resolve(COLLECTOR_SETTINGS, environ={})
    assert config.retention_auto is True
    assert system.Settings().retention_auto is True
    assert (config.retain_beacons_days, config.retain_events_days) == (30.0, 30.0)


async def test_a_shelf_never_outgrows_its_window_on_a_simulated_clock(tmp_path: Path) -> None:
    db = await opened(tmp_path)
    settings = system.Settings(retain_beacons_days=2.0)  # 30 in production; 2 keeps it fast
    start = time.time() - 9 * DAY_S
    sizes, kept = [], 0
    try:
        for day in range(9):
            beacons_of_day(db.path, start + day * DAY_S)
            # what the daily loop does, with "now" at the end of the simulated day
            await system.apply(db, settings, start + (day + 1) * DAY_S)
            sizes.append(size(db.path))
        kept = (await db.read_one("SELECT COUNT(*) FROM beacons") or [0])[0]
    finally:
        await db.close()
    assert kept == 2 * PER_DAY
    steady = max(sizes[2:4])  # the window is full from the third day on
    assert max(sizes[4:]) <= steady * 1.05, sizes  # and the file no longer grows
    assert sizes[-1] < 9 * PER_DAY * len(BODY) / 2  # far below what nine days would take


async def test_a_big_backlog_is_pruned_in_batches_and_gives_its_space_back(
        tmp_path: Path) -> None:
    db = await opened(tmp_path)
    now = time.time()
    try:
        for day in range(6):  # an install that ran with retention off
            beacons_of_day(db.path, now - (6 - day) * DAY_S)
        await db.read_one("PRAGMA wal_checkpoint(TRUNCATE)")
        before, transactions = size(db.path), db.stats["transactions"]
        report = await system.apply(db, system.Settings(retain_beacons_days=1.0), now)
        deleted = report["tables"]["beacons"]["deleted"]
        used = db.stats["transactions"] - transactions
        after = size(db.path)
    finally:
        await db.close()
    assert deleted == 5 * PER_DAY
    # Small writer transactions, so claims and results interleave with the prune.
    assert used >= math.ceil(deleted / system.DELETE_BATCH) + 1
    assert report["reclaim"]["freelist_pages"] == 0
    assert report["reclaim"]["database_bytes"] == after
    assert after < before / 3  # the file shrank: incremental_vacuum gave the pages back

"""A database written by an earlier version opens, is migrated, and behaves as a new one would.
The old file is made with the migrations of that version and raw SQL; a real collector then
opens it."""

from __future__ import annotations

import json
import sqlite3
import time

from fleet_min.collector.schema import MIGRATIONS
from fleet_min.db import migrate
from tests.helpers import job, registration, result_row


def _old_database(db_path, version: int) -> None:
    db_path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(db_path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        migrate(conn, MIGRATIONS[:version])
        now = time.time()
        for job_id, status, deps in (("first", "queued", []), ("second", "waiting", ["first"])):
            spec = job(job_id, **({"depends_on": deps} if deps else {}))
            conn.execute(
                "INSERT INTO jobs (job_id, workload, executor, backend, status, max_attempts, "
                "ttl_s, spec, created_at, updated_at) VALUES (?, 'benchmark', 'device', "
                "'synthetic', ?, 3, 600, ?, ?, ?)", (job_id, status, json.dumps(spec), now, now))
            for dep in deps:
                conn.execute("INSERT INTO job_deps (job_id, depends_on) VALUES (?, ?)",
                             (job_id, dep))
    finally:
        conn.close()


async def test_a_version_1_database_promotes_its_waiting_jobs_after_the_upgrade(
        collector_factory, db_path):
    _old_database(db_path, 1)
    client = await collector_factory()
    await client.post("/devices/register", json=registration("d"))
    claimed = await (await client.get("/devices/d/next-job")).json()
    assert claimed["job_id"] == "first"
    await client.post("/results", json=result_row("first", "d", 0, final=True, ok=True))
    # Migration 2 marked "first" as waited on: closing it still promotes "second".
    assert (await (await client.get("/jobs/second")).json())["status"] == "queued"
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    finally:
        conn.close()

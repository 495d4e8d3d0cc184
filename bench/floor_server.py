"""A third ceiling: the durable server (bench/durable_server.py) doing, besides, the work the
collector's spec asks of every job, and nothing else. Where the durable server is the floor of
any durable queue on aiohttp and sqlite3, this is the floor of one that keeps the spec's rules
for the lifecycle's three requests:

- POST /jobs: the spec is checked against the job schema (fleet_min.validate, the collector's own
  checker: a clear 400 for bad input, nothing stored), and a taken job_id is a 409, not a
  second job;
- GET /devices/{id}/next-job: the device's row is read, since a job goes only to a device that
  declared its workload as a capability (spec: "capability declared, targets match"); the claim
  writes the claimant, the lease deadline and the attempt count into the job's row (spec: "Job
  row additionally holds: status, claimed_by, attempts, lease_deadline");
- POST /results: the row is checked against the result schema, and only the job's claimant may
  post it (the job is read first; a row for a job someone else holds is refused).

Left out, because the spec does not need them for one job's lifecycle here: the attempt history
table, dependencies and fan-out, the dispatcher's long polls (in bench/lifecycle.py a job is
queued before its poll arrives), events, the live stream, metrics, alerts, the sweep. So its
CPU a job is a lower bound for any server that keeps those rules on aiohttp and sqlite3
(docs/performance.md, "The spec's floor").

    python bench/floor_server.py PORT DATA_DIR
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from bench.bare_server import lifecycle_app, serve
from bench.durable_server import DATA_FILE, SCHEMA_TEXT, next_job_with, start_writer, writer
from fleet_min.validate import validate_job, validate_result

SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (device_id TEXT PRIMARY KEY, descriptor TEXT NOT NULL,
    capabilities TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (seq INTEGER PRIMARY KEY, job_id TEXT NOT NULL UNIQUE,
    device_id TEXT, workload TEXT NOT NULL, status TEXT NOT NULL, spec TEXT NOT NULL,
    claimed_by TEXT, attempts INTEGER NOT NULL DEFAULT 0, lease_deadline REAL);
CREATE INDEX IF NOT EXISTS jobs_queued ON jobs (device_id, seq) WHERE status = 'queued';
CREATE TABLE IF NOT EXISTS results (job_id TEXT NOT NULL, iter INTEGER NOT NULL,
    device_id TEXT NOT NULL, final INTEGER NOT NULL, ok INTEGER, metrics TEXT NOT NULL,
    at REAL NOT NULL, PRIMARY KEY (job_id, iter));
"""
LEASE_S = 600.0  # the spec's default lease


def refused(status: int, why: str) -> web.Response:
    return web.json_response({"error": why}, status=status)


async def register(request: web.Request) -> web.Response:
    body = json.loads(await request.read())
    await writer(request).submit(lambda c: c.execute(
        "INSERT OR REPLACE INTO devices VALUES (?, ?, ?)",
        (body["device_id"], json.dumps(body.get("descriptor")),
         json.dumps(body.get("capabilities") or []))))
    return web.json_response({"ok": True})


async def enqueue(request: web.Request) -> web.Response:
    raw = await request.read()
    spec = json.loads(raw)
    errors = validate_job(spec)
    if errors:
        return refused(400, errors[0])
    if not await writer(request).submit(lambda c: _insert(c, spec, raw)):
        return refused(409, f"job {spec['job_id']} exists")
    return web.json_response({"ok": True, "job_id": spec["job_id"], "status": "queued"},
                             status=201)


def _insert(conn: sqlite3.Connection, spec: dict[str, Any], raw: bytes) -> bool:
    """Store a checked spec as it came (`raw`); False when its job_id is taken."""
    device = (spec.get("targets") or {}).get("device_id")
    return bool(conn.execute(
        "INSERT INTO jobs (job_id, device_id, workload, status, spec) "
        "VALUES (?, ?, ?, 'queued', ?) ON CONFLICT (job_id) DO NOTHING",
        (spec["job_id"], device, spec["workload"], raw.decode())).rowcount)


def _claim(conn: sqlite3.Connection, device: str) -> str | None:
    found = conn.execute("SELECT capabilities FROM devices WHERE device_id = ?",
                         (device,)).fetchone()
    if found is None:
        return None
    row = conn.execute("SELECT seq, workload, spec FROM jobs WHERE device_id = ? "
                       "AND status = 'queued' ORDER BY seq LIMIT 1", (device,)).fetchone()
    if row is None or row[1] not in json.loads(found[0]):
        return None
    conn.execute("UPDATE jobs SET status = 'claimed', claimed_by = ?, attempts = attempts + 1, "
                 "lease_deadline = ? WHERE seq = ?", (device, time.time() + LEASE_S, row[0]))
    return str(row[2])


next_job = next_job_with(_claim)


def _store(conn: sqlite3.Connection, row: dict[str, Any]) -> str | None:
    """None once stored, else why the row is refused."""
    job = conn.execute("SELECT seq, status, claimed_by FROM jobs WHERE job_id = ?",
                       (row["job_id"],)).fetchone()
    if job is None or job[1] != "claimed" or job[2] != row["device_id"]:
        return f"job {row['job_id']} is not held by {row['device_id']}"
    conn.execute("INSERT INTO results VALUES (?, ?, ?, ?, ?, ?, ?)",
                 (row["job_id"], row["iter"], row["device_id"], int(row["final"]),
                  int(row["ok"]), json.dumps(row["metrics"]), time.time()))
    if row["final"]:
        conn.execute("UPDATE jobs SET status = ?, lease_deadline = NULL WHERE seq = ?",
                     ("succeeded" if row["ok"] else "failed", job[0]))
    return None


async def results(request: web.Request) -> web.Response:
    row = json.loads(await request.read())
    errors = validate_result(row)
    if errors:
        return refused(400, errors[0])
    why = await writer(request).submit(lambda c: _store(c, row))
    if why is not None:
        return refused(409, why)
    return web.json_response({"ok": True})


def main() -> None:
    app = lifecycle_app(enqueue, next_job, results, register)
    app[DATA_FILE] = Path(sys.argv[2]) / "floor.db"
    app[SCHEMA_TEXT] = SCHEMA
    app.on_startup.append(start_writer)
    serve(app, int(sys.argv[1]))


if __name__ == "__main__":
    main()

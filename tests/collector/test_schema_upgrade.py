"""A database written by an earlier version opens, is migrated, and behaves as a new one would.
The old file is made with the migrations of that version and raw SQL; a real collector then
opens it."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from fleet_min.collector.storage.schema import MIGRATIONS
from fleet_min.db import migrate
from tests.support.collector import job, registration, result_row


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


def _version_2_database_with_a_claimed_job(db_path) -> None:
    """A version-2 file whose job "held" is claimed by device d, its attempt open."""
    db_path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(db_path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        migrate(conn, MIGRATIONS[:2])
        now = time.time()
        conn.execute(
            "INSERT INTO devices (device_id, descriptor, capabilities, first_seen, last_seen, "
            "registered_at) VALUES ('d', '{\"platform\": \"linux\"}', '[\"benchmark\"]', ?, ?, ?)",
            (now, now, now))
        conn.execute(
            "INSERT INTO jobs (job_id, workload, executor, backend, status, claimed_by, attempts, "
            "max_attempts, ttl_s, lease_deadline, spec, created_at, updated_at, claimed_at) "
            "VALUES ('held', 'benchmark', 'device', 'synthetic', 'claimed', 'd', 1, 3, 600, ?, "
            "?, ?, ?, ?)", (now + 600, json.dumps(job("held")), now, now, now))
        conn.execute("INSERT INTO job_attempts (job_id, attempt, claimed_by, claimed_at) "
                     "VALUES ('held', 1, 'd', ?)", (now,))
    finally:
        conn.close()


async def test_a_version_2_database_closes_the_attempt_open_before_the_upgrade(
        collector_factory, db_path):
    _version_2_database_with_a_claimed_job(db_path)
    client = await collector_factory()
    resp = await client.post("/results", json=result_row("held", "d", 0, final=True, ok=True))
    assert resp.status == 200, await resp.text()
    detail = await (await client.get("/api/jobs/held")).json()
    assert detail["status"] == "done"
    # Migration 3 gave the open attempt its job's seq: the result found it and closed it.
    assert [(a["attempt"], a["claimed_by"], a["outcome"]) for a in detail["attempts"]] == [
        (1, "d", "done")]
    # A new attempt is keyed the same way and listed after it.
    await client.post("/jobs", json=job("next"))
    assert (await (await client.get("/devices/d/next-job")).json())["job_id"] == "next"
    listed = (await (await client.get("/api/jobs/next")).json())["attempts"]
    assert [(a["attempt"], a["outcome"]) for a in listed] == [(1, None)]


def test_an_attempt_is_found_through_the_index_on_its_jobs_seq(tmp_path):
    conn = sqlite3.connect(tmp_path / "plan.sqlite3")
    try:
        migrate(conn, MIGRATIONS)
        plans = {sql: " | ".join(r[3] for r in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params))
                 for sql, params in (
                     ("UPDATE job_attempts SET ended_at = ?, outcome = ?, error = ? "
                      "WHERE job_seq = ? AND ended_at IS NULL", (1.0, "done", None, 1)),
                     ("SELECT * FROM job_attempts WHERE job_seq = (SELECT seq FROM jobs WHERE "
                      "job_id = ?) ORDER BY attempt, id", ("j",)))}
        for sql, plan in plans.items():
            # Without the index both scan every attempt ever made (17 % more CPU a job, measured).
            assert "USING INDEX job_attempts_seq" in plan, (sql, plan)
    finally:
        conn.close()


def _version_4_database_with_rows(db_path) -> None:
    """A version-4 file holding the rows an older collector stored by (job, device, iter):
    job "lapsed" was claimed by d (attempt 1, expired) and then by e (attempt 2, running); host
    job "host" ran on executor mac, which filed its row under an attached device; "old" has a
    row and no attempt on record; "pre" was preempted and claimed again under attempt 1."""
    db_path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(db_path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        migrate(conn, MIGRATIONS[:4])
        t = time.time() - 1000
        for device in ("d", "e"):
            conn.execute(
                "INSERT INTO devices (device_id, descriptor, capabilities, first_seen, "
                "last_seen, registered_at) VALUES (?, '{\"platform\": \"linux\"}', "
                "'[\"benchmark\"]', ?, ?, ?)", (device, t, t, t))
        jobs = (("lapsed", "device", "claimed", "e", 2), ("host", "host", "done", None, 1),
                ("old", "device", "done", None, 0), ("pre", "device", "done", None, 1))
        for job_id, executor, status, claimed_by, attempts in jobs:
            workload = "install" if executor == "host" else "benchmark"
            conn.execute(
                "INSERT INTO jobs (job_id, workload, executor, status, claimed_by, attempts, "
                "max_attempts, ttl_s, lease_deadline, spec, created_at, updated_at, claimed_at) "
                "VALUES (?, ?, ?, ?, ?, ?, 3, 600, ?, ?, ?, ?, ?)",
                (job_id, workload, executor, status, claimed_by, attempts,
                 t + 5000 if status == "claimed" else None,
                 json.dumps(job(job_id, workload, executor)), t, t, t + 100))
        seq = {r[0]: r[1] for r in conn.execute("SELECT job_id, seq FROM jobs")}
        for job_id, attempt, claimant, at, outcome in (
                ("lapsed", 1, "d", t + 10, "expired"), ("lapsed", 2, "e", t + 100, None),
                ("host", 1, "mac", t + 10, "done"), ("pre", 1, "d", t + 10, "preempted"),
                ("pre", 1, "d", t + 50, "done")):
            conn.execute("INSERT INTO job_attempts (job_id, job_seq, attempt, claimed_by, "
                         "claimed_at, ended_at, outcome) VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (job_id, seq[job_id], attempt, claimant, at, at + 1, outcome))
        for job_id, device, iteration, at, extra in (
                ("lapsed", "d", 1, t + 20, None),    # attempt 1's row
                ("lapsed", "d", 2, t + 150, None),   # late, after e claimed: d held only 1
                ("lapsed", "e", 1, t + 120, None),   # attempt 2's
                ("host", "R5CT1234ABC", 1, t + 20, '{"executor": "mac"}'),
                ("old", "d", 0, t + 20, None),
                ("pre", "d", 1, t + 60, None)):
            conn.execute("INSERT INTO results (job_id, device_id, iter, workload, ok, final, "
                         "metrics, extra, created_at) VALUES (?, ?, ?, 'benchmark', 1, ?, "
                         "'{}', ?, ?)", (job_id, device, iteration, int(iteration == 0), extra,
                                         at))
    finally:
        conn.close()


async def test_a_version_4_database_files_its_rows_under_their_attempts(
        collector_factory, db_path):
    _version_4_database_with_rows(db_path)
    client = await collector_factory()
    listed = (await (await client.get("/api/results?page=1")).json())["results"]
    assert sorted((r["job_id"], r["device_id"], r["iter"], r["attempt"]) for r in listed) == [
        ("host", "R5CT1234ABC", 1, 1), ("lapsed", "d", 1, 1), ("lapsed", "d", 2, 1),
        ("lapsed", "e", 1, 2), ("old", "d", 0, 1), ("pre", "d", 1, 1)]
    # the running attempt goes on as before, and its final row closes the job
    reply = await (await client.post("/results", json=result_row(
        "lapsed", "e", 0, final=True, ok=True))).json()
    assert (reply["attempt"], reply["status"]) == (2, "done")
    # the uniqueness now includes the attempt: d's attempt-1 key is free in another attempt
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        indexes = {r[1]: r[2] for r in conn.execute("PRAGMA index_list(results)")}
        assert {"results_device", "results_workload", "results_created"} <= set(indexes)
        unique = [name for name, is_unique in indexes.items() if is_unique]
        assert [[c[2] for c in conn.execute(f"PRAGMA index_info({name})")] for name in unique
                ] == [["job_id", "device_id", "iter", "attempt"]]
        conn.execute("INSERT INTO results (job_id, device_id, iter, attempt, metrics, "
                     "created_at) VALUES ('lapsed', 'd', 1, 2, '{}', 0)")
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute("INSERT INTO results (job_id, device_id, iter, attempt, metrics, "
                         "created_at) VALUES ('lapsed', 'd', 1, 1, '{}', 0)")
    finally:
        conn.close()


async def test_a_version_3_database_learns_its_queued_jobs_variants(collector_factory, db_path):
    """Migration 7 fills jobs.variant for jobs stored before it (the backend, or a build's
    toolchain), so a device that declared only a pairing is offered them through the new
    index, and adds the executors table and jobs.warnings."""
    db_path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(db_path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        migrate(conn, MIGRATIONS[:3])
        now = time.time()
        for job_id, workload, backend, params in (
                ("xcode-build", "build", None, {"kind": "xcode"}),
                ("gradle-build", "build", None, {"kind": "gradle"}),
                ("web-bench", "benchmark", "webcrypto", {}),
                ("js-bench", "benchmark", "jssha", {})):
            spec = job(job_id, workload=workload, params=params,
                       **({"backend": backend} if backend else {}))
            conn.execute(
                "INSERT INTO jobs (job_id, workload, executor, backend, status, max_attempts, "
                "ttl_s, spec, created_at, updated_at) VALUES (?, ?, 'device', ?, 'queued', 3, "
                "600, ?, ?, ?)", (job_id, workload, backend, json.dumps(spec), now, now))
    finally:
        conn.close()
    client = await collector_factory()
    await client.post("/devices/register", json=registration(
        "d", capabilities=["build:gradle", "benchmark:jssha"]))
    got = []
    for _ in range(3):
        resp = await client.get("/devices/d/next-job")
        if resp.status == 204:
            break
        job_id = (await resp.json())["job_id"]
        got.append(job_id)
        await client.post("/results", json=result_row(job_id, "d", 0, final=True, ok=True))
    assert got == ["gradle-build", "js-bench"]
    assert (await (await client.get("/jobs/xcode-build")).json())["warnings"] == []
    assert (await client.get("/executor/next-job?name=mac")).status == 204
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("SELECT name FROM executors").fetchall() == [("mac",)]
        assert dict(conn.execute("SELECT job_id, variant FROM jobs").fetchall()) == {
            "xcode-build": "xcode", "gradle-build": "gradle", "web-bench": "webcrypto",
            "js-bench": "jssha"}
    finally:
        conn.close()


async def test_a_version_7_database_keeps_its_executors_and_learns_ui_test_variants(
        collector_factory, db_path):
    """Migration 10 rebuilds executors (a registration needs no poll) keeping the executors
    seen, and gives a queued ui-test its suite kind as its variant, so an executor that
    declared ui-test:flow_runner is offered it."""
    db_path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(db_path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        migrate(conn, MIGRATIONS[:7])
        now = time.time()
        conn.execute("INSERT INTO executors (name, first_seen, last_poll, slots) "
                     "VALUES ('old-mac', ?, ?, 3)", (now - 60, now - 60))
        for job_id, kind in (("flows", "flow_runner"), ("bundle", "native_bundle")):
            spec = job(job_id, workload="ui-test", executor="host",
                       app={"id": "com.example"}, suite={"kind": kind, "flows": "f/"})
            conn.execute(
                "INSERT INTO jobs (job_id, workload, executor, status, max_attempts, ttl_s, "
                "spec, created_at, updated_at) VALUES (?, 'ui-test', 'host', 'queued', 3, "
                "600, ?, ?, ?)", (job_id, json.dumps(spec), now, now))
    finally:
        conn.close()
    client = await collector_factory(long_poll_s=0.05)
    listed = await (await client.get("/api/executors")).json()
    assert [(e["name"], e["slots"], e["capabilities"]) for e in listed["executors"]] == [
        ("old-mac", 3, None)]
    resp = await client.post("/executors/register", json={
        "name": "lab", "capabilities": ["ui-test:flow_runner"]})
    assert resp.status == 200
    resp = await client.get("/executor/next-job?name=lab")
    assert (await resp.json())["job_id"] == "flows"
    assert (await client.get("/executor/next-job?name=lab&slots=2")).status == 204

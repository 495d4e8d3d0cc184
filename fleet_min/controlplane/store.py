"""The control plane's SQLite schema (every table, by migration) and the rows several features
share: live settings, the audit log, runner events and the job history.

Write functions take the sqlite3 connection first: each is one transaction, run by
Database.write on the event loop's thread with no await between its statements and committed
(with whatever ran beside it) by the database's COMMIT thread. Read functions are coroutines
over Database.read. A feature's own tables are written by its own module (forecasts in
analysis/forecaster.py, decisions in analysis/autoscaler.py, agent hosts in federation/). Every
table is bounded, so a host that runs for years does not grow the file without end.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from fleet_min.db import Database
from fleet_min.timeutil import iso, now

MIGRATIONS: list[str] = [
    """
    CREATE TABLE settings (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE audit (
        id INTEGER PRIMARY KEY,
        at REAL NOT NULL,
        who TEXT NOT NULL,
        action TEXT NOT NULL,
        args TEXT NOT NULL,
        ok INTEGER NOT NULL,
        code INTEGER,
        duration_ms INTEGER NOT NULL,
        error TEXT
    );
    CREATE INDEX audit_at ON audit (at);
    CREATE TABLE events (
        id INTEGER PRIMARY KEY,
        at REAL NOT NULL,
        runner TEXT NOT NULL,
        kind TEXT NOT NULL,
        message TEXT NOT NULL
    );
    CREATE INDEX events_runner ON events (runner, at);
    CREATE TABLE jobs (
        job_id INTEGER PRIMARY KEY,
        run_id INTEGER NOT NULL,
        repo TEXT NOT NULL,
        name TEXT NOT NULL,
        workflow TEXT,
        runner TEXT,
        status TEXT NOT NULL,
        conclusion TEXT,
        created_at REAL,
        started_at REAL,
        completed_at REAL,
        labels TEXT NOT NULL DEFAULT '[]'
    );
    CREATE INDEX jobs_runner ON jobs (runner, started_at);
    """,
    # 2: job history with steps, workflow files, forecasts, autoscale, admission, federation.
    """
    ALTER TABLE jobs ADD COLUMN run_attempt INTEGER NOT NULL DEFAULT 1;
    ALTER TABLE jobs ADD COLUMN head_branch TEXT;
    ALTER TABLE jobs ADD COLUMN event TEXT;
    ALTER TABLE jobs ADD COLUMN steps TEXT NOT NULL DEFAULT '[]';
    CREATE INDEX jobs_completed ON jobs (completed_at);
    CREATE INDEX jobs_repo_completed ON jobs (repo, completed_at);
    CREATE TABLE history_runs (
        repo TEXT NOT NULL,
        run_id INTEGER NOT NULL,
        run_attempt INTEGER NOT NULL,
        created_at REAL,
        fetched_at REAL NOT NULL,
        jobs INTEGER NOT NULL,
        PRIMARY KEY (repo, run_id, run_attempt)
    ) WITHOUT ROWID;
    CREATE TABLE history_state (
        repo TEXT PRIMARY KEY,
        backfill_since REAL NOT NULL,
        caught_up_at REAL,
        last_round_at REAL,
        last_error TEXT,
        pending INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE workflow_files (
        repo TEXT NOT NULL,
        path TEXT NOT NULL,
        ref TEXT NOT NULL,
        sha TEXT NOT NULL,
        content TEXT NOT NULL,
        fetched_at REAL NOT NULL,
        PRIMARY KEY (repo, path)
    );
    CREATE TABLE forecasts (
        repo TEXT NOT NULL,
        hour_start REAL NOT NULL,
        source TEXT NOT NULL,
        predicted REAL NOT NULL,
        confidence TEXT NOT NULL,
        made_at REAL NOT NULL,
        detail TEXT NOT NULL DEFAULT '{}',
        actual REAL,
        scored_at REAL,
        PRIMARY KEY (repo, hour_start, source)
    );
    CREATE TABLE autoscale (
        id INTEGER PRIMARY KEY,
        at REAL NOT NULL,
        last_seen_at REAL NOT NULL,
        seen INTEGER NOT NULL DEFAULT 1,
        repo TEXT NOT NULL,
        direction TEXT NOT NULL,
        outcome TEXT NOT NULL,
        mode TEXT NOT NULL,
        action TEXT,
        args TEXT NOT NULL DEFAULT '{}',
        reasons TEXT NOT NULL,
        inputs TEXT NOT NULL,
        result TEXT
    );
    CREATE INDEX autoscale_repo ON autoscale (repo, id);
    CREATE TABLE duplicates (
        name TEXT PRIMARY KEY,
        sibling TEXT NOT NULL,
        repo TEXT NOT NULL,
        created_at REAL NOT NULL,
        who TEXT NOT NULL
    );
    CREATE TABLE admission (
        id INTEGER PRIMARY KEY,
        at REAL NOT NULL,
        runner TEXT,
        repo TEXT,
        run_id INTEGER,
        job TEXT,
        workflow TEXT,
        decision TEXT NOT NULL,
        wait_s REAL,
        reason TEXT,
        load REAL
    );
    CREATE INDEX admission_at ON admission (at);
    CREATE TABLE admission_cursor (
        path TEXT PRIMARY KEY,
        inode INTEGER,
        offset INTEGER NOT NULL,
        head TEXT,
        bad_lines INTEGER NOT NULL DEFAULT 0,
        updated_at REAL NOT NULL
    );
    CREATE TABLE hosts (
        name TEXT PRIMARY KEY,
        first_seen REAL NOT NULL,
        last_seen REAL NOT NULL,
        report TEXT NOT NULL
    );
    CREATE TABLE host_commands (
        id TEXT PRIMARY KEY,
        host TEXT NOT NULL,
        action TEXT NOT NULL,
        args TEXT NOT NULL,
        who TEXT NOT NULL,
        queued_at REAL NOT NULL,
        sent_at REAL,
        sends INTEGER NOT NULL DEFAULT 0,
        done_at REAL,
        ok INTEGER,
        error TEXT,
        output TEXT
    );
    CREATE INDEX host_commands_host ON host_commands (host, done_at);
    """,
    # 3: ordered federation commands. The coordinator numbers each agent's commands in one
    # queue (host_queues; a new queue id restarts the numbers) and the agent keeps the last
    # number it applied and each command's result (link_state, link_results) across restarts.
    """
    ALTER TABLE host_commands ADD COLUMN seq INTEGER;
    ALTER TABLE host_commands ADD COLUMN code INTEGER;
    ALTER TABLE host_commands ADD COLUMN runner TEXT;
    CREATE UNIQUE INDEX host_commands_seq ON host_commands (host, seq);
    CREATE TABLE host_queues (
        host TEXT PRIMARY KEY,
        queue TEXT NOT NULL,
        last_seq INTEGER NOT NULL DEFAULT 0,
        applied INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE link_state (
        queue TEXT PRIMARY KEY,
        applied INTEGER NOT NULL DEFAULT 0,
        running INTEGER,
        running_id TEXT,
        updated_at REAL NOT NULL
    );
    CREATE TABLE link_results (
        id TEXT PRIMARY KEY,
        queue TEXT,
        seq INTEGER,
        result TEXT NOT NULL,
        reported INTEGER NOT NULL DEFAULT 0,
        at REAL NOT NULL
    );
    CREATE INDEX link_results_owed ON link_results (reported, at);
    """,
    # 4: the agent instance last heard under each host name (federation/hosts.py), so that the
    # name stays with its agent across a restart of the coordinator.
    """
    ALTER TABLE hosts ADD COLUMN instance TEXT;
    """,
    # 5: a count of the changes to jobs a report reads (analysis/reports.py keeps a window's
    # figures while it stands). Kept by triggers, so every writer bumps it, and an upsert that
    # changes nothing a report reads (the sync's every round) does not.
    """
    CREATE TABLE jobs_changes (n INTEGER NOT NULL);
    INSERT INTO jobs_changes (n) VALUES (0);
    CREATE TRIGGER jobs_inserted AFTER INSERT ON jobs
        BEGIN UPDATE jobs_changes SET n = n + 1; END;
    CREATE TRIGGER jobs_deleted AFTER DELETE ON jobs
        BEGIN UPDATE jobs_changes SET n = n + 1; END;
    CREATE TRIGGER jobs_updated AFTER UPDATE ON jobs
        WHEN OLD.status IS NOT NEW.status OR OLD.conclusion IS NOT NEW.conclusion
          OR OLD.runner IS NOT NEW.runner OR OLD.created_at IS NOT NEW.created_at
          OR OLD.started_at IS NOT NEW.started_at OR OLD.completed_at IS NOT NEW.completed_at
          OR OLD.steps IS NOT NEW.steps OR OLD.labels IS NOT NEW.labels
          OR OLD.name IS NOT NEW.name OR OLD.workflow IS NOT NEW.workflow
          OR OLD.repo IS NOT NEW.repo
        BEGIN UPDATE jobs_changes SET n = n + 1; END;
    """,
]

KEEP_AUDIT = 20000
KEEP_EVENTS = 20000
KEEP_JOBS_S = 400 * 86400  # analytics look back up to 365 days


# --- writes (transactions for Database.write) ----------------------------------------------

def put_setting(conn: sqlite3.Connection, key: str, value: Any) -> None:
    conn.execute("INSERT INTO settings (key, value, updated_at) VALUES (?, ?, ?) "
                 "ON CONFLICT (key) DO UPDATE SET value = excluded.value, "
                 "updated_at = excluded.updated_at", (key, json.dumps(value), now()))


def delete_setting(conn: sqlite3.Connection, key: str) -> None:
    conn.execute("DELETE FROM settings WHERE key = ?", (key,))


def add_audit(conn: sqlite3.Connection, who: str, action: str, args: dict[str, Any], ok: bool,
              code: int | None, duration_ms: int, error: str | None) -> int:
    cur = conn.execute(
        "INSERT INTO audit (at, who, action, args, ok, code, duration_ms, error) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (now(), who, action, json.dumps(args, sort_keys=True), int(ok), code, duration_ms, error))
    conn.execute("DELETE FROM audit WHERE id <= ?", ((cur.lastrowid or 0) - KEEP_AUDIT,))
    return cur.lastrowid or 0


def add_events(conn: sqlite3.Connection, events: list[tuple[str, str, str]]) -> None:
    """Append (runner, kind, message) events stamped now."""
    at = now()
    conn.executemany("INSERT INTO events (at, runner, kind, message) VALUES (?, ?, ?, ?)",
                     [(at, runner, kind, message) for runner, kind, message in events])
    last = conn.execute("SELECT max(id) FROM events").fetchone()[0] or 0
    conn.execute("DELETE FROM events WHERE id <= ?", (last - KEEP_EVENTS,))


_UPSERT_JOB = (
    "INSERT INTO jobs (job_id, run_id, repo, name, workflow, runner, status, conclusion, "
    "created_at, started_at, completed_at, labels, run_attempt, head_branch, event, steps) "
    "VALUES (:job_id, :run_id, :repo, :name, :workflow, :runner, :status, :conclusion, "
    ":created_at, :started_at, :completed_at, :labels, :run_attempt, :head_branch, :event, "
    ":steps) ON CONFLICT (job_id) DO UPDATE SET status = excluded.status, "
    "conclusion = excluded.conclusion, runner = coalesce(excluded.runner, jobs.runner), "
    "created_at = coalesce(excluded.created_at, jobs.created_at), "
    "started_at = excluded.started_at, completed_at = excluded.completed_at, "
    "run_attempt = excluded.run_attempt, "
    "head_branch = coalesce(excluded.head_branch, jobs.head_branch), "
    "event = coalesce(excluded.event, jobs.event), "
    "steps = CASE WHEN excluded.steps = '[]' THEN jobs.steps ELSE excluded.steps END")


def upsert_jobs(conn: sqlite3.Connection, jobs: list[dict[str, Any]]) -> None:
    """Insert or update jobs by job id (idempotent: the same job twice is one row)."""
    conn.executemany(_UPSERT_JOB, [
        {"run_attempt": 1, "head_branch": None, "event": None, **job,
         "labels": json.dumps(job.get("labels", [])),
         "steps": json.dumps(job.get("steps") or [], separators=(",", ":"))} for job in jobs])


def prune_jobs(conn: sqlite3.Connection, at: float) -> int:
    """Retention: jobs (and fetched-run marks) older than KEEP_JOBS_S go."""
    cutoff = at - KEEP_JOBS_S
    removed = conn.execute("DELETE FROM jobs WHERE completed_at < ?", (cutoff,)).rowcount
    removed += conn.execute("DELETE FROM jobs WHERE completed_at IS NULL AND created_at < ?",
                            (cutoff,)).rowcount
    conn.execute("DELETE FROM history_runs WHERE created_at < ?", (cutoff,))
    return removed


# --- reads ---------------------------------------------------------------------------------

async def stored_settings(db: Database) -> dict[str, Any]:
    rows = await db.read("SELECT key, value FROM settings")
    return {row["key"]: json.loads(row["value"]) for row in rows}


async def recent_events(db: Database, runner: str, limit: int = 50) -> list[dict[str, Any]]:
    rows = await db.read("SELECT at, kind, message FROM events WHERE runner = ? "
                         "ORDER BY id DESC LIMIT ?", (runner, limit))
    return [{"at": iso(r["at"]), "kind": r["kind"], "message": r["message"]} for r in rows]


async def recent_jobs(db: Database, runner: str, limit: int = 30) -> list[dict[str, Any]]:
    rows = await db.read(
        "SELECT * FROM jobs WHERE runner = ? ORDER BY coalesce(started_at, created_at) DESC "
        "LIMIT ?", (runner, limit))
    return [_job(r) for r in rows]


def _job(row: sqlite3.Row) -> dict[str, Any]:
    started, completed = row["started_at"], row["completed_at"]
    return {"job_id": row["job_id"], "run_id": row["run_id"], "repo": row["repo"],
            "name": row["name"], "workflow": row["workflow"], "status": row["status"],
            "conclusion": row["conclusion"], "created_at": iso(row["created_at"]),
            "started_at": iso(started), "completed_at": iso(completed),
            "duration_s": round(completed - started, 1) if started and completed else None,
            "labels": json.loads(row["labels"])}


async def busy_seconds(db: Database, runner: str, since: float, until: float) -> float:
    """Seconds of `runner`'s jobs that fall inside [since, until]; running jobs count to now."""
    row = await db.read_one(
        "SELECT sum(min(coalesce(completed_at, ?), ?) - max(started_at, ?)) AS busy FROM jobs "
        "WHERE runner = ? AND started_at IS NOT NULL AND coalesce(completed_at, ?) > ? "
        "AND started_at < ?", (until, until, since, runner, until, since, until))
    return float(row["busy"] or 0.0) if row else 0.0


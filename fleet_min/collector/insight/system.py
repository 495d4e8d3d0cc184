"""What the collector is holding on disk (GET /api/system) and the retention policy that keeps
it bounded: old beacons, old topic events and long-resolved alerts are pruned, in batches, so a
shelf can run for a year on an SD card.

Retention is a dry run unless asked to apply. Applying deletes in batches, each its own writer
transaction (so claims and results interleave with it), then hands the space back: PRAGMA
incremental_vacuum when the database was created with auto_vacuum=INCREMENTAL, and always a
wal_checkpoint(TRUNCATE) so the write-ahead log shrinks to nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet_min import timeutil
from fleet_min.db import Database, Periodic, quote_identifier
from fleet_min.errors import BadRequest
from fleet_min.timeutil import iso

log = logging.getLogger(__name__)

DAY_S = 86400.0
# Each batch is one writer transaction run on the event loop's thread, so its size bounds how
# long a prune holds claims and polls up: 1000 beacon rows take ~2 ms here, ~10 ms on a Pi
# (bench/retention.py measures the loop's longest stall).
DELETE_BATCH = 1000
VACUUM_PAGES = 64  # free pages handed back to the file system per writer transaction


@dataclass(frozen=True)
class Settings:
    """The insight feature's settings (see fleet_min.collector.http.insight.insight_settings)."""

    retain_beacons_days: float = 30.0
    retain_events_days: float = 30.0
    retain_alerts_days: float = 90.0
    retention_auto: bool = True
    log_file: str | None = None
    ci_status: dict[str, Any] | None = None  # ci_status.CiSettings.describe(); None: not armed


@dataclass(frozen=True)
class _Rule:
    table: str
    key: str  # the rowid alias deleted by
    condition: str  # one bound parameter: the cutoff time
    setting: str

    def days(self, settings: Settings) -> float:
        return float(getattr(settings, self.setting))


# Constant table and column names only; the cutoff is always a bound parameter.
RULES = (
    _Rule("beacons", "id", "at < ?", "retain_beacons_days"),
    _Rule("topic_events", "seq", "at < ?", "retain_events_days"),
    _Rule("alerts", "id", "state = 'resolved' AND resolved_at < ?", "retain_alerts_days"),
)


def policy(settings: Settings) -> dict[str, Any]:
    return {"beacons_days": settings.retain_beacons_days,
            "events_days": settings.retain_events_days,
            "alerts_days": settings.retain_alerts_days,
            "auto": settings.retention_auto,
            "note": "0 days keeps that table forever; resolved alerts only are pruned"}


# -- figures -----------------------------------------------------------------------------------


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def tree_size(root: Path) -> dict[str, Any]:
    """Regular files under root (symlinks are not followed) and their total size."""
    count, total = 0, 0
    pending = [root]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode):
                pending.append(Path(entry.path))
            elif stat.S_ISREG(info.st_mode):
                count += 1
                total += info.st_size
    return {"count": count, "size_bytes": total}


def log_figures(configured: str | None) -> dict[str, Any] | None:
    """The log file's size: the configured one, else stderr when it is a regular file."""
    if configured:
        return {"path": configured, "size_bytes": _size(Path(configured))}
    try:
        info = os.fstat(2)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode):
        return None  # a terminal, a pipe or the journal: nothing here to measure
    try:
        path: str | None = os.readlink("/proc/self/fd/2")
    except OSError:
        path = None
    return {"path": path, "size_bytes": info.st_size}


async def database_figures(db: Database) -> dict[str, Any]:
    pragmas = {}
    for name in ("page_size", "page_count", "freelist_count", "auto_vacuum"):
        row = await db.read_one(f"PRAGMA {name}")
        pragmas[name] = row[0] if row else None
    wal = Path(str(db.path) + "-wal")
    return {"path": str(db.path), "size_bytes": _size(db.path), "wal_bytes": _size(wal) or 0,
            "page_size": pragmas["page_size"], "page_count": pragmas["page_count"],
            "freelist_pages": pragmas["freelist_count"],
            "auto_vacuum": {0: "none", 1: "full", 2: "incremental"}.get(
                pragmas["auto_vacuum"] or 0, "none")}



async def row_counts(db: Database) -> dict[str, int]:
    tables = await db.read("SELECT name FROM sqlite_master WHERE type = 'table' "
                           "AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name")
    counts = {}
    for table in tables:
        row = await db.read_one(f"SELECT COUNT(*) FROM {quote_identifier(table['name'])}")
        counts[table["name"]] = row[0] if row else 0
    return counts


async def system_info(db: Database, data_dir: Path, started_at: float, now: float,
                      retention: Retention) -> dict[str, Any]:
    settings = retention.settings
    artifacts_dir = data_dir / "artifacts"
    store = (await asyncio.to_thread(tree_size, artifacts_dir) if artifacts_dir.is_dir()
             else {"count": 0, "size_bytes": 0})
    database = await database_figures(db)
    tables = await row_counts(db)
    ci = settings.ci_status or {"armed": False, "repos": None, "posting": False,
                                "problem": None}
    return {
        "uptime_s": round(now - started_at, 3), "started_at": iso(started_at), "now": iso(now),
        "data_dir": str(data_dir),
        "database": database,
        "tables": tables,
        # The original's names for the same figures: db.counts, artifacts.files, ci.armed.
        "db": {"path": database["path"], "size_bytes": database["size_bytes"],
               "counts": tables},
        "artifacts": {"path": str(artifacts_dir), **store, "files": store["count"],
                      "bytes": store["size_bytes"]},
        "log": log_figures(settings.log_file),
        "ci_status": ci,
        "ci": {"armed": bool(ci.get("armed"))},
        "retention": {**policy(settings), "last_run": retention.last_run,
                      "next_run": iso(retention.next_run)},
    }


# -- retention ---------------------------------------------------------------------------------


def _cutoff(rule: _Rule, settings: Settings, now: float) -> float | None:
    days = rule.days(settings)
    return now - days * DAY_S if days > 0 else None


async def dry_run(db: Database, settings: Settings, now: float) -> dict[str, Any]:
    tables = {}
    for rule in RULES:
        cutoff = _cutoff(rule, settings, now)
        count = 0
        if cutoff is not None:
            row = await db.read_one(f"SELECT COUNT(*) FROM {rule.table} WHERE {rule.condition}",
                                    (cutoff,))
            count = row[0] if row else 0
        tables[rule.table] = {"retain_days": rule.days(settings), "older_than": iso(cutoff),
                              "would_delete": count}
    # dry_run and would_delete are the original's names for the same report.
    return {"ok": True, "apply": False, "dry_run": True, "policy": policy(settings),
            "tables": tables, "would_delete": {
                ORIGINAL_NAMES[table]: figures["would_delete"]
                for table, figures in tables.items()}}


# The original's names for the tables, and for the windows its clients send in a request.
ORIGINAL_NAMES = {"beacons": "beacons", "topic_events": "events", "alerts": "alerts"}
WINDOW_FIELDS = {"beacon_days": "retain_beacons_days", "event_days": "retain_events_days",
                 "alert_days": "retain_alerts_days"}
MAX_WINDOW_DAYS = 36500


def retention_request(body: dict[str, Any], settings: Settings) -> tuple[bool, Settings]:
    """Read POST /api/system/retention: `apply` (false unless true) and, in the original's
    shape, windows in days for this run only (beacon_days, event_days, alert_days)."""
    unknown = sorted(set(body) - {"apply", *WINDOW_FIELDS})
    if unknown:
        raise BadRequest(f"{unknown[0]!r} is not accepted: send \"apply\" (false reports what "
                         "would be deleted, true deletes it) and optionally beacon_days, "
                         "event_days, alert_days")
    apply_changes = body.get("apply", False)
    if not isinstance(apply_changes, bool):
        raise BadRequest("apply must be true or false")
    windows: dict[str, Any] = {}
    for name, setting in WINDOW_FIELDS.items():
        if name not in body:
            continue
        days = body[name]
        if isinstance(days, bool) or not isinstance(days, int | float) or not (
                1 <= days <= MAX_WINDOW_DAYS):
            raise BadRequest(f"{name} must be a number of days from 1 to {MAX_WINDOW_DAYS}")
        windows[setting] = float(days)
    return apply_changes, dataclasses.replace(settings, **windows)


class _Slowest:
    """The longest a retention transaction held the event loop's thread, for the report: wall
    time (what a waiting claim saw) and the thread's CPU time (what was ours, not the disk's
    or another process's)."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def timed(self, fn: Callable[..., int]) -> Callable[..., int]:
        def run(conn: sqlite3.Connection, *args: Any) -> int:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(conn, *args)
            finally:
                self.wall = max(self.wall, time.perf_counter() - wall)
                self.cpu = max(self.cpu, time.thread_time() - cpu)
        return run

    def report(self) -> dict[str, float]:
        return {"slowest_transaction_ms": round(self.wall * 1000, 1),
                "slowest_transaction_cpu_ms": round(self.cpu * 1000, 1)}


def _delete_batch(conn: sqlite3.Connection, rule: _Rule, cutoff: float, batch: int) -> int:
    cursor = conn.execute(
        f"DELETE FROM {rule.table} WHERE {rule.key} IN "
        f"(SELECT {rule.key} FROM {rule.table} WHERE {rule.condition} LIMIT ?)",
        (cutoff, batch))
    return cursor.rowcount


def _incremental_vacuum(conn: sqlite3.Connection, pages: int) -> int:
    """Hand up to `pages` free pages back to the file system; how many were.

    Each step of `PRAGMA incremental_vacuum` frees one page, and Python's sqlite3 steps a
    statement that returns no columns only once per execute (fetchall does not step it further:
    that used to free a single page per run), so it is executed once per page.
    """
    if conn.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
        return 0
    free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    for _ in range(min(pages, free)):
        conn.execute("PRAGMA incremental_vacuum")
    return int(free - conn.execute("PRAGMA freelist_count").fetchone()[0])


async def apply(db: Database, settings: Settings, now: float,
                batch: int = DELETE_BATCH) -> dict[str, Any]:
    tables = {}
    slowest = _Slowest()
    delete = slowest.timed(_delete_batch)
    for rule in RULES:
        cutoff = _cutoff(rule, settings, now)
        deleted = 0
        while cutoff is not None:
            removed = await db.write(delete, rule, cutoff, batch, replay=True)
            deleted += removed
            if removed < batch:
                break
        tables[rule.table] = {"retain_days": rule.days(settings), "older_than": iso(cutoff),
                              "deleted": deleted}
    reclaimed = await reclaim(db, slowest)
    return {"ok": True, "apply": True, "dry_run": False, "policy": policy(settings),
            "tables": tables,
            "reclaim": reclaimed, **slowest.report()}


async def reclaim(db: Database, slowest: _Slowest | None = None) -> dict[str, Any]:
    """Hand freed pages back to the filesystem and shrink the write-ahead log."""
    vacuum = (slowest or _Slowest()).timed(_incremental_vacuum)
    # A page at a time per step, VACUUM_PAGES per transaction: after a big prune there may be
    # hundreds of thousands, and the loop serves requests between transactions.
    while await db.write(vacuum, VACUUM_PAGES, replay=True) == VACUUM_PAGES:
        pass
    # A checkpoint cannot run inside a transaction, and every writer call is one, so it goes
    # through the read connection (a checkpoint copies pages; it changes no rows).
    row = await db.read_one("PRAGMA wal_checkpoint(TRUNCATE)")
    figures = await database_figures(db)
    return {"checkpoint_busy": bool(row[0]) if row else None,
            "database_bytes": figures["size_bytes"], "wal_bytes": figures["wal_bytes"],
            "freelist_pages": figures["freelist_pages"], "auto_vacuum": figures["auto_vacuum"]}


class Retention:
    """One retention run at a time; the last applied run is remembered for /api/system."""

    def __init__(self, db: Database, settings: Settings) -> None:
        self.db = db
        self.settings = settings
        self.last_run: dict[str, Any] | None = None
        self.next_run: float | None = None  # set while the automatic loop is waiting
        self._lock = asyncio.Lock()

    async def run(self, apply_changes: bool, now: float, settings: Settings | None = None
                  ) -> dict[str, Any]:
        """One run under the configured windows, or under `settings` (a request's own)."""
        settings = settings or self.settings
        async with self._lock:
            if not apply_changes:
                return await dry_run(self.db, settings, now)
            report = await apply(self.db, settings, now)
            self.last_run = {"at": iso(now), "deleted": {
                table: figures["deleted"] for table, figures in report["tables"].items()}}
            return report

    async def daily(self, first_delay_s: float = 60.0) -> None:
        """The automatic loop (on unless FLEET_RETENTION_AUTO=0): a minute after start, then
        daily."""
        periodic = Periodic("the retention run", log)

        async def prune() -> None:
            report = await self.run(True, timeutil.now())
            log.info("retention pruned %s", {table: figures["deleted"]
                                             for table, figures in report["tables"].items()})

        delay = first_delay_s
        while True:
            self.next_run = timeutil.now() + delay
            await asyncio.sleep(delay)
            delay = DAY_S
            await periodic.run(prune)

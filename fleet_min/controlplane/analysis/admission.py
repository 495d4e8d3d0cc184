"""Job admission decisions, read from the log the runners' job-started hook appends to.

The hook (deploy/controlplane/job-started.sh) writes one JSON object per line: `admitted`
(started at once), `held` (the host was overloaded; the job waits), `released` (the wait ended)
or `timed_out` (the wait hit its limit and the job went on). The daemon reads the log
incrementally from a stored byte offset, in the same transaction as the rows it adds, so every
line is stored once however often the daemon restarts. Only whole lines are consumed: a line
the hook is still writing stays for the next read. A log that shrank (truncated), was replaced
(another inode) or whose first bytes changed (truncated and written again past the old offset)
is read again from its start. Lines that are not such objects, or whose numbers are not
finite (or, for the run id, not a whole number SQLite's INTEGER holds), are counted and
skipped: the read goes on past them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet_min.controlplane.analysis.stats import percentiles
from fleet_min.db import Database
from fleet_min.timeutil import iso, parse_iso

DECISIONS = ("admitted", "held", "released", "timed_out")
CHUNK = 1 << 20
MAX_LINE = 64 * 1024
HEAD = 64
SQLITE_MIN, SQLITE_MAX = -(2**63), 2**63 - 1
_DIGITS = re.compile(r"[+-]?[0-9]{1,19}")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class Cursor:
    inode: int | None
    offset: int
    head: str | None


@dataclass
class Batch:
    rows: list[tuple[Any, ...]]
    cursor: Cursor
    bad: int


def _head(data: bytes) -> str:
    """A fingerprint of the log's first bytes: '<length>:<sha256>'."""
    prefix = data[:HEAD]
    return f"{len(prefix)}:{hashlib.sha256(prefix).hexdigest()}"


def _same_start(head: bytes, stored: str | None) -> bool:
    if not stored:
        return True
    length, _, _ = stored.partition(":")
    return length.isdigit() and _head(head[:int(length)]) == stored


class _Bad(ValueError):
    """A field of a line that no row can hold."""


def parse_line(raw: bytes) -> tuple[Any, ...] | None:
    """One log line -> an admission row, or None when it is not a decision object or a field
    of it cannot be stored as it is meant: such a line is counted and skipped, never retried
    (an exception here would keep the read position before it, and stop the reading for good).
    """
    if len(raw) > MAX_LINE:
        return None
    try:
        entry = json.loads(raw)
    except (ValueError, RecursionError):  # 64 KiB of brackets nest past the parser's limit
        return None
    if not isinstance(entry, dict) or entry.get("decision") not in DECISIONS:
        return None

    def text(key: str) -> str | None:
        value = entry.get(key)
        if value == "" or isinstance(value, bool) or not isinstance(value, str | int | float):
            return None  # str() of a list nested a thousand deep is a RecursionError
        # SQLite stores UTF-8: a lone surrogate (JSON lets "\ud800" through) fails the INSERT.
        return _SURROGATE.sub("\ufffd", str(value)[:300])

    try:
        at = entry.get("at")
        if not isinstance(at, str):
            return None
        return (parse_iso(at), text("runner"), text("repo"), _integer(entry.get("run_id")),
                text("job"), text("workflow"), entry["decision"], _real(entry.get("wait_s")),
                text("reason"), _real(entry.get("load")))
    except (ValueError, OverflowError):
        return None


def _real(value: Any) -> float | None:
    """A finite number (a JSON number or the text of one), None when absent. NaN or infinity
    would be stored (as NULL or Inf) and then served as JSON no client reads."""
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise _Bad(value)
    number = float(value)  # ValueError for text that is no number, OverflowError for 10**400
    if not math.isfinite(number):
        raise _Bad(value)
    return number


def _integer(value: Any) -> int | None:
    """A whole number SQLite's INTEGER holds (the hook writes the run id as text), None when
    absent. int(float("nan")) raised, and 1e30 failed the INSERT: either stopped the reading."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value  # every digit, which float() would round
    elif isinstance(value, str) and _DIGITS.fullmatch(value.strip()):
        number = int(value)
    else:
        real = _real(value)
        if real is None:
            return None
        if not real.is_integer():
            raise _Bad(value)
        number = int(real)
    if not SQLITE_MIN <= number <= SQLITE_MAX:
        raise _Bad(value)
    return number


def read_new(path: Path, cursor: Cursor) -> Batch | None:
    """The complete lines appended since the cursor (None: the log does not exist)."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below, after fstat and reads
    except FileNotFoundError:
        return None
    with handle:
        info = os.fstat(handle.fileno())
        head = handle.read(HEAD)
        offset = cursor.offset
        if (cursor.inode not in (None, info.st_ino) or info.st_size < offset
                or (offset and not _same_start(head, cursor.head))):
            offset = 0  # rotated, truncated, or rewritten: read it again from the start
        handle.seek(offset)
        data = handle.read(CHUNK)
    end = data.rfind(b"\n")
    if end < 0:
        if len(data) < CHUNK:
            return Batch([], Cursor(info.st_ino, offset, _head(head)), 0)
        end = len(data) - 1  # one line longer than a chunk: skip it as bad
    rows, bad = [], 0
    for raw in data[:end + 1].split(b"\n"):
        if not raw.strip():
            continue
        row = parse_line(raw)
        if row is None:
            bad += 1
        else:
            rows.append(row)
    return Batch(rows, Cursor(info.st_ino, offset + end + 1, _head(head)), bad)


def _store(conn: sqlite3.Connection, path: str, batch: Batch, at: float) -> None:
    conn.executemany("INSERT INTO admission (at, runner, repo, run_id, job, workflow, decision, "
                     "wait_s, reason, load) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", batch.rows)
    c = batch.cursor
    conn.execute("INSERT INTO admission_cursor (path, inode, offset, head, bad_lines, updated_at) "
                 "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (path) DO UPDATE SET inode = "
                 "excluded.inode, offset = excluded.offset, head = excluded.head, bad_lines = "
                 "admission_cursor.bad_lines + excluded.bad_lines, updated_at = "
                 "excluded.updated_at", (path, c.inode, c.offset, c.head, batch.bad, at))
    conn.execute("DELETE FROM admission WHERE id <= (SELECT max(id) FROM admission) - 100000")


class AdmissionLog:
    def __init__(self, path: Path, db: Database) -> None:
        self.path = path
        self.db = db

    async def cursor(self) -> tuple[Cursor, int]:
        row = await self.db.read_one("SELECT * FROM admission_cursor WHERE path = ?",
                                     (str(self.path),))
        if row is None:
            return Cursor(None, 0, None), 0
        return Cursor(row["inode"], row["offset"], row["head"]), row["bad_lines"]

    async def ingest(self, at: float) -> int:
        """Store what the hook appended since the last call; returns the rows added."""
        added = 0
        while True:
            cursor, _ = await self.cursor()
            batch = await asyncio.to_thread(read_new, self.path, cursor)
            if batch is None or batch.cursor == cursor:
                return added
            await self.db.write(_store, str(self.path), batch, at)
            added += len(batch.rows)

    async def report(self, limit: int) -> dict[str, Any]:
        cursor, bad = await self.cursor()
        rows = await self.db.read("SELECT * FROM admission ORDER BY at DESC, id DESC LIMIT ?",
                                  (limit,))
        totals = {row["decision"]: row["n"] for row in await self.db.read(
            "SELECT decision, count(*) AS n FROM admission GROUP BY decision")}
        waits = [row["wait_s"] for row in await self.db.read(
            "SELECT wait_s FROM admission WHERE decision IN ('released', 'timed_out') "
            "AND wait_s IS NOT NULL ORDER BY id DESC LIMIT 5000")]
        return {"log": str(self.path), "read_offset": cursor.offset, "bad_lines": bad,
                "totals": {d: totals.get(d, 0) for d in DECISIONS},
                "wait_s": {**percentiles(waits), "max": max(waits, default=None)},
                "decisions": [{"at": iso(r["at"]), "decision": r["decision"],
                               "runner": r["runner"], "repo": r["repo"], "run_id": r["run_id"],
                               "job": r["job"], "workflow": r["workflow"],
                               "wait_s": r["wait_s"], "reason": r["reason"], "load": r["load"]}
                              for r in rows]}

"""Result rows and beacons (POST /results), and the result listings.

Rows are idempotent by (job_id, device_id, iter): a repeat is acknowledged and changes nothing,
so an agent may re-post whatever it is unsure was received.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from fleet_min import jsonio
from fleet_min.collector import queue
from fleet_min.collector.devices import touch, touch_due
from fleet_min.collector.effects import Effects
from fleet_min.db import replayable
from fleet_min.errors import NotFound, Refused
from fleet_min.timeutil import iso

_ROW_FIELDS = frozenset({"schema", "kind", "device_id", "job_id", "iter", "metrics", "final",
                         "ok", "error", "device", "artifacts", "preempted"})


@replayable
def post_result(conn: sqlite3.Connection, body: dict[str, Any], now: float,
                effects: Effects) -> dict[str, Any]:
    job_id, device_id, iteration = body["job_id"], body["device_id"], int(body["iter"])
    # The device's last_seen comes along, so an agent seen within the second costs no UPDATE.
    job = conn.execute("SELECT j.*, d.last_seen AS device_last_seen FROM jobs j "
                       "LEFT JOIN devices d ON d.device_id = ? WHERE j.job_id = ?",
                       (device_id, job_id)).fetchone()
    if job is None:
        raise NotFound(f"no job {job_id!r}; results are posted for jobs this collector issued")
    extra = ({} if _ROW_FIELDS.issuperset(body)  # the usual row: nothing else to keep
             else {k: v for k, v in body.items() if k not in _ROW_FIELDS})
    fields = _row_fields(body)
    final, preempted = bool(body.get("final")), bool(body.get("preempted"))
    cursor = conn.execute(
        """
        INSERT OR IGNORE INTO results (job_id, device_id, iter, workload, ok, final, preempted,
                                       error, metrics, artifacts, device, extra, created_at)
        VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
        """,
        (job_id, device_id, iteration, job["workload"], *fields,
         jsonio.dumps_stored(extra) if extra else None, now))
    if touch_due(job["device_last_seen"], now):
        touch(conn, device_id, now)
    if cursor.rowcount == 0 and not _supersede(conn, job, body, fields, now):
        return {"ok": True, "duplicate": True, "job_id": job_id, "status": job["status"]}
    effects.emit("result", job_id=job_id, device_id=device_id, iter=iteration, final=final)
    status = job["status"]
    if final and _closes(job, device_id):
        if preempted:
            queue.preempted(conn, job, list(body.get("artifacts") or []), now, effects)
            status = "queued"
        else:
            status = queue.close_from_result(conn, job, bool(body.get("ok")), body.get("error"),
                                             now, effects)
    return {"ok": True, "duplicate": False, "job_id": job_id, "status": status}


@replayable
def post_rows(conn: sqlite3.Connection, rows: list[dict[str, Any]], now: float,
              effects: Effects) -> list[dict[str, Any]]:
    """Several validated result rows in one transaction, applied in order exactly as if they
    were posted one by one; all or none: a refused row (an unknown job) stores nothing."""
    replies = []
    for index, row in enumerate(rows):
        try:
            replies.append(post_result(conn, row, now, effects))
        except Refused as exc:
            raise type(exc)(f"row {index}: {exc.message}") from None
    return replies


def _row_fields(body: dict[str, Any]) -> tuple[Any, ...]:
    """A row's stored columns ok, final, preempted, error, metrics, artifacts, device, in that
    order, encoded once for the INSERT and, when it was a repeat, the superseding UPDATE."""
    return (None if body.get("ok") is None else int(bool(body["ok"])),
            int(bool(body.get("final"))), int(bool(body.get("preempted"))), body.get("error"),
            _stored_or(body.get("metrics"), "{}"), _stored_or(body.get("artifacts"), "[]"),
            jsonio.dumps_stored(body["device"]) if body.get("device") is not None else None)


def _stored_or(value: Any, empty: str) -> str:
    """A JSON column's text, with the usual empty value ("{}", "[]") written without encoding."""
    return jsonio.dumps_stored(value) if value else empty


def _supersede(conn: sqlite3.Connection, job: sqlite3.Row, body: dict[str, Any],
               fields: tuple[Any, ...], now: float) -> bool:
    """A row whose key exists from an EARLIER attempt of the job replaces that row.

    Rows are idempotent by (job_id, device_id, iter) so that a re-post changes nothing; but a
    job handed back (preempted, released) and claimed again by the same device reports its
    iterations anew, and the new attempt's summary must not be mistaken for a repeat.
    """
    if job["status"] != "claimed" or job["claimed_by"] != body["device_id"]:
        return False
    cursor = conn.execute(
        """
        UPDATE results SET ok = ?, final = ?, preempted = ?, error = ?, metrics = ?,
               artifacts = ?, device = ?, created_at = ?
        WHERE job_id = ? AND device_id = ? AND iter = ? AND created_at < ?
        """,
        (*fields, now, body["job_id"], body["device_id"], int(body["iter"]), job["claimed_at"]))
    return cursor.rowcount > 0


def _closes(job: sqlite3.Row, device_id: str) -> bool:
    """Does a final row from this device close the job? Only the claimant's, while claimed.

    A host executor reports rows under the id of the attached device it drove, which the
    collector may never have seen, so any final row closes a claimed host job.
    """
    if job["status"] != "claimed":
        return False
    if job["executor"] == "host":
        return True
    return bool(job["claimed_by"] == device_id)


@replayable
def post_beacon(conn: sqlite3.Connection, body: dict[str, Any], now: float,
                effects: Effects) -> dict[str, Any]:
    device_id = body["device_id"]
    known = conn.execute("SELECT 1 FROM devices WHERE device_id = ?", (device_id,)).fetchone()
    beacon = dict(body.get("beacon") or {})
    job_id = body.get("job_id")
    if known is None and not job_id:
        raise NotFound(f"device {device_id!r} is not registered; register first")
    stored = jsonio.dumps_stored(beacon)  # the beacons row and the device's last_beacon
    conn.execute("INSERT INTO beacons (device_id, job_id, at, body) VALUES (?, ?, ?, ?)",
                 (device_id, job_id, now, stored))
    busy = beacon.get("busy") if isinstance(beacon.get("busy"), dict) else None
    conn.execute(
        "UPDATE devices SET last_seen = ?, last_beacon = ?, last_beacon_at = ?, "
        "busy_job_id = ?, busy_collector = ?, busy_at = ? WHERE device_id = ?",
        (now, stored, now, busy.get("job_id") if busy else None,
         busy.get("collector") if busy else None, now if busy else None, device_id))
    renewed, preempt = False, False
    if job_id:
        row = queue.renew(conn, job_id, device_id, now)
        if row is not None:
            renewed = True
            preempt = queue.should_preempt(conn, row, now)
    # A new beacon can satisfy a collector-enforced constraint, and a cleared busy flag frees it.
    effects.claimants.append(f"device:{device_id}")
    effects.emit("beacon", device_id=device_id, job_id=job_id, lease_renewed=renewed,
                 preempt=preempt)
    return {"lease_renewed": renewed, "preempt": preempt}


def result_record(row: sqlite3.Row) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": row["id"],
        "job_id": row["job_id"],
        "device_id": row["device_id"],
        "iter": row["iter"],
        "workload": row["workload"],
        "ok": None if row["ok"] is None else bool(row["ok"]),
        "final": bool(row["final"]),
        "preempted": bool(row["preempted"]),
        "error": row["error"],
        "metrics": json.loads(row["metrics"]),
        "artifacts": json.loads(row["artifacts"]),
        "device": json.loads(row["device"]) if row["device"] else None,
        "created_at": iso(row["created_at"]),
    }
    if row["extra"]:
        for key, value in json.loads(row["extra"]).items():
            record.setdefault(key, value)
    return record

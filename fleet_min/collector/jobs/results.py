"""Result rows and beacons (POST /results), and the result listings.

A row belongs to an attempt of its job: the number the claim handed out (`attempt` in the
claimed job), which the agent echoes in every row. Rows are idempotent by (job_id, device_id,
iter, attempt): a repeat is acknowledged and changes nothing, so an agent may re-post whatever
it is unsure was received, and a late row of a lapsed attempt is recorded against that attempt
without taking the key the next attempt reports under. Only the current claim's final row
closes the job or hands it back.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from fleet_min import jsonio
from fleet_min.collector.jobs import authority, claims, queue, rules
from fleet_min.collector.jobs.devices import touch, touch_due
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.jobs.kinds import Executor, JobStatus, ResultKind
from fleet_min.db import replayable
from fleet_min.errors import Conflict, NotFound, Refused, TooLarge
from fleet_min.timeutil import iso

_ROW_FIELDS = frozenset({"schema", "kind", "device_id", "job_id", "iter", "attempt", "metrics",
                         "final", "ok", "error", "device", "artifacts", "preempted"})

# The current claim's row. A stored row under its key is replaced only when it was stored
# before this claim began: a job handed back (preempted, released) keeps its attempt number,
# and the claim that takes it again reports its iterations anew. A row stored since the claim
# began is kept (the new one was a repeat: no change, so the duplicate answer).
_CLAIMANT_ROW = """
INSERT INTO results (job_id, device_id, iter, attempt, workload, ok, final, preempted, error,
                     metrics, artifacts, device, extra, created_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (job_id, device_id, iter, attempt) DO UPDATE SET
    ok = excluded.ok, final = excluded.final, preempted = excluded.preempted,
    error = excluded.error, metrics = excluded.metrics, artifacts = excluded.artifacts,
    device = excluded.device, extra = excluded.extra, created_at = excluded.created_at
WHERE results.created_at < ?
"""

# The job a row reports for, with its device's last_seen and mesh node, so an agent seen within
# the second costs no UPDATE and a mesh check no query. A row that is not final reads only the
# columns the claimant's check, the late-row path and the reply use: building a sqlite3.Row of
# all thirty columns was half the cost of this read. A final row closes or hands back the job,
# which reads a few more: what closing it (queue._close) and handing it back (queue.preempted,
# which requeues it and offers it again) read of the job's own row.
_JOB_AND_DEVICE = "FROM jobs j LEFT JOIN devices d ON d.device_id = ? WHERE j.job_id = ?"
_ROW_COLUMNS = ("j.job_id, j.seq, j.status, j.executor, j.claimed_by, j.attempts, j.workload, "
                "j.claimed_at")
_JOB_FOR_ROW = (f"SELECT {_ROW_COLUMNS}, d.last_seen AS device_last_seen, "
                f"d.mesh_node AS device_node {_JOB_AND_DEVICE}")
_JOB_FOR_FINAL_ROW = (f"SELECT {_ROW_COLUMNS}, j.exclusive, j.parent_job_id, j.has_dependents, "
                      "j.spec, j.pin, j.variant, j.pool, d.last_seen AS device_last_seen, "
                      f"d.mesh_node AS device_node {_JOB_AND_DEVICE}")


@replayable
def post_result(conn: sqlite3.Connection, body: dict[str, Any], now: float,
                effects: Effects, caller: str | None = None) -> dict[str, Any]:
    """Store one row for the claimant of its job, or for the holder of the earlier attempt it
    reports for (see fleet_min.collector.jobs.authority for who that is); `caller` is the mesh node
    the request came from, None off the mesh."""
    job_id, device_id, iteration = body["job_id"], body["device_id"], int(body["iter"])
    final = bool(body.get("final"))
    job = conn.execute(_JOB_FOR_FINAL_ROW if final else _JOB_FOR_ROW,
                       (device_id, job_id)).fetchone()
    if job is None:
        raise NotFound(f"no job {job_id!r}; results are posted for jobs this collector issued")
    speaker = authority.speaker_of(conn, job, body)
    if caller is not None:
        if speaker != device_id:  # an executor filing a row under a registered device's id
            authority.check_device_node(device_id, job["device_node"], caller)
        authority.check_speaker(conn, job["executor"], speaker, job["device_node"], caller, now)
    extra = ({} if _ROW_FIELDS.issuperset(body)  # the usual row: nothing else to keep
             else {k: v for k, v in body.items() if k not in _ROW_FIELDS})
    fields = _row_fields(body)
    if not authority.holds_attempt(job, speaker, body.get("attempt")):
        return _late_row(conn, job, body, speaker, fields, extra, now, effects)
    attempt = job["attempts"]
    cursor = conn.execute(_CLAIMANT_ROW, (
        job_id, device_id, iteration, attempt, job["workload"], *fields,
        jsonio.dumps_stored(extra) if extra else None, now, job["claimed_at"]))
    if touch_due(job["device_last_seen"], now):
        touch(conn, device_id, now)
    if cursor.rowcount == 0:
        if final:
            _refuse_final_over_progress(conn, job_id, device_id, iteration, attempt)
        return _reply(job, job["status"], attempt, duplicate=True)
    effects.emit(ResultKind.RESULT, job_id=job_id, device_id=device_id, iter=iteration, final=final,
                 attempt=attempt)
    if not final:
        return _reply(job, job["status"], attempt, duplicate=False)
    status, settled = _settle(conn, job, body, now, effects)
    return {**_reply(job, status, attempt, duplicate=False), **settled}


def _refuse_final_over_progress(conn: sqlite3.Connection, job_id: str, device_id: str,
                                iteration: int, attempt: int) -> None:
    """Rows are idempotent by job, device and iteration: a row under a key this attempt has
    stored is a repeat. A final row whose key holds a row that is not final is no repeat, and
    answering it as one would drop the job's outcome unseen (the job stays claimed until its
    lease lapses): refused, saying why. (An agent that sends no `iter` posts every row as
    iteration 0.)"""
    stored = conn.execute("SELECT final FROM results WHERE job_id = ? AND device_id = ? AND "
                          "iter = ? AND attempt = ?",
                          (job_id, device_id, iteration, attempt)).fetchone()
    if stored is not None and not stored[0]:
        raise Conflict(f"job {job_id}: iteration {iteration} of attempt {attempt} from "
                       f"{device_id} already holds a row that is not final, and rows are "
                       "idempotent by job, device and iteration; post the final row under an "
                       "iteration of its own (a row without iter is iteration 0)")


def _reply(job: sqlite3.Row, status: str, attempt: int | None, *, duplicate: bool
           ) -> dict[str, Any]:
    return {"ok": True, "duplicate": duplicate, "job_id": job["job_id"], "status": status,
            "attempt": attempt}


def _settle(conn: sqlite3.Connection, job: sqlite3.Row, body: dict[str, Any], now: float,
            effects: Effects) -> tuple[str, dict[str, Any]]:
    """The claimant's final row: the job's new status, and what the reply adds about it (as
    the original's clients read it): a hand-back says so and names the checkpoint it resumes
    from; a closing row lists the waiters it queued (`promoted`) and the jobs it failed."""
    if body.get("preempted"):
        artifacts = list(body.get("artifacts") or [])
        queue.preempted(conn, job, artifacts, now, effects)
        return JobStatus.QUEUED, {"preempted": True,
                                  "resume_from": artifacts[0] if artifacts else None}
    closed = queue.close_from_result(conn, job, bool(body.get("ok")), body.get("error"), now,
                                     effects)
    return closed.status, {"promoted": closed.promoted, "failed": closed.failed}


def _late_row(conn: sqlite3.Connection, job: sqlite3.Row, body: dict[str, Any], speaker: str,
              fields: tuple[Any, ...], extra: dict[str, Any], now: float, effects: Effects
              ) -> dict[str, Any]:
    """A row that is not the current claim's. From the holder of the attempt it reports for
    (named, or else the sender's last) it is stored against that attempt, whatever the job did
    since, and changes no status; a row under a key that attempt already stored is a repeat
    (nothing changes), as for the claimant. From anyone else only an exact repeat of a stored
    row is answered (as a duplicate); anything else is refused with 409.

    Off the hot path: the current claimant's own rows never come here.
    """
    named = body.get("attempt")
    attempt = int(named) if named is not None else authority.last_attempt(conn, job, speaker)
    key = (body["job_id"], body["device_id"], int(body["iter"]))
    if attempt is None or not authority.held_attempt(conn, job, speaker, attempt):
        repeated = _stored_repeat(conn, key, attempt, fields, extra)
        if repeated is None:
            raise authority.row_refusal(job, speaker, body, attempt)
        return _reply(job, job["status"], repeated, duplicate=True)
    cursor = conn.execute(
        "INSERT OR IGNORE INTO results (job_id, device_id, iter, attempt, workload, ok, final, "
        "preempted, error, metrics, artifacts, device, extra, created_at) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (*key, attempt, job["workload"], *fields,
         jsonio.dumps_stored(extra) if extra else None, now))
    if touch_due(job["device_last_seen"], now):
        touch(conn, key[1], now)
    if cursor.rowcount == 0:
        return _reply(job, job["status"], attempt, duplicate=True)
    effects.emit(ResultKind.RESULT, job_id=key[0], device_id=key[1], iter=key[2],
                 final=bool(body.get("final")), attempt=attempt)
    return _reply(job, job["status"], attempt, duplicate=False)


def _stored_repeat(conn: sqlite3.Connection, key: tuple[str, str, int], attempt: int | None,
                   fields: tuple[Any, ...], extra: dict[str, Any]) -> int | None:
    """The attempt of a stored row the posted one repeats exactly, under its key (in any
    attempt when the row's attempt is unknown); None when it repeats none."""
    for stored in conn.execute(
            "SELECT attempt, ok, final, preempted, error, metrics, artifacts, device, extra "
            "FROM results WHERE job_id = ? AND device_id = ? AND iter = ? "
            "AND (? IS NULL OR attempt = ?)", (*key, attempt, attempt)):
        if _same_row(stored, fields, extra):
            return int(stored["attempt"])
    return None


def _same_row(stored: sqlite3.Row, fields: tuple[Any, ...], extra: dict[str, Any]) -> bool:
    """Is a posted row (its encoded columns and extra fields) the row already stored? JSON
    columns compare decoded, so a re-post with its keys in another order is still the same."""
    ok, final, preempted, error, metrics, artifacts, device = fields
    return ((stored["ok"], stored["final"], stored["preempted"], stored["error"])
            == (ok, final, preempted, error)
            and _decoded(stored["metrics"]) == _decoded(metrics)
            and _decoded(stored["artifacts"]) == _decoded(artifacts)
            and _decoded(stored["device"]) == _decoded(device)
            and (_decoded(stored["extra"]) or {}) == extra)


def _decoded(text: str | None) -> Any:
    return json.loads(text) if text else None


@replayable
def post_rows(conn: sqlite3.Connection, rows: list[dict[str, Any]], now: float,
              effects: Effects, caller: str | None = None) -> list[dict[str, Any]]:
    """Several validated result rows in one transaction, applied in order exactly as if they
    were posted one by one; all or none: a refused row (an unknown job) stores nothing."""
    replies = []
    for index, row in enumerate(rows):
        try:
            replies.append(post_result(conn, row, now, effects, caller))
        except Refused as exc:
            raise type(exc)(f"row {index}: {exc.message}") from None
    return replies


def _row_fields(body: dict[str, Any]) -> tuple[Any, ...]:
    """A row's stored columns ok, final, preempted, error, metrics, artifacts, device, in that
    order, encoded once for the INSERT (and a late row's comparison with a stored one)."""
    return (None if body.get("ok") is None else int(bool(body["ok"])),
            int(bool(body.get("final"))), int(bool(body.get("preempted"))), body.get("error"),
            _stored_or(body.get("metrics"), "{}"), _stored_or(body.get("artifacts"), "[]"),
            jsonio.dumps_stored(body["device"]) if body.get("device") is not None else None)


def _stored_or(value: Any, empty: str) -> str:
    """A JSON column's text, with the usual empty value ("{}", "[]") written without encoding."""
    return jsonio.dumps_stored(value) if value else empty


@replayable
def post_beacon(conn: sqlite3.Connection, body: dict[str, Any], now: float,
                effects: Effects, caller: str | None = None) -> dict[str, Any]:
    """Record a registered device's beacon, renewing the lease of the job it names when it
    holds that job. A host executor is no device: it may beacon under its own name only for the
    job it holds. A beacon naming a job its sender does not hold renews nothing and is kept
    without that job (the sender learns lease_renewed false and stops)."""
    device_id = body["device_id"]
    device = conn.execute("SELECT mesh_node FROM devices WHERE device_id = ?",
                          (device_id,)).fetchone()
    job_id = body.get("job_id") or None
    job = queue.job_row(conn, job_id) if job_id else None
    # A beacon naming an attempt other than the current one is the runner of a lapsed
    # attempt still at work (an old process under the same name): it renews nothing.
    held = job is not None and authority.holds_attempt(job, device_id, body.get("attempt"))
    speaker = device_id
    if job is not None and not held and device is not None:
        # A device attached to the executor holding the job beacons for it (the executors in
        # the field do): the lease is the executor's.
        via = authority.attached_executor(conn, job, device_id)
        if via is not None and authority.holds_attempt(job, via, body.get("attempt")):
            held, speaker = True, via
    if device is None and not held:
        return _stranger_beacon(conn, device_id, job)
    if caller is not None:
        # An executor beaconing for a device writes that device's record: the device's own node
        # only (checked before the executor's binding, which may write).
        if device is not None and speaker != device_id:
            authority.check_device_node(device_id, device["mesh_node"], caller)
        kind = job["executor"] if held and job is not None else Executor.DEVICE
        authority.check_speaker(conn, kind, speaker, device["mesh_node"] if device else None,
                                caller, now)
    beacon = dict(body.get("beacon") or {})
    attached = job_id if held else None
    stored = jsonio.dumps_stored(beacon)  # the beacons row and the device's last_beacon
    if len(stored) > rules.MAX_BEACON_BYTES:
        raise TooLarge(f"the beacon is {len(stored):,} bytes of JSON; a collector keeps beacons "
                       f"of at most {rules.MAX_BEACON_BYTES:,}")
    conn.execute("INSERT INTO beacons (device_id, job_id, at, body) VALUES (?, ?, ?, ?)",
                 (device_id, attached, now, stored))
    if device is not None:
        busy = beacon.get("busy") if isinstance(beacon.get("busy"), dict) else None
        conn.execute(
            "UPDATE devices SET last_seen = ?, last_beacon = ?, last_beacon_at = ?, "
            "busy_job_id = ?, busy_collector = ?, busy_at = ? WHERE device_id = ?",
            (now, stored, now, busy.get("job_id") if busy else None,
             busy.get("collector") if busy else None, now if busy else None, device_id))
        # A new beacon can satisfy a collector-enforced constraint; a cleared busy flag frees it.
        effects.beaconed(Executor.DEVICE, device_id)
    renewed, preempt = False, False
    if held and job is not None:
        queue.extend_lease(conn, job, now)
        renewed, preempt = True, claims.should_preempt(conn, job, now)
    effects.emit(ResultKind.BEACON, device_id=device_id, job_id=attached, lease_renewed=renewed,
                 preempt=preempt)
    return {"lease_renewed": renewed, "preempt": preempt}


def _stranger_beacon(conn: sqlite3.Connection, device_id: str, job: sqlite3.Row | None
                     ) -> dict[str, Any]:
    """A beacon from an id that is no registered device and holds the job it names (if any).

    Stored nowhere. A host executor beaconing for a host job it held before (its lease lapsed
    and the job moved on) learns lease_renewed false, as a device would, so it stops rather than
    retrying an error; anyone else is refused.
    """
    if job is None or job["executor"] != Executor.HOST:
        raise NotFound(f"device {device_id!r} is not registered; register first")
    if authority.held_before(conn, job, device_id):
        return {"lease_renewed": False, "preempt": False}
    raise Conflict(f"job {job['job_id']} is not held by {device_id!r}: a beacon from an "
                   "unregistered id is taken only from the host executor holding the job it "
                   "names")


def result_record(row: sqlite3.Row) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": row["id"],
        "job_id": row["job_id"],
        "device_id": row["device_id"],
        "iter": row["iter"],
        "attempt": row["attempt"],
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

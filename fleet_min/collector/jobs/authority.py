"""Who a request may act for (DESIGN rule 5a: a request acts only for what it proves).

The collector has no credentials by design, so a request proves what it can show:

- **Speakers.** A result row or a beacon speaks for one claimant. A device job's rows speak for
  their `device_id`. A host job's rows speak for a host executor: the row's `executor` field when
  it has one (an executor that files rows under the id of a device attached to it says there
  which executor it is), else its `device_id` (the agent in host mode reports under its own
  executor name). A row under the id of a device attached to an executor, without `executor`
  (the executors in the field file per-device rows so, and beacon so), speaks for that
  executor: the one the registered device's descriptor names in `attached_to`, or the
  claimant of the job that holds a lock on the device. A row is taken from the claimant of a
  claimed job for its current attempt
  (the one row that may close the job or hand it back), from whoever held an earlier attempt for
  that attempt (a late row: recorded against its attempt, no status change), or as an exact
  repeat of a row already stored (agents re-post their spool).
- **Attempts.** A row or beacon names the attempt its claim handed out (`attempt`, echoed from
  the claimed job). One without it is taken as the current attempt when it comes from the
  current holder (agents in the field predate the field), else as the sender's last attempt.
- **Mesh nodes.** With FLEET_MESH_ALLOW set, an agent request from the mesh network names the
  node it came from (fleet_min.collector.access.mesh). A device remembers the node that
  registered it and only that node may speak for it from the mesh; an executor name is bound to
  the first node that used it, until that node has been silent for REBIND_AFTER_S. Loopback and
  LAN peers carry no node (None) and are not checked here: for them the network is the access
  control.

Domain code: plain functions over the writer's connection, raising fleet_min.errors refusals.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from fleet_min.collector.jobs.kinds import FINAL, Executor, JobStatus
from fleet_min.errors import Conflict, Forbidden

CLAIMANT = {Executor.DEVICE: "the device that claimed it",
            Executor.HOST: "the host executor that claimed it"}
# An executor name whose node has been silent this long may be taken by another listed node:
# a moved or renamed executor is not locked out for ever, and a live one (it polls or beacons
# well inside a minute, even through a long job) never lapses.
REBIND_AFTER_S = 900.0
SEEN_EVERY_S = 60.0  # an executor binding's seen_at is rewritten at most this often


HOST_PREFIX = "host:"  # the original's executors post their job-wide rows as host:<name>
# ... and the verdict of each browser (or web tool) they drive as web:<browser> (web:chromium).
WEB_PREFIX = "web:"


def row_speaker(job: sqlite3.Row, body: dict[str, Any]) -> str:
    """Who a result row speaks for (see the module docstring). On a host job, `host:<name>` in
    `device_id` is the executor <name>: the executors already in the field file the rows about
    no particular device that way. `web:<browser>` is a browser the executor holding the job
    drives, not a device anyone registers, so only that executor can be speaking: the row
    speaks for the current claimant (on the mesh, check_speaker still holds the caller to the
    claimant's node). On a job nobody holds it speaks for nobody and is refused."""
    device_id = str(body["device_id"])
    if job["executor"] == Executor.HOST:
        executor = body.get("executor")
        if isinstance(executor, str) and executor:
            return executor
        if device_id.startswith(HOST_PREFIX) and len(device_id) > len(HOST_PREFIX):
            return device_id[len(HOST_PREFIX):]
        if (device_id.startswith(WEB_PREFIX) and len(device_id) > len(WEB_PREFIX)
                and job["status"] == JobStatus.CLAIMED and job["claimed_by"]):
            return str(job["claimed_by"])
    return device_id


# The executor a registered device is attached to (its descriptor's attached_to), if any; a
# descriptor that is not JSON (a row from before descriptors were checked) names none.
ATTACHED_TO_SQL = ("SELECT json_extract(descriptor, '$.attached_to') FROM devices "
                   "WHERE device_id = ? AND json_valid(descriptor)")


def attached_host(value: Any) -> str | None:
    """attached_to as read by ATTACHED_TO_SQL: the executor's name, or None."""
    return value if isinstance(value, str) and value else None


def attached_to(conn: sqlite3.Connection, device_id: str) -> str | None:
    """The executor a device is attached to, as it registered (an executor registers what it
    drives at start and every beacon); None for a device no executor registered, or none."""
    row = conn.execute(ATTACHED_TO_SQL, (device_id,)).fetchone()
    return attached_host(row[0]) if row else None


def attached_executor(conn: sqlite3.Connection, job: sqlite3.Row, device_id: str) -> str | None:
    """The executor a row or beacon under a device's id speaks for on a host job: the executor
    the registered device's descriptor says it is attached to (`attached_to`), else the job's
    claimant when the job holds a lock on the device (POST /locks/acquire); None otherwise.
    Asked only when the sender is not the job's claimant: its own rows cost no query."""
    if job["executor"] != Executor.HOST:
        return None
    host = attached_to(conn, device_id)
    if host is not None:
        return host
    if job["claimed_by"] and conn.execute(
            "SELECT 1 FROM device_locks WHERE device_id = ? AND job_id = ?",
            (device_id, job["job_id"])).fetchone() is not None:
        return str(job["claimed_by"])
    return None


def speaker_of(conn: sqlite3.Connection, job: sqlite3.Row, body: dict[str, Any]) -> str:
    """row_speaker, and for a host job's row under the id of a device attached to an executor
    (the executors in the field file their per-device rows so, without `executor`), that
    executor."""
    speaker = row_speaker(job, body)
    if (job["executor"] == Executor.HOST and speaker == body["device_id"]
            and speaker != job["claimed_by"]):
        return attached_executor(conn, job, speaker) or speaker
    return speaker


def holds(job: sqlite3.Row, speaker: str) -> bool:
    """Does `speaker` hold the job's current claim?"""
    return job["status"] == JobStatus.CLAIMED and job["claimed_by"] == speaker


def holds_attempt(job: sqlite3.Row, speaker: str, attempt: object) -> bool:
    """Does `speaker` hold the job's current claim, and is `attempt` (a row's or a beacon's
    `attempt` field, None when it has none) that claim's? Read from the job row alone: the
    claimant's rows and beacons, the hot path, cost no query for it."""
    return holds(job, speaker) and (attempt is None or attempt == job["attempts"])


def last_attempt(conn: sqlite3.Connection, job: sqlite3.Row, claimant_id: str) -> int | None:
    """The number of the last attempt `claimant_id` held (None: it never held one)."""
    row = conn.execute("SELECT attempt FROM job_attempts WHERE job_seq = ? AND claimed_by = ? "
                       "ORDER BY id DESC LIMIT 1", (job["seq"], claimant_id)).fetchone()
    return int(row[0]) if row else None


def held_attempt(conn: sqlite3.Connection, job: sqlite3.Row, claimant_id: str,
                 attempt: int) -> bool:
    """Did `claimant_id` hold attempt number `attempt` of the job? (A number handed back by a
    release or a preemption is handed out again, so several claims may share it.)"""
    return conn.execute("SELECT 1 FROM job_attempts WHERE job_seq = ? AND attempt = ? "
                        "AND claimed_by = ? LIMIT 1",
                        (job["seq"], attempt, claimant_id)).fetchone() is not None


def held_before(conn: sqlite3.Connection, job: sqlite3.Row, claimant_id: str) -> bool:
    """Did `claimant_id` hold any attempt of the job (the current one included)?"""
    return conn.execute("SELECT 1 FROM job_attempts WHERE job_seq = ? AND claimed_by = ? "
                        "LIMIT 1", (job["seq"], claimant_id)).fetchone() is not None


def row_refusal(job: sqlite3.Row, speaker: str, body: dict[str, Any],
                attempt: int | None) -> Conflict:
    """The 409 for a row that is neither the current claimant's, nor from the holder of the
    attempt it names (or, naming none, of the sender's last attempt), nor a repeat. It names
    the claimant's kind, not its id."""
    job_id, status = job["job_id"], job["status"]
    if attempt is not None and attempt > job["attempts"]:
        return Conflict(f"job {job_id} has had {job['attempts']} attempt(s), so a row for "
                        f"attempt {attempt} reports for none of them; a row carries the attempt "
                        "its claim handed out")
    if attempt is not None and "attempt" in body:
        return Conflict(f"{speaker!r} did not hold attempt {attempt} of job {job_id}; a row is "
                        "taken for an attempt only from the one that held it")
    if status == JobStatus.CLAIMED:
        hint = ""
        if job["executor"] == Executor.HOST and "executor" not in body:
            hint = ("; an executor that files rows under an attached device's id names itself "
                    "in the row's executor field")
        return Conflict(f"job {job_id} is held by {CLAIMANT[job['executor']]}, not by "
                        f"{speaker!r}; only the claimant's rows are accepted, and late rows "
                        f"from the holders of its earlier attempts{hint}")
    if status in FINAL:
        return Conflict(f"job {job_id} is {status}; after a job closes only the holders of its "
                        f"attempts may add rows, and {speaker!r} held none")
    return Conflict(f"job {job_id} is {status}: nobody holds it, so it takes no rows but late "
                    f"ones from the holders of its earlier attempts, and {speaker!r} held none")


# -- mesh nodes ----------------------------------------------------------------------------------


def check_device_node(device_id: str, bound: str | None, caller: str) -> None:
    """Refuse a mesh caller speaking for a device another mesh node registered."""
    if bound is not None and bound != caller:
        raise Forbidden(f"device {device_id!r} registered from another mesh node, so mesh node "
                        f"{caller} may not act for it; to move it, forget the device "
                        "(DELETE /api/devices/{id}) and register it from the new node")


def bind_executor(conn: sqlite3.Connection, name: str, caller: str, now: float) -> None:
    """Admit a mesh caller speaking for an executor name: bind the name to the caller's node
    when it is free (never bound, or its node silent for REBIND_AFTER_S), else it must be the
    bound node. Raises Forbidden before writing anything."""
    row = conn.execute("SELECT mesh_node, seen_at FROM executor_nodes WHERE name = ?",
                       (name,)).fetchone()
    if row is None:
        conn.execute("INSERT INTO executor_nodes (name, mesh_node, bound_at, seen_at) "
                     "VALUES (?, ?, ?, ?)", (name, caller, now, now))
        return
    if row["mesh_node"] == caller:
        if now - row["seen_at"] >= SEEN_EVERY_S:
            conn.execute("UPDATE executor_nodes SET seen_at = ? WHERE name = ?", (now, name))
        return
    if now - row["seen_at"] < REBIND_AFTER_S:
        raise Forbidden(f"the executor name {name!r} is in use by another mesh node, so mesh "
                        f"node {caller} may not act for it; pick another --name, or wait until "
                        f"the other node has been silent for {REBIND_AFTER_S / 60:g} minutes")
    conn.execute("UPDATE executor_nodes SET mesh_node = ?, bound_at = ?, seen_at = ? "
                 "WHERE name = ?", (caller, now, now, name))


def check_speaker(conn: sqlite3.Connection, executor: str, speaker: str,
                  device_node: str | None, caller: str, now: float) -> None:
    """A mesh caller acting for `speaker` of a job of this executor kind: a host executor's
    name binding, or the node the device registered from (`device_node`, read by the caller
    along with the rows it needed anyway)."""
    if executor == Executor.HOST:
        bind_executor(conn, speaker, caller, now)
    else:
        check_device_node(speaker, device_node, caller)


def check_host_claimant(conn: sqlite3.Connection, job: sqlite3.Row, speaker: str,
                        caller: str | None, now: float, only: str) -> None:
    """A request about a claimed host job (a lock, a mirror frame) speaks for its claimant:
    the executor name bound to the mesh node it came from, if any, and the one that claimed
    it; else Conflict, ending with `only` (who may do what)."""
    if caller is not None:
        check_speaker(conn, Executor.HOST, speaker, None, caller, now)
    if speaker != job["claimed_by"]:
        raise Conflict(f"job {job['job_id']} is held by the host executor that claimed it, not "
                       f"by {speaker!r}; {only}")

"""Device locks a host job takes on the devices it drives (POST /locks/acquire, /locks/release).

A lock is a row of device_locks (the table targets.exclusive's lock uses): while it stands, the
device is handed no device job (the claim rules read the lock with the device), and no other
job can lock it. A lock lasts as long as its job's claim: the job's closing, its going back to
the queue and its lease lapsing (the sweep) release it (queue.unlock), so a lock's expiry is
its job's lease deadline, pushed out by every beacon that renews the lease.

Only the job's claimant may lock for it: the request names the executor (`executor`, else it
is taken to be the claimant, as a row without `executor` is) and, on the mesh, must come from
the node that executor name is bound to (authority.check_speaker).

Transaction functions: the connection first, an Effects last, no await between statements.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from fleet_min.collector.jobs import authority, queue
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.jobs.kinds import Executor, JobStatus
from fleet_min.errors import BadRequest, Conflict, NotFound

MAX_DEVICES = 100  # devices in one acquire
MAX_ID = 200


def check_acquire(body: dict[str, Any]) -> tuple[str, list[str], str | None]:
    """The job, the devices (in order, once each) and the executor an acquire names."""
    job_id, executor = _job_and_executor(body)
    devices = body.get("device_ids")
    if (not isinstance(devices, list) or not 1 <= len(devices) <= MAX_DEVICES
            or not all(isinstance(d, str) and 1 <= len(d) <= MAX_ID for d in devices)):
        raise BadRequest(f"device_ids must be a list of 1 to {MAX_DEVICES} device ids (each 1 "
                         f"to {MAX_ID} characters): the devices the job needs to itself")
    return job_id, list(dict.fromkeys(devices)), executor


def check_release(body: dict[str, Any]) -> tuple[str, str | None]:
    return _job_and_executor(body)


def _job_and_executor(body: dict[str, Any]) -> tuple[str, str | None]:
    job_id = body.get("job_id")
    if not isinstance(job_id, str) or not 1 <= len(job_id) <= MAX_ID:
        raise BadRequest("job_id is required: the claimed host job the locks are for")
    executor = body.get("executor")
    if "executor" in body and (not isinstance(executor, str) or not 1 <= len(executor) <= MAX_ID):
        raise BadRequest(f"executor must be the executor's name (1 to {MAX_ID} characters), the "
                         "one it polls with")
    return job_id, executor


def _claimant_job(conn: sqlite3.Connection, job_id: str, executor: str | None,
                  caller: str | None, now: float) -> sqlite3.Row:
    """The claimed host job, when the request speaks for its claimant; else a refusal."""
    job = queue.job_row(conn, job_id)
    if job is None:
        raise NotFound(f"no job {job_id!r}")
    if job["executor"] != Executor.HOST:
        raise Conflict(f"job {job_id} is a device job; device locks are taken by host jobs "
                       "(a device job locks its device with targets.exclusive)")
    if job["status"] != JobStatus.CLAIMED:
        raise Conflict(f"job {job_id} is {job['status']}, not claimed: only a running host job "
                       "holds device locks")
    authority.check_host_claimant(conn, job, executor or job["claimed_by"], caller, now,
                                  "only the claimant takes or gives back its locks")
    return job


def acquire(conn: sqlite3.Connection, job_id: str, device_ids: list[str],
            executor: str | None, now: float, effects: Effects,
            caller: str | None = None) -> dict[str, Any]:
    """Lock each device for the job that no other job holds; the ones granted (those it held
    already among them) come back in the order asked. From the mesh, a device another node
    registered is refused before anything is locked: a lock makes the job's claimant speak for
    the device (its rows and beacons), which only the device's own node may do."""
    job = _claimant_job(conn, job_id, executor, caller, now)
    if caller is not None:
        for device_id in device_ids:
            bound = conn.execute("SELECT mesh_node FROM devices WHERE device_id = ?",
                                 (device_id,)).fetchone()
            authority.check_device_node(device_id, bound[0] if bound else None, caller)
    granted: list[str] = []
    for device_id in device_ids:
        holder = conn.execute("SELECT job_id FROM device_locks WHERE device_id = ?",
                              (device_id,)).fetchone()
        if holder is None:
            conn.execute("INSERT INTO device_locks (device_id, job_id, locked_at) "
                         "VALUES (?, ?, ?)", (device_id, job_id, now))
        elif holder[0] != job_id:
            continue
        granted.append(device_id)
    if granted:
        effects.emit("lock", job_id=job_id, device_ids=granted, holder=job["claimed_by"])
    return {"ok": True, "job_id": job_id, "granted": granted,
            "refused": [d for d in device_ids if d not in granted]}


def release(conn: sqlite3.Connection, job_id: str, executor: str | None, now: float,
            effects: Effects, caller: str | None = None) -> dict[str, Any]:
    """Give back every lock the job holds. A job that is no longer claimed holds none (its
    end released them): 0, not an error, so an executor releasing after its final row is fine."""
    job = queue.job_row(conn, job_id)
    if job is None:
        raise NotFound(f"no job {job_id!r}")
    if job["status"] != JobStatus.CLAIMED:
        return {"ok": True, "job_id": job_id, "released": 0}
    _claimant_job(conn, job_id, executor, caller, now)
    released = queue.unlock(conn, job_id, effects)
    if released:
        effects.emit("lock", job_id=job_id, released=released)
    return {"ok": True, "job_id": job_id, "released": released}


# Every lock, with the job holding it, its claimant and the lease it lasts as long as.
LIST_SQL = ("SELECT l.device_id, l.job_id, l.locked_at, j.claimed_by, j.lease_deadline, "
            "j.executor FROM device_locks l LEFT JOIN jobs j ON j.job_id = l.job_id "
            "ORDER BY l.device_id")

"""Claims: the next queued job a device or a host executor may take now, and taking it.

Claims are found through two partial indexes over queued jobs (executor, pin[, workload],
priority DESC, seq): one small ordered range per (pin, declared workload), merged by SQLite with
a LIMIT. Jobs pinned to other devices or of workloads the claimant never declared are never read,
so the cost of a claim does not grow with them.

`claim`, `first_claim` and `claim_many` are transaction functions (see fleet_min.db): the
connection first, an Effects last, no await between their statements.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from fleet_min import jsonio
from fleet_min.collector.jobs import authority, executors, rules, verdicts
from fleet_min.collector.jobs.devices import NOT_READ, Device, load_device, touch_due
from fleet_min.collector.jobs.effects import Effects, claimant_key
from fleet_min.collector.jobs.kinds import Executor, JobStatus
from fleet_min.db import replayable
from fleet_min.errors import NotFound
from fleet_min.timeutil import iso

# What a claim, its refusals and the preemption check read of a candidate. Not `*`: sqlite3
# builds every column of a row, and half of the jobs table's thirty are never looked at here.
# Not every spec either: a spec may be a megabyte, and a poll behind a thousand queued jobs its
# device can never take built every one of them as a Python string. A candidate's spec comes
# with it only when the checks that need no spec cannot refuse it (see _SPEC_UNLESS_CHECKED),
# which is every candidate of the usual job; the others' is read by _spec_text once they
# passed those checks (one read by key).
_CANDIDATE_COLUMNS = ("seq, job_id, workload, variant, executor, priority, pool, match, "
                      "target_device, exclusive, attempts, max_attempts, ttl_s, updated_at")

# When _refusal's checks before the spec cannot refuse a candidate of the claim query: for a
# device, a job with no pool and no match expression (the query yields only workloads and
# pairings it declared, which rules.offers grants); for a host executor, a job pinned to no
# device (no attachment to check). Such a candidate's spec would be read next in any case.
_SPEC_UNLESS_CHECKED: dict[str, str] = {
    Executor.DEVICE: "CASE WHEN pool IS NULL AND match IS NULL THEN spec END AS spec",
    Executor.HOST: "CASE WHEN target_device IS NULL THEN spec END AS spec",
}


@dataclass(frozen=True, slots=True)
class Claimant:
    executor: Executor
    id: str        # device_id, or the host executor's name
    # An executor's ?slots= (0: its poll did not say); the claim reads the last said, stored
    # with the executor (executors.seen). A device holds one claimed job at a time.
    slots: int = 1
    # Made with the claimant, which every poll makes and reads it (a cached_property needs a
    # __dict__ and cost more than the whole object).
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", claimant_key(self.executor, self.id))


NOT_JUDGED = "match expression not evaluated yet (this poll's evaluation time is spent)"


def static_refusal(device: Device, workload: str | None, variant: str | None,
                   pool: str | None, match: str | None,
                   budget: verdicts.Budget | None = None) -> str | None:
    """Why a device can never take such a job regardless of time (None when it can); with no
    workload, only the pool and the match expression are asked. Past the `budget`, an
    expression not judged before is NOT_JUDGED (see verdicts.py)."""
    if workload is not None and not rules.offers(device.capabilities, workload, variant):
        return "capability not declared"
    if pool and pool not in device.pools:
        return f"not in pool {pool}"
    if match:
        verdict = verdicts.satisfies(device, match, budget)
        if verdict is None:
            return NOT_JUDGED
        if not verdict:
            return "match expression is false"
    return None


@lru_cache(maxsize=256)
def _claim_sql(workloads: int, by_priority: bool, pairs: int = 0,
               executor: str = Executor.DEVICE) -> str:
    """The claim query of one shape: per pin ("" and the claimant's own) a branch for each of
    `workloads` declared workloads (0 and no pairs: any workload) and one for each of `pairs`
    declared pairings (workload and variant: jobs_claim_variant), optionally only from a
    priority up, for a claimant of `executor`. Built once per shape, not at every claim."""
    base = "status = 'queued' AND is_group = 0 AND executor = ? AND pin = ?"
    tail = " AND priority >= ?" if by_priority else ""
    columns = f"{_CANDIDATE_COLUMNS}, {_SPEC_UNLESS_CHECKED[executor]}"
    if not workloads and not pairs:
        per_pin = [f"SELECT {columns} FROM jobs WHERE {base}{tail}"]
    else:
        per_pin = ([f"SELECT {columns} FROM jobs WHERE {base} AND workload = ?{tail}"]
                   * workloads
                   + [f"SELECT {columns} FROM jobs WHERE {base} AND workload = ? "
                      f"AND variant = ?{tail}"] * pairs)
    branches = per_pin * 2
    # Plain branches under one ORDER BY: SQLite merges them in the claim index's own order,
    # and _candidates steps the merge only as far as the claim reads. Each branch wrapped in its
    # own ORDER BY subquery made SQLite sort both through temporary B-trees: twice the time (19
    # against 9 us), measured. tests/collector/test_claim_query.py holds the plan to this.
    return " UNION ALL ".join(branches) + " ORDER BY priority DESC, seq"


def _candidates(conn: sqlite3.Connection, claimant: Claimant, workloads: list[str] | None,
                min_priority: int | None, pairs: list[tuple[str, str]] | None = None
                ) -> Iterator[sqlite3.Row]:
    """Queued jobs this claimant may be offered by executor, pin and workload (or workload
    and variant, for a declared pairing), in claim order. workloads None: any workload.

    One statement, stepped as the caller reads. Pages of 64 found each by a cursor of the last
    (priority < p OR (priority = p AND seq > s)) made SQLite walk each priority's range from its
    start again for every page: 11,000 queued jobs its device could never take cost a poll
    150 ms, and 100,000 would have cost seconds (the work grew with the square of them)."""
    keys: list[tuple[str, ...]] = (
        [()] if workloads is None else [(w,) for w in workloads] + list(pairs or ()))
    params: list[Any] = []  # each branch's, in _claim_sql's order
    for pin in ("", claimant.id):
        for key in keys:
            params += [claimant.executor, pin, *key]
            if min_priority is not None:
                params.append(min_priority)
    shape = (len(workloads) if workloads is not None else 0, min_priority is not None)
    paired = len(pairs or ()) if workloads is not None else 0
    cursor = conn.execute(_claim_sql(*shape, paired, claimant.executor), params)
    try:
        yield from cursor
    finally:  # a claim found: the statement is reset before the claim writes
        cursor.close()


def _lock_refusal(conn: sqlite3.Connection, row: sqlite3.Row, subject: str,
                  ignore_job: str | None, device: Device | None) -> str | None:
    if device is not None and device.device_id == subject and device.lock_holder is not NOT_READ:
        holder = device.lock_holder  # read with the device, in this same transaction
    else:
        found = conn.execute("SELECT job_id FROM device_locks WHERE device_id = ?",
                             (subject,)).fetchone()
        holder = found["job_id"] if found else None
    if holder is not None and holder != ignore_job:
        return f"device {subject} is locked by {holder}"
    if row["exclusive"]:
        running = conn.execute(
            "SELECT job_id FROM jobs WHERE status = 'claimed' AND job_id != ? AND "
            "(claimed_by = ? OR target_device = ?) LIMIT 1",
            (ignore_job or "", subject, subject)).fetchone()
        if running:
            return f"device {subject} is running {running['job_id']}"
    return None


def attachment_refusal(conn: sqlite3.Connection, device_id: str, executor: str) -> str | None:
    """Why a host executor may not take a job pinned to this device: the device is registered
    as attached to another executor (executors register what they drive, with
    descriptor.attached_to, at start and every beacon). A device registered by no executor, or
    not registered at all, goes to any executor."""
    host = authority.attached_to(conn, device_id)
    if host is not None and host != executor:
        return f"device {device_id} is attached to executor {host}"
    return None


def _spec_text(conn: sqlite3.Connection, row: sqlite3.Row) -> str:
    spec = row["spec"]  # read with the candidate when no check before could refuse it
    if spec is None:
        spec = conn.execute("SELECT spec FROM jobs WHERE seq = ?", (row["seq"],)).fetchone()[0]
    return str(spec)


def _refusal(conn: sqlite3.Connection, row: sqlite3.Row, claimant: Claimant,
             device: Device | None, now: float, ignore_job: str | None,
             budget: verdicts.Budget | None = None) -> tuple[str | None, str | None]:
    """(why the claimant may not take this candidate now, or None; its spec's text, when it
    was read: once the checks that need no spec passed)."""
    if claimant.executor == Executor.DEVICE:
        assert device is not None
        why = static_refusal(device, row["workload"], row["variant"], row["pool"], row["match"],
                             budget)
        if why:
            return why, None
    elif row["target_device"]:
        why = attachment_refusal(conn, row["target_device"], claimant.id)
        if why:
            return why, None
    spec = _spec_text(conn, row)
    # Most specs carry no constraints; only those are decoded here.
    constraints = (jsonio.loads_stored(spec).get("constraints")
                   if '"constraints"' in spec else None)
    if constraints:
        # A host job is checked against the device it pins, when that device is registered.
        source = device if claimant.executor == Executor.DEVICE else (
            load_device(conn, row["target_device"]) if row["target_device"] else None)
        why = rules.constraint_refusal(constraints, source.last_beacon if source else None,
                                       source.last_beacon_at if source else None, now)
        if why:
            return why, spec
    return _lock_refusal(conn, row, row["target_device"] or claimant.id, ignore_job, device), spec


def find_claimable(conn: sqlite3.Connection, claimant: Claimant, now: float, *,
                   device: Device | None = None, min_priority: int | None = None,
                   ignore_job: str | None = None) -> sqlite3.Row | None:
    """The first queued job this claimant may take now, in claim order, or None. `ignore_job`
    (a running job that could be preempted) counts as neither held nor holding a lock."""
    return _find(conn, claimant, now, device, min_priority, ignore_job)[0]


_NOTHING: tuple[None, str, bool] = (None, "", True)


def _find(conn: sqlite3.Connection, claimant: Claimant, now: float, device: Device | None,
          min_priority: int | None = None, ignore_job: str | None = None,
          view: executors.ClaimView | None = None
          ) -> tuple[sqlite3.Row | None, str, bool]:
    """find_claimable, with the found job's spec text, and whether anything stood in the way
    when it found nothing: a queued job it was refused, a busy flag, a job held (False:
    nothing queued it could be offered)."""
    workloads: list[str] | None = None
    pairs: list[tuple[str, str]] = []
    slots = 1  # a device holds one claimed job at a time
    if claimant.executor == Executor.DEVICE:
        device = device or load_device(conn, claimant.id)
        if device is None:
            return _NOTHING
        if (device.busy_job_id and device.busy_at is not None
                and now - device.busy_at < rules.BUSY_STALE_S):
            return _NOTHING  # it holds a claim with another collector
        routes = rules.declared_routes(device.capabilities)
    else:
        # What the executor declared (POST /executors/register) and its slots: one read by
        # primary key, or none when the poll's first look has just read them.
        capabilities, slots = view or executors.claim_view(conn, claimant.id)
        routes = rules.declared_routes(capabilities)
    if routes is not None:
        workloads, pairs = routes
        if not workloads and not pairs:
            return None, "", False
    if device is not None and device.holding is not NOT_READ:
        if device.holding is not None and device.holding != ignore_job:
            return _NOTHING  # a device holds one claimed job at a time
    elif _holds_its_slots(conn, claimant, slots, ignore_job):
        return _NOTHING
    refused = False
    budget = verdicts.Budget(verdicts.CLAIM_BUDGET_S)
    for row in _candidates(conn, claimant, workloads, min_priority, pairs):
        why, spec = _refusal(conn, row, claimant, device, now, ignore_job, budget)
        if why is None:
            assert spec is not None  # read once the checks without it passed
            return row, spec, True
        refused = True
    return None, "", refused


def _holds_its_slots(conn: sqlite3.Connection, claimant: Claimant, slots: int,
                     ignore_job: str | None) -> bool:
    """Does the claimant hold as many claimed jobs as it has slots (a device: one)?"""
    held = conn.execute(
        "SELECT COUNT(*) FROM (SELECT 1 FROM jobs WHERE status = 'claimed' AND claimed_by = ? "
        "AND executor = ? AND job_id != ? LIMIT ?)",
        (claimant.id, claimant.executor, ignore_job or "", slots)).fetchone()[0]
    return bool(held >= slots)


def claim(conn: sqlite3.Connection, claimant: Claimant, now: float,
          effects: Effects, device: Device | None = None,
          view: executors.ClaimView | None = None) -> dict[str, Any] | None:
    """Claim the next job for a device or host executor: the spec to run, or None. `device`
    (a device's row) or `view` (a host executor's) saves the read when the caller has it."""
    if claimant.executor == Executor.DEVICE:
        device = device or load_device(conn, claimant.id)
        if device is None:
            return None
        if touch_due(device.last_seen, now):  # written with others later: see jobs.sightings
            effects.sightings.append((claimant.id, now))
    row, spec_text, stood_in_the_way = _find(conn, claimant, now, device, view=view)
    if row is None:
        effects.looked.append((claimant.key, stood_in_the_way))
        return None
    deadline = now + row["ttl_s"]
    attempt = row["attempts"] + 1
    conn.execute(
        "UPDATE jobs SET status = 'claimed', claimed_by = ?, attempts = ?, lease_deadline = ?, "
        "claimed_at = ?, updated_at = ? WHERE seq = ?",
        (claimant.id, attempt, deadline, now, now, row["seq"]))
    conn.execute("INSERT INTO job_attempts (job_id, job_seq, attempt, claimed_by, claimed_at) "
                 "VALUES (?, ?, ?, ?, ?)", (row["job_id"], row["seq"], attempt, claimant.id, now))
    if row["exclusive"]:
        conn.execute("INSERT OR REPLACE INTO device_locks (device_id, job_id, locked_at) "
                     "VALUES (?, ?, ?)", (row["target_device"] or claimant.id, row["job_id"], now))
    effects.job(row["job_id"], JobStatus.CLAIMED, row["workload"], row["executor"],
                claimed_by=claimant.id)
    effects.no_commit_status(row["job_id"], spec_text)
    # A queued job's updated_at is when it last became claimable: stored, requeued or promoted
    # (or its priority changed): the claim-wait histogram measures from there.
    effects.claim_waits.append(max(0.0, now - row["updated_at"]))
    spec = jsonio.loads_stored(spec_text)
    spec["lease"] = {**(spec.get("lease") or {}), "ttl_s": row["ttl_s"],
                     "max_attempts": row["max_attempts"]}
    spec["attempt"] = attempt
    spec["lease_deadline"] = iso(deadline)
    return spec


@replayable


def first_claim(conn: sqlite3.Connection, claimant: Claimant, now: float, effects: Effects,
                caller: str | None = None) -> tuple[list[str] | None, dict[str, Any] | None]:
    """A poll's first look: what its device or executor declared and a claim, in one hop.

    Raises NotFound for a device that never registered, and Forbidden when `caller` (the mesh
    node the poll came from; None off the mesh) may not act for the claimant.
    """
    if claimant.executor != Executor.DEVICE:
        stored = executors.admit(conn, claimant.id, now)
        if caller is not None:
            authority.bind_executor(conn, claimant.id, caller, now)
        executors.seen(conn, claimant.id, claimant.slots, now)
        view = executors.view_after_poll(stored, claimant.slots)
        return view[0], claim(conn, claimant, now, effects, view=view)
    device = load_device(conn, claimant.id)
    if device is None:
        raise NotFound(f"device {claimant.id!r} is not registered; register first "
                       "(POST /devices/register)")
    if caller is not None:
        authority.check_device_node(claimant.id, device.mesh_node, caller)
    return device.capabilities, claim(conn, claimant, now, effects, device)


@replayable
def claim_many(conn: sqlite3.Connection, claimants: list[Claimant], now: float,
               effects: Effects) -> list[dict[str, Any] | None]:
    """Claims for several waiting long polls in one transaction (the dispatcher's batch)."""
    return [claim(conn, claimant, now, effects) for claimant in claimants]


def should_preempt(conn: sqlite3.Connection, row: sqlite3.Row, now: float) -> bool:
    """True when the running job is preemptible and a queued job of strictly higher priority
    would go to the same claimant."""
    if not row["preemptible"]:
        return False
    claimant = Claimant(row["executor"], row["claimed_by"])
    found = find_claimable(conn, claimant, now, min_priority=row["priority"] + 1,
                           ignore_job=row["job_id"])
    return found is not None


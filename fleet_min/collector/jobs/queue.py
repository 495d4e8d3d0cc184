"""The job queue: enqueue, leases and the sweep, release, cancel, retry, priority, dependencies
with template promotion, fan-out and preemption. Taking a job is in claims.

Every public function here that changes state is a transaction function: it runs on the event
loop's thread with the connection as its first argument, inside the writer's open transaction
(see fleet_min.db), and records what changed in an Effects object for the code that runs after
the commit.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

from fleet_min import jsonio, validate
from fleet_min.collector.jobs import authority, executors, rules, templates, verdicts
from fleet_min.collector.jobs.claims import static_refusal
from fleet_min.collector.jobs.devices import Device, device_from_row, device_with_fields
from fleet_min.collector.jobs.effects import Effects, JobRoute
from fleet_min.collector.jobs.kinds import (
    FINAL,
    UNSUCCESSFUL,
    AttemptOutcome,
    Executor,
    JobStatus,
    LeaseExpiry,
)
from fleet_min.collector.jobs.match import compiled
from fleet_min.collector.jobs.specs import JobSpec, Targets, check_spec
from fleet_min.db import like_escape, replayable
from fleet_min.errors import BadRequest, Conflict, NotFound, Unprocessable
from fleet_min.timeutil import iso

# ---------------------------------------------------------------------------------------------
# rows


def job_row(conn: sqlite3.Connection, job_id: str) -> sqlite3.Row | None:
    return conn.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()


def route_of(row: sqlite3.Row) -> JobRoute:
    return JobRoute(row["job_id"], row["executor"], row["pin"], row["workload"], row["variant"],
                    row["pool"])


def job_record(row: sqlite3.Row) -> dict[str, Any]:
    """The API shape of a job row: flat fields plus the stored spec under `spec`."""
    return {
        "job_id": row["job_id"],
        "workload": row["workload"],
        "executor": row["executor"],
        "backend": row["backend"],
        "status": row["status"],
        "priority": row["priority"],
        "claimed_by": row["claimed_by"],
        "attempts": row["attempts"],
        "max_attempts": row["max_attempts"],
        "lease_ttl_s": row["ttl_s"],
        "lease_deadline": iso(row["lease_deadline"]),
        "last_error": row["last_error"],
        "parent_job_id": row["parent_job_id"],
        "template_id": row["template_id"],
        "fanout_parent": bool(row["is_group"]),
        "created_at": iso(row["created_at"]),
        "updated_at": iso(row["updated_at"]),
        "claimed_at": iso(row["claimed_at"]),
        "finished_at": iso(row["finished_at"]),
        "warnings": json.loads(row["warnings"]) if row["warnings"] else [],
        "spec": json.loads(row["spec"]),
        # The executor a host job is pinned to (targets.executor), as the original shows it.
        "wants_executor": (row["pin"] or None) if row["executor"] == Executor.HOST else None,
    }


def _set_status(conn: sqlite3.Connection, job_id: str, status: str, now: float,
                last_error: str | None = None) -> None:
    """Set a status; a closed job also loses its lease."""
    if status in FINAL:
        conn.execute("UPDATE jobs SET status = ?, updated_at = ?, finished_at = ?, "
                     "last_error = ?, lease_deadline = NULL WHERE job_id = ?",
                     (status, now, now, last_error, job_id))
    else:
        conn.execute("UPDATE jobs SET status = ?, updated_at = ?, last_error = ? "
                     "WHERE job_id = ?", (status, now, last_error, job_id))


def _end_attempt(conn: sqlite3.Connection, row: sqlite3.Row, outcome: str, error: str | None,
                 now: float) -> None:
    """Close the job's open attempt (found by the job's seq: see schema migration 3)."""
    conn.execute(
        "UPDATE job_attempts SET ended_at = ?, outcome = ?, error = ? "
        "WHERE job_seq = ? AND ended_at IS NULL", (now, outcome, error, row["seq"]))


def unlock(conn: sqlite3.Connection, job_id: str, effects: Effects) -> int:
    """Release the job's device locks; a poll a freed device holds waiting looks again."""
    freed = conn.execute("DELETE FROM device_locks WHERE job_id = ? RETURNING device_id",
                         (job_id,)).fetchall()
    for (device_id,) in freed:
        effects.claimant_changed(Executor.DEVICE, device_id)
    return len(freed)


def _may_lock(row: sqlite3.Row) -> bool:
    """Might the job hold device locks: an exclusive job (its claim took one) or a host job
    (its executor may take some, POST /locks/acquire)? Others cost no DELETE when they end."""
    return bool(row["exclusive"]) or row["executor"] == Executor.HOST


# ---------------------------------------------------------------------------------------------
# enqueue


@dataclass
class Enqueued:
    replies: list[dict[str, Any]]
    jobs: int = 0  # jobs written, fan-out parents and children counted


class OverBudget(Unprocessable):
    """The jobs (or fan-out bytes) would pass what one request may create. The scheduler's tick
    shares one budget among its schedules and holds back the run that meets this."""


# Jobs one request may create, fan-out parents and children included: a POST /jobs of 1,000
# specs, a retry, a schedule's run. MAX_BATCH bounds the specs, not what they fan out to: 100
# fan-outs to 5,000 registered devices wrote 500,000 jobs in one transaction on the event loop
# (17 s of stall, 515 MB). A shelf of devices is tens to a few hundred, so a real request stays
# far below this (a full batch fanned out to 9 devices each fits), while the loop is held about
# 0.3 s for 9,999 jobs, 0.5 s to write and undo a refused 10,100 (2-core VM).
MAX_JOBS_PER_REQUEST = 10_000
# Bytes of spec the fan-out children of one request may hold: each child is a copy of its
# parent's spec, so 9,999 children of a 1 MiB spec would be 10 GB. 64 children of 1 MiB took
# 0.3 s, as 9,999 small jobs do; a 6 kB spec still reaches 10,000 devices.
MAX_FANOUT_BYTES = 64 << 20
# Dependencies (depends_on entries, 100 at most a spec) one request may name: each is a lookup
# and a row, and 1,000 specs naming 100 each held the event loop 0.77 s. Chains and fan-ins of
# a few thousand fit; a larger graph arrives in several requests.
MAX_DEPENDENCIES_PER_REQUEST = 10_000


class _Tally:
    """The jobs a request creates, counted before they are written: every spec is one job
    (a fan-out's parent too), and a fan-out adds its children once its targets are known.
    Its template rewrites share one budget (see templates.Rewrites)."""

    def __init__(self, conn: sqlite3.Connection, jobs: int) -> None:
        self.conn = conn
        self.jobs = jobs
        self.fanout_bytes = 0
        self._rewrites: templates.Rewrites | None = None

    @property
    def rewrites(self) -> templates.Rewrites:
        if self._rewrites is None:  # most requests rewrite nothing
            self._rewrites = _rewrites(self.conn)
        return self._rewrites

    def add_children(self, parent_id: str, children: int, spec_bytes: int) -> None:
        self.jobs += children
        if self.jobs > MAX_JOBS_PER_REQUEST:
            raise OverBudget(
                f"this request would create at least {self.jobs} jobs, more than the "
                f"{MAX_JOBS_PER_REQUEST} one request may create (fan-out {parent_id} alone "
                f"reaches {children} targets); narrow the fan-outs' targets (a pool, a match "
                "expression, fanout.distinct) or send them in several requests")
        self.fanout_bytes += children * spec_bytes
        if self.fanout_bytes > MAX_FANOUT_BYTES:
            raise OverBudget(
                f"this request's fan-out children would hold at least {self.fanout_bytes} "
                f"bytes of spec, more than the {MAX_FANOUT_BYTES} one request may store "
                f"(fan-out {parent_id} alone: {children} copies of a {spec_bytes}-byte spec); "
                "make the spec smaller (put large inputs in an artifact) or narrow the "
                "fan-out's targets")


@replayable
def enqueue(conn: sqlite3.Connection, specs: list[JobSpec], now: float,
            effects: Effects, template_id: str | None = None, *, spent: int = 0,
            prepared: Prepared | None = None, bounded: bool = False) -> Enqueued:
    """Store validated specs atomically (all or none). `spent` is the jobs already written
    under the same budget (the scheduler's tick: every run it fires shares one). `prepared` is
    what prepare_enqueue read for these specs before the transaction; what it does not hold is
    read here, and with `bounded` only as much of the registry as a transaction on the event
    loop's thread may read (ReadFirst past it).

    Raises Conflict, BadRequest or Unprocessable (OverBudget past the budget), and then
    nothing is stored.
    """
    ids = [spec["job_id"] for spec in specs]
    seen: set[str] = set()
    for job_id in ids:
        if job_id in seen:
            raise Conflict(f"job_id {job_id!r} appears twice in the request")
        seen.add(job_id)
    # An id already taken is found by the INSERT itself (_insert), not by a read before it:
    # a single spec refused there has written nothing, and a later spec of a batch refused
    # after earlier ones were stored is undone with them.
    named = sum(len(spec.get("depends_on") or ()) for spec in specs)
    if named > MAX_DEPENDENCIES_PER_REQUEST:
        raise Unprocessable(
            f"this request names {named} dependencies (depends_on), more than the "
            f"{MAX_DEPENDENCIES_PER_REQUEST} one request may; send the jobs in several "
            "requests (a job may depend on jobs stored by an earlier one)")
    for spec in specs:
        _check_capability(conn, spec, prepared, bounded=bounded)
    order = _dependency_order(conn, specs)
    tally = _Tally(conn, spent + len(specs))
    if tally.jobs > MAX_JOBS_PER_REQUEST:
        raise OverBudget(f"{spent} jobs were created already under this budget of "
                         f"{MAX_JOBS_PER_REQUEST}; {len(specs)} more would pass it")
    replies: dict[str, dict[str, Any]] = {}
    for spec in order:
        replies[spec["job_id"]] = _store(conn, spec, now, effects, tally,
                                         template_id=template_id, prepared=prepared,
                                         bounded=bounded)
    return Enqueued([replies[job_id] for job_id in ids], tally.jobs - spent)


@dataclass(frozen=True)
class Prepared:
    """What enqueue reads of a request's specs, read before its transaction (prepare_enqueue):
    for the capability names of a workload that needs a registered claimant (by
    _capability_key), None when one declares them or the refusal saying none does; for a
    fan-out (by _fanout_key: what choosing reads of it), its targets or the refusal choosing
    them raised."""

    capability: Mapping[tuple[str, ...], Unprocessable | None]
    targets: Mapping[bytes, list[str] | Unprocessable]


def prepare_enqueue(conn: sqlite3.Connection, specs: list[JobSpec], now: float, *,
                    separately: bool = False) -> Prepared:
    """Read what enqueue needs of the registry for `specs` (its `prepared`). Run in a worker
    thread on a read connection (Database.read_in_thread) before the request's transaction:
    both reads may look at every registered device, and at the registry's bound of devices
    registered at their limits they held the event loop for seconds (a workload nobody
    declares 2.7 s, `bench/device_listing.py --ask undeclared`; a fan-out 11 to 14 s and
    1.4 GB, `--ask fanout`). The registry is as it was when read; a device registered or
    removed before the transaction is as one registered or removed just after it.

    With `separately` the specs are runs a scheduler's tick enqueues each on its own: every
    one's workload is checked and every fan-out's targets chosen, for at most PREPARE_BUDGET_S
    (the rest are left to a later tick)."""
    capability: dict[tuple[str, ...], Unprocessable | None] = {}  # a batch names a few
    started = time.monotonic()
    for spec in specs:
        if rules.is_built_in(spec["workload"], spec["executor"], spec.get("backend")):
            continue
        key = _capability_key(spec)
        if key not in capability:
            if separately and time.monotonic() - started > PREPARE_BUDGET_S:
                break
            try:
                _check_capability(conn, spec)
                capability[key] = None
            except Unprocessable as refused:
                capability[key] = refused
        if capability[key] is not None and not separately:  # enqueue stops at a refusal
            return Prepared(capability, {})
    return Prepared(capability, _choose_targets(conn, specs, now, separately=separately,
                                                started=started))


# Time one request may spend choosing the targets of its fan-outs, over all of them: each reads
# every registered device, a few milliseconds on a shelf of a few hundred and seconds at the
# registry's bound of devices registered at their limits, so a batch of a thousand fan-outs,
# each with its own match expression, would hold a worker thread for an hour.
PREPARE_BUDGET_S = 10.0


def _fanout_key(spec: JobSpec) -> bytes:
    """What choosing a fan-out's targets reads of its spec (a host child's id must be a job id:
    its own id too, for a host fan-out alone)."""
    return jsonio.dumps_body([spec["workload"], spec["executor"], rules.spec_variant(spec),
                              spec.get("targets"), spec.get("fanout"),
                              spec["job_id"] if spec["executor"] == Executor.HOST else None])


def _choose_targets(conn: sqlite3.Connection, specs: list[JobSpec], now: float, *,
                    separately: bool, started: float) -> dict[bytes, list[str] | Unprocessable]:
    """The targets of each fan-out among `specs`, or the refusal choosing them raised, by
    _fanout_key: fan-outs that choose alike are chosen once. For one request, choosing stops at
    the first refusal, once the children pass what one request may create (enqueue refuses it
    there), and past PREPARE_BUDGET_S from `started` (the fan-out it reached is refused); for a
    tick's runs (`separately`), only past the budget, leaving the rest unchosen."""
    targets: dict[bytes, list[str] | Unprocessable] = {}
    jobs = len(specs)
    for spec in specs:
        if not spec.get("fanout"):
            continue
        key = _fanout_key(spec)
        if key in targets:
            continue
        if time.monotonic() - started > PREPARE_BUDGET_S:
            if separately:
                break
            targets[key] = Unprocessable(
                f"choosing the targets of this request's fan-outs took more than "
                f"{PREPARE_BUDGET_S:g} s, and the collector stops there; send fewer fan-outs "
                f"in one request, or narrow their targets (fan-out {spec['job_id']} was not "
                "reached)")
            break
        try:
            pins = targets[key] = fanout_pins(conn, spec, now)
        except Unprocessable as refused:
            targets[key] = refused
            if separately:
                continue
            break
        jobs += len(pins)
        if jobs > MAX_JOBS_PER_REQUEST and not separately:
            break
    return targets


_NOT_PREPARED = object()


class ReadFirst(Exception):
    """Raised by enqueue (with `bounded`) when its check that a registered claimant declares a
    workload has looked at CHECK_IN_TRANSACTION of them without finding one and there are
    more, or when a device fan-out it was handed no targets for would choose among more than
    CHECK_IN_TRANSACTION devices: the caller reads the registry with prepare_enqueue on a
    worker thread, then runs enqueue again with what it read. The transaction (or the
    schedule run's savepoint) it ends is undone: nothing it wrote stands."""


# Registered devices (or executors) the check that one declares a job's workload reads inside
# the transaction, on the event loop's thread: a shelf is looked at whole, and a registry past
# it is read off the loop (ReadFirst). The claimant that declared it last is looked at first,
# by its key, so a job of a workload only the newest device declares costs one row.
CHECK_IN_TRANSACTION = 32
_DECLARERS: dict[tuple[str, ...], str] = {}  # (executor, *names) -> the last claimant found
_DECLARERS_KEPT = 1024

_CLAIMANTS: dict[str, tuple[str, str]] = {  # executor -> (its table, its key column)
    Executor.DEVICE: ("devices", "device_id"),
    Executor.HOST: ("executors", "name"),
}


def _check_capability(conn: sqlite3.Connection, spec: JobSpec,
                      prepared: Prepared | None = None, *, bounded: bool = False) -> None:
    """Refuse a job whose workload is not built in when no registered claimant declares it.
    With `bounded`, raise ReadFirst rather than read more than CHECK_IN_TRANSACTION claimants."""
    workload, executor, backend = spec["workload"], spec["executor"], spec.get("backend")
    if rules.is_built_in(workload, executor, backend):
        return
    key = _capability_key(spec)
    known = prepared.capability.get(key, _NOT_PREPARED) if prepared else _NOT_PREPARED
    if isinstance(known, Unprocessable):
        raise Unprocessable(known.message)
    if known is None:
        return
    names = key[1:]
    if _declarer(conn, key, workload, bounded) is not None:
        return
    wanted = names[-1]
    if executor == Executor.HOST:
        raise Unprocessable(f"no registered host executor declares {wanted!r}, and it is not a "
                            "built-in host workload ("
                            f"{', '.join(sorted(rules.HOST_WORKLOADS))}); start an executor "
                            "that declares it first")
    raise Unprocessable(f"no registered agent declares the capability {wanted!r} and it is not "
                        "built in; register an agent that declares it first")


def _capability_key(spec: JobSpec) -> tuple[str, ...]:
    """(executor, the capability names that satisfy the spec): what the check reads of it."""
    return (spec["executor"], *rules.capability_names(spec["workload"], rules.spec_variant(spec)))


def _declarer(conn: sqlite3.Connection, hint: tuple[str, ...], workload: str,
              bounded: bool) -> str | None:
    """A registered claimant that may be offered a job of `hint` (_capability_key): one of
    its executor that declares one of the names, or one that declared nothing (NULL) where
    that counts: a device that never declared capabilities is offered everything, so it
    counts for the workloads the spec names (rules.SPEC_WORKLOADS), not for a name of its
    own; a registered executor that declared nothing is offered every host job."""
    executor, names = hint[0], hint[1:]
    table, key = _CLAIMANTS[executor]
    if executor == Executor.DEVICE:
        undeclared = "c.capabilities IS NULL OR " if workload in rules.SPEC_WORKLOADS else ""
    else:
        undeclared = "(c.registered_at IS NOT NULL AND c.capabilities IS NULL) OR "
    declares = (f"({undeclared}EXISTS (SELECT 1 FROM json_each(c.capabilities) "
                f"WHERE json_each.value IN ({','.join('?' * len(names))})))")
    last = _DECLARERS.get(hint)
    if last is not None and conn.execute(
            f"SELECT 1 FROM {table} c WHERE c.{key} = ? AND {declares}",
            (last, *names)).fetchone():
        return last
    columns = f"{key}, capabilities" + (", registered_at" if executor == Executor.HOST else "")
    rows = (f"(SELECT {columns} FROM {table} LIMIT {CHECK_IN_TRANSACTION})" if bounded
            else table)
    found = conn.execute(f"SELECT c.{key} FROM {rows} c WHERE {declares} LIMIT 1",
                         names).fetchone()
    if found is not None:
        if len(_DECLARERS) >= _DECLARERS_KEPT:
            _DECLARERS.clear()
        _DECLARERS[hint] = found[0]
        return str(found[0])
    if bounded and conn.execute(f"SELECT 1 FROM {table} LIMIT 1 OFFSET {CHECK_IN_TRANSACTION}"
                                ).fetchone():
        raise ReadFirst
    return None


def _dependency_order(conn: sqlite3.Connection, specs: list[JobSpec]) -> list[JobSpec]:
    """The batch in an order where in-batch dependencies come first; refuses missing and cycles."""
    if not any(spec.get("depends_on") for spec in specs):
        return specs  # the usual batch: nothing to check, and its own order is the order
    by_id = {spec["job_id"]: spec for spec in specs}
    for spec in specs:
        deps = spec.get("depends_on") or []
        if spec["job_id"] in deps:
            raise BadRequest(f"job {spec['job_id']} depends on itself, a dependency cycle")
        outside = [d for d in deps if d not in by_id]
        if outside:
            found = {row[0] for row in conn.execute(
                f"SELECT job_id FROM jobs WHERE job_id IN ({','.join('?' * len(outside))})",
                outside)}
            missing = [d for d in outside if d not in found]
            if missing:
                raise BadRequest(f"job {spec['job_id']} depends on {missing[0]}, which does not "
                                 "exist; enqueue it first or in the same request")
    return _in_batch_order(by_id, specs)


def _in_batch_order(by_id: dict[str, JobSpec], specs: list[JobSpec]) -> list[JobSpec]:
    """A depth-first walk of the in-batch dependencies, with its own stack: a batch can hold a
    chain of 1,000 jobs listed last to first, deeper than Python's recursion limit."""
    ordered: list[JobSpec] = []
    state: dict[str, int] = {}  # 1 = on the stack (being visited), 2 = placed in `ordered`

    def in_batch(job_id: str) -> Iterator[str]:
        return (d for d in by_id[job_id].get("depends_on") or [] if d in by_id)

    for spec in specs:
        if spec["job_id"] in state:
            continue
        state[spec["job_id"]] = 1
        stack = [(spec["job_id"], in_batch(spec["job_id"]))]
        while stack:
            job_id, deps = stack[-1]
            for dep in deps:
                if state.get(dep) == 1:
                    raise BadRequest(_cycle_sentence([j for j, _ in stack], dep))
                if dep not in state:
                    state[dep] = 1
                    stack.append((dep, in_batch(dep)))
                    break
            else:  # every dependency placed: this job can be
                stack.pop()
                state[job_id] = 2
                ordered.append(by_id[job_id])
    return ordered


def _cycle_sentence(path: list[str], back_to: str) -> str:
    cycle = [*path[path.index(back_to):], back_to]
    if len(cycle) > 9:  # a sentence, not a listing of a 1,000-job loop
        cycle = [*cycle[:4], f"... ({len(cycle) - 8} more)", *cycle[-4:]]
    return f"the dependencies form a cycle: {' -> '.join(cycle)}"


def _resolve_latest(conn: sqlite3.Connection, spec: JobSpec) -> JobSpec:
    """app.sha256 "latest" becomes the newest published build's hash; an app.build that is
    absent or also "latest" becomes that build's own build string (when it was published with
    one), so the stored spec says which build ran, never the word."""
    app = spec.get("app")
    if not isinstance(app, dict) or app.get("sha256") != "latest":
        return spec
    name = app.get("name")
    row = conn.execute("SELECT sha256, build FROM artifacts WHERE app = ? "
                       "ORDER BY created_at DESC, rowid DESC LIMIT 1", (name,)).fetchone()
    if row is None:
        raise BadRequest(f"app.sha256 is 'latest' but no build of app {name!r} has been "
                         "published; upload one with the x-artifact-app header first")
    resolved = {**app, "sha256": row["sha256"]}
    if app.get("build", "latest") == "latest" and row["build"]:
        resolved["build"] = row["build"]
    return {**spec, "app": resolved}


def latest_build(conn: sqlite3.Connection, app_name: str) -> str | None:
    row = conn.execute("SELECT sha256 FROM artifacts WHERE app = ? "
                       "ORDER BY created_at DESC, rowid DESC LIMIT 1", (app_name,)).fetchone()
    return row["sha256"] if row else None


def _store(conn: sqlite3.Connection, spec: JobSpec, now: float, effects: Effects,
           tally: _Tally, *, template_id: str | None = None,
           parent: str | None = None, prepared: Prepared | None = None,
           bounded: bool = False) -> dict[str, Any]:
    spec = _resolve_latest(conn, spec)
    if spec.get("fanout"):
        chosen = prepared.targets.get(_fanout_key(spec)) if prepared else None
        if chosen is None and bounded and spec["executor"] == Executor.DEVICE and conn.execute(
                f"SELECT 1 FROM devices LIMIT 1 OFFSET {CHECK_IN_TRANSACTION}").fetchone():
            raise ReadFirst  # a registry past a shelf is read off the event loop's thread
        return _store_fanout(conn, spec, now, effects, tally, template_id, chosen)
    if parent is None:
        _check_pins_agree(conn, spec)
    status, last_error, spec = _initial_status(conn, spec, tally)
    warnings = validate.param_warnings(spec)
    route = _insert(conn, spec, status, last_error, now, template_id=template_id, parent=parent,
                    warnings=warnings)
    effects.job(spec["job_id"], status, spec["workload"], spec["executor"])
    if status == JobStatus.QUEUED:
        effects.claimable.append(route)
    reply: dict[str, Any] = {"job_id": spec["job_id"], "status": status}
    if warnings:
        reply["warnings"] = warnings
    return reply


def _check_pins_agree(conn: sqlite3.Connection, spec: JobSpec) -> None:
    """A host job that names both an executor and a device attached to another could never be
    offered (see claims.attachment_refusal): refused, naming both, rather than left queued."""
    targets = spec.get("targets") or {}
    wanted, device = targets.get("executor"), targets.get("device_id")
    if spec["executor"] != Executor.HOST or not wanted or not device:
        return
    host = authority.attached_to(conn, device)
    if host is not None and host != wanted:
        raise BadRequest(f"job {spec['job_id']}: targets.executor is {wanted!r} but device "
                         f"{device} is attached to executor {host!r}; name that one, or "
                         "leave targets.executor out")


def _initial_status(conn: sqlite3.Connection, spec: JobSpec, tally: _Tally
                    ) -> tuple[str, str | None, JobSpec]:
    deps = spec.get("depends_on") or []
    if not deps:
        return JobStatus.QUEUED, None, spec
    statuses = {row["job_id"]: row for row in conn.execute(
        "SELECT job_id, status, last_error FROM jobs "
        f"WHERE job_id IN ({','.join('?' * len(deps))})",
        deps)}
    for dep in deps:
        row = statuses[dep]
        if row["status"] in UNSUCCESSFUL:
            return JobStatus.FAILED, _dependency_error(dep, row["status"], row["last_error"]), spec
    if all(statuses[d]["status"] == JobStatus.DONE for d in deps):
        try:
            return JobStatus.QUEUED, None, _rewritten(tally.rewrites, spec)
        except templates.Unresolvable as exc:
            return JobStatus.FAILED, str(exc), spec
    return JobStatus.WAITING, None, spec


CASCADE_EVENTS = 100  # dependents failed together that each get a job event on the stream
REASON_CHARS = 200  # of a failed dependency's own error, quoted in its dependents' errors


def _dependency_error(dep: str, status: str, error: str | None) -> str:
    """Why a job failed without running: one sentence naming the dependency where the failure
    started and quoting its error cut short, so the text stays the same size however long the
    chain that passes it on."""
    verb = "was cancelled" if status == JobStatus.CANCELLED else "failed"
    if error and len(error) > REASON_CHARS:
        error = error[:REASON_CHARS - 3] + "..."
    return f"dependency {dep!r} {verb}" + (f": {error}" if error else "")


def _insert(conn: sqlite3.Connection, spec: JobSpec, status: str,
            last_error: str | None, now: float, *, template_id: str | None,
            parent: str | None, is_group: bool = False,
            warnings: list[str] | None = None) -> JobRoute:
    targets = spec.get("targets") or {}
    lease = spec.get("lease") or {}
    executor = spec["executor"]
    pin = (targets.get("device_id") if executor == Executor.DEVICE
           else targets.get("executor")) or ""
    variant = rules.spec_variant(spec)
    stored = conn.execute(
        """
        INSERT INTO jobs (job_id, workload, executor, backend, variant, status, priority, pin,
                          target_device, pool, match, exclusive, preemptible, is_group,
                          max_attempts, ttl_s, last_error, parent_job_id, template_id, spec,
                          created_at, updated_at, finished_at, warnings)
        VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
        ON CONFLICT (job_id) DO NOTHING
        """,
        (spec["job_id"], spec["workload"], executor, spec.get("backend"), variant, status,
         int(spec.get("priority") or 0), pin, targets.get("device_id"), targets.get("pool"),
         targets.get("match") or None, int(bool(targets.get("exclusive"))),
         int(bool(spec.get("preemptible"))), int(is_group),
         int(lease.get("max_attempts") or rules.DEFAULT_MAX_ATTEMPTS),
         int(lease.get("ttl_s") or rules.default_ttl(spec["workload"])), last_error, parent,
         template_id, jsonio.dumps_stored(spec), now, now, now if status in FINAL else None,
         json.dumps(warnings) if warnings else None))
    if stored.rowcount == 0:
        raise Conflict(f"job_id {spec['job_id']!r} already exists")
    deps = spec.get("depends_on")
    if deps:
        conn.executemany("INSERT INTO job_deps (job_id, depends_on) VALUES (?, ?)",
                         [(spec["job_id"], dep) for dep in deps])
        conn.execute(f"UPDATE jobs SET has_dependents = 1 WHERE job_id IN "
                     f"({','.join('?' * len(deps))}) AND has_dependents = 0", deps)
    return JobRoute(spec["job_id"], executor, pin, spec["workload"], variant, targets.get("pool"))


# ---------------------------------------------------------------------------------------------
# fan-out


def _store_fanout(conn: sqlite3.Connection, spec: JobSpec, now: float, effects: Effects,
                  tally: _Tally, template_id: str | None,
                  chosen: list[str] | Unprocessable | None) -> dict[str, Any]:
    """A fan-out parent (never claimed) and one child per target: per matching device,
    pinned with targets.device_id, or for a host job per executor seen recently, pinned with
    targets.executor (fanout {distinct} is refused for host jobs by specs.check_spec). The
    targets are `chosen` when they were found before the transaction (prepare_enqueue), and a
    refusal found there is raised here, where choosing them would have raised it."""
    pin_field = "device_id" if spec["executor"] == Executor.DEVICE else "executor"
    if isinstance(chosen, Unprocessable):
        raise Unprocessable(chosen.message)
    pins = chosen if chosen is not None else fanout_pins(conn, spec, now)
    if not pins:
        raise Unprocessable(_NO_FANOUT_TARGET[pin_field].format(workload=spec["workload"]))
    parent_id = spec["job_id"]
    if pin_field == "device_id":
        _check_child_ids(parent_id, pins)
    tally.add_children(parent_id, len(pins), len(jsonio.dumps_body(spec)))
    # The parent's rewrite only tells whether its references resolve: it is not stored, so it
    # takes nothing from the request's budget.
    status, last_error, _ = _initial_status(conn, spec, _Tally(conn, 0))
    group_status = (status if status in (JobStatus.FAILED, JobStatus.WAITING)
                    else JobStatus.QUEUED)
    warnings = validate.param_warnings(spec)
    _insert(conn, spec, group_status, last_error, now, template_id=template_id, parent=None,
            is_group=True, warnings=warnings)
    effects.job(parent_id, group_status, spec["workload"], spec["executor"])
    children = []
    streamed_from = len(effects.events)
    for pin in pins:
        child = spec.copy()
        del child["fanout"]
        child["job_id"] = f"{parent_id}--{pin}"
        child["targets"] = cast(Targets, {**(spec.get("targets") or {}), pin_field: pin})
        _store(conn, child, now, effects, tally, template_id=template_id, parent=parent_id)
        children.append(child["job_id"])
    _stream_few(effects, streamed_from, parent_id, group_status)
    reply = {"job_id": parent_id, "status": group_status, "fanout": children}
    return {**reply, "warnings": warnings} if warnings else reply


JOB_ID_CHARS = 200  # the job-id rule's length (validate.is_job_id), for the sentences


def _check_child_ids(parent_id: str, devices: list[str]) -> None:
    """Refuse a device fan-out whose child id (<job_id>--<device_id>) would be past the job-id
    rule's 200 characters: the device would be handed a job that no beacon or row can name.
    Refused rather than left out, as a host fan-out leaves an executor out: a device id
    follows the job-id rule, so only the length can fail, a shorter job_id mends it, and the
    preview (which has no job_id) would otherwise count devices the fan-out skips."""
    longest = max(devices, key=len)
    child = f"{parent_id}--{longest}"
    if validate.is_job_id(child):
        return
    room = JOB_ID_CHARS - 2 - len(longest)
    fix = (f"use a job_id of at most {room} characters" if room > 0 else
           f"leave device {longest[:40]}... out with targets (a pool or a match expression)")
    raise BadRequest(f"job {parent_id}: the fan-out child id {child[:60]}... would be "
                     f"{len(child)} characters, more than the {JOB_ID_CHARS} a job id may have "
                     f"(<job_id>--<device_id>, device ids up to {len(longest)} characters); "
                     f"{fix}")


_NO_FANOUT_TARGET = {
    "device_id": "fan-out matched no registered device that can run {workload!r}; check "
                 "targets and capabilities with POST /api/jobs/preview-targets",
    "executor": "fan-out found no host executor to run {workload!r}: none polled in the last "
                "15 minutes (or the one targets.executor names did not, or the one the device "
                "of targets.device_id is attached to); start one with "
                "fleet_agent.py --executor host",
}


def fanout_pins(conn: sqlite3.Connection, spec: JobSpec, now: float) -> list[str]:
    """A fan-out's targets: the device ids of its devices, or the names of its executors."""
    if spec["executor"] == Executor.DEVICE:
        return [device.device_id for device in fanout_devices(conn, spec, now)]
    return fanout_executors(conn, spec, now)


def fanout_executors(conn: sqlite3.Connection, spec: JobSpec, now: float) -> list[str]:
    """The executors a host fan-out creates children for (equal to the preview)."""
    device = (spec.get("targets") or {}).get("device_id")
    return pick_executors(executors.recent(conn, now), spec,
                          authority.attached_to(conn, device) if device else None)


def pick_executors(seen: list[tuple[str, list[str] | None]], spec: JobSpec,
                   attached: str | None = None) -> list[str]:
    """Of the executors seen recently (executors.recent: each name with what it declared),
    those a host fan-out of this spec reaches: every one that would be offered the job (it
    declared the workload or its pairing, or never said), or only the one targets.executor
    names, and only `attached`, the executor targets.device_id is attached to, when it is (a
    child for any other would never be offered). Names that cannot end a job id
    (<job_id>--<name>: letters, digits and . _ : @ -) are left out."""
    wanted = (spec.get("targets") or {}).get("executor")
    variant = rules.spec_variant(spec)
    return [name for name, capabilities in seen if (not wanted or name == wanted)
            and (not attached or name == attached)
            and rules.offers(capabilities, spec["workload"], variant)
            and validate.is_job_id(f"{spec['job_id']}--{name}")]


# What a fan-out or a preview reads of each device: what the static claim rules read (not the
# last beacon, which none of them reads and may be 16 KiB) and, of the descriptor, only the
# fields the spec's match expression and fanout.distinct read, with platform and model for a
# preview's list. SQLite takes those out as one JSON array (one json_extract of several paths
# keeps each value's type and escapes; see alerts.BEACON_READINGS): parsing 6,000 descriptors of
# 16 KiB in Python held the event loop over a second, and was charged to the match budget.
_TARGET_COLUMNS = ("device_id, pools, pools_override, capabilities, last_seen, ttl_s, "
                   "NULL AS last_beacon, last_beacon_at, busy_job_id, busy_at, mesh_node")
_SHOWN_FIELDS = ("platform", "model")
_OWN_FIELDS = frozenset({"device_id", "pools", "capabilities"})  # view() has them from the row
_PLAIN_FIELD = re.compile(r"[A-Za-z0-9_.-]{1,100}")  # a name a quoted JSON path spells as it is


def targets_query(spec: Mapping[str, Any]) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(SQL, its parameters, the descriptor fields its `descriptor` column holds, in order) for
    the devices a fan-out or a preview of `spec` chooses from, newest seen first. No fields:
    the column is the whole descriptor (a field name no JSON path can spell, from
    fanout.distinct)."""
    targets = spec.get("targets") or {}
    fanout = spec.get("fanout")
    wanted = set(_SHOWN_FIELDS)
    if isinstance(targets, Mapping) and targets.get("match"):
        wanted |= compiled(str(targets["match"])).fields - _OWN_FIELDS
    if isinstance(fanout, Mapping) and fanout.get("distinct"):
        wanted.add(str(fanout["distinct"]))
    fields = tuple(sorted(wanted))
    order = " FROM devices ORDER BY last_seen DESC, device_id"
    if not all(_PLAIN_FIELD.fullmatch(name) for name in fields):
        return f"SELECT {_TARGET_COLUMNS}, descriptor{order}", (), ()
    paths = tuple(f'$."{name}"' for name in fields)
    picked = ("CASE WHEN json_valid(descriptor) AND json_type(descriptor) = 'object' THEN "
              f"json_extract(descriptor, {', '.join('?' * len(paths))}) END AS descriptor")
    return f"SELECT {_TARGET_COLUMNS}, {picked}{order}", paths, fields


def fanout_devices(conn: sqlite3.Connection, spec: JobSpec, now: float, *,
                   any_workload: bool = False) -> list[Device]:
    """The devices a fan-out creates children for, newest-seen first; the preview's too (with
    any_workload, whatever they declare: a preview of targets alone). The rows are taken one
    at a time, not all at once: each may hold 60 KB of capabilities and pools, and 25,000 of
    them read together took 1.4 GB."""
    sql, params, fields = targets_query(spec)
    return select_targets(conn.execute(sql, params), fields, spec, now,
                          any_workload=any_workload,
                          registered=lambda: conn.execute("SELECT count(*) FROM devices")
                          .fetchone()[0])


def select_targets(rows: Iterable[sqlite3.Row], fields: tuple[str, ...], spec: JobSpec,
                   now: float, *, any_workload: bool = False,
                   registered: Callable[[], int]) -> list[Device]:
    """Of device rows of targets_query (newest seen first; `fields` its third part), those a
    fan-out of this spec reaches (with any_workload, whatever they declare: a preview of
    targets alone). `registered` counts the devices, for the sentence of a refusal."""
    workload = None if any_workload else spec["workload"]
    targets = spec.get("targets") or {}
    chosen: list[Device] = []
    budget = verdicts.Budget(verdicts.TARGETS_BUDGET_S)
    variant = rules.spec_variant(spec)
    for row in rows:
        if rules.is_expired(row["ttl_s"], row["last_seen"], now):
            continue
        device = device_with_fields(row, fields) if fields else device_from_row(row)
        if targets.get("device_id") and device.device_id != targets["device_id"]:
            continue
        if static_refusal(device, workload, variant, targets.get("pool"),
                          targets.get("match"), budget) is None:
            chosen.append(device)
        elif budget.spent:
            raise Unprocessable(
                f"targets.match took more than {verdicts.TARGETS_BUDGET_S:g} s to evaluate "
                f"over the {registered()} registered devices, and the collector stops there "
                "rather than hold every other request; narrow the devices first (targets.pool, "
                "or a simpler or anchored pattern, ^...)")
    fanout = spec.get("fanout")
    if isinstance(fanout, dict) and fanout.get("distinct"):
        field = fanout["distinct"]
        by_value: dict[str, Device] = {}
        for device in chosen:  # newest first, so the first seen for a value wins
            value = device.view().get(field)
            if value is None or value == "":
                continue
            by_value.setdefault(json.dumps(value, sort_keys=True), device)
        chosen = list(by_value.values())
    return chosen


@replayable
def hand_back_undelivered(conn: sqlite3.Connection, job_id: str, claimant_id: str, now: float,
                          effects: Effects) -> None:
    """A claim whose long poll went away before delivery is returned, its attempt not burned."""
    row = job_row(conn, job_id)
    if row is None or row["status"] != JobStatus.CLAIMED or row["claimed_by"] != claimant_id:
        return
    _requeue(conn, row, now, effects, outcome=AttemptOutcome.UNDELIVERED, error=None,
             attempt_back=True, keep_error=True)


def _requeue(conn: sqlite3.Connection, row: sqlite3.Row, now: float, effects: Effects, *,
             outcome: str, error: str | None, attempt_back: bool, keep_error: bool = False) -> None:
    attempts = row["attempts"] - 1 if attempt_back else row["attempts"]
    conn.execute(
        "UPDATE jobs SET status = 'queued', claimed_by = NULL, lease_deadline = NULL, "
        "attempts = ?, updated_at = ?" + ("" if keep_error else ", last_error = ?")
        + " WHERE job_id = ?",
        (max(0, attempts), now, row["job_id"]) if keep_error
        else (max(0, attempts), now, error, row["job_id"]))
    _end_attempt(conn, row, outcome, error, now)
    if _may_lock(row):
        unlock(conn, row["job_id"], effects)
    effects.job(row["job_id"], JobStatus.QUEUED, row["workload"], row["executor"])
    effects.claimable.append(route_of(row))
    _slot_freed(row, effects)


def _slot_freed(row: sqlite3.Row, effects: Effects) -> None:
    """A claimed job left its claimant: a poll it holds waiting (an executor with more slots)
    may take another now."""
    if row["status"] == JobStatus.CLAIMED and row["claimed_by"]:
        effects.claimant_changed(row["executor"], row["claimed_by"])


# ---------------------------------------------------------------------------------------------
# leases


def extend_lease(conn: sqlite3.Connection, row: sqlite3.Row, now: float) -> None:
    """Push out the lease of a claimed job (the caller checked who holds it)."""
    conn.execute("UPDATE jobs SET lease_deadline = ?, updated_at = ? WHERE seq = ?",
                 (now + row["ttl_s"], now, row["seq"]))


@dataclass
class Swept:
    requeued: list[str]
    failed: list[str]


def sweep(conn: sqlite3.Connection, now: float, effects: Effects) -> Swept:
    """Requeue or fail every claimed job whose lease has lapsed."""
    swept = Swept([], [])
    lapsed = conn.execute("SELECT * FROM jobs WHERE status = 'claimed' AND lease_deadline < ? "
                          "ORDER BY lease_deadline", (now,)).fetchall()
    for row in lapsed:
        late_s = int(now - row["lease_deadline"])
        where = f"on {row['claimed_by']}"
        if row["attempts"] < row["max_attempts"]:
            error = (f"lease expired {where} ({late_s} s past its deadline) on attempt "
                     f"{row['attempts']} of {row['max_attempts']}; requeued")
            _requeue(conn, row, now, effects, outcome=AttemptOutcome.EXPIRED, error=error,
                     attempt_back=False)
            swept.requeued.append(row["job_id"])
            effects.lease_expiries.append(LeaseExpiry.REQUEUED)
        else:
            error = (f"lease expired {where} on the final attempt ({row['attempts']} of "
                     f"{row['max_attempts']}); the job failed")
            _end_attempt(conn, row, AttemptOutcome.EXPIRED, error, now)
            _close(conn, row, JobStatus.FAILED, error, now, effects)
            swept.failed.append(row["job_id"])
            effects.lease_expiries.append(LeaseExpiry.FAILED)
    return swept


# ---------------------------------------------------------------------------------------------
# closing, promotion, cascades


@dataclass
class Closed:
    """What a final row settled: the job's status, the waiters it queued and the other jobs it
    failed (waiters down the chain, a fan-out parent)."""

    status: str
    promoted: list[str]
    failed: list[str]


def close_from_result(conn: sqlite3.Connection, row: sqlite3.Row, ok: bool, error: str | None,
                      now: float, effects: Effects) -> Closed:
    outcome = JobStatus.DONE if ok else JobStatus.FAILED
    message = None if ok else (error or "the device reported a failure without a reason")
    _end_attempt(conn, row, outcome, message, now)
    effects.no_commit_status(row["job_id"], row["spec"])
    promoted: list[str] = []
    failed = _close(conn, row, outcome, message, now, effects, promoted)
    return Closed(outcome, promoted, failed)


def preempted(conn: sqlite3.Connection, row: sqlite3.Row, artifacts: list[str], now: float,
              effects: Effects) -> None:
    """A final row with preempted: the job goes back to the queue, resumable."""
    spec = json.loads(row["spec"])
    if artifacts:
        spec["params"] = {**(spec.get("params") or {}), "resume_from": artifacts[0]}
        conn.execute("UPDATE jobs SET spec = ? WHERE job_id = ?", (json.dumps(spec), row["job_id"]))
    _requeue(conn, row, now, effects, outcome=AttemptOutcome.PREEMPTED, error=None,
             attempt_back=True, keep_error=True)


def _close(conn: sqlite3.Connection, row: sqlite3.Row, status: str, error: str | None,
           now: float, effects: Effects, promoted: list[str] | None = None) -> list[str]:
    """Close a job and then whatever its closing settles: waiters promoted (their ids added to
    `promoted` when given) or failed, fan-out parents closed. The ids of the other jobs this
    closed (failed or cancelled) come back.

    A work list, not recursion: a chain of 10,000 dependents (clients shape the chains) closes
    in one transaction without 10,000 nested calls."""
    first = row["job_id"]
    closed: list[str] = []
    rewrites: templates.Rewrites | None = None  # the promotions' (see templates.Rewrites)
    work: list[tuple[sqlite3.Row, str, str | None]] = [(row, status, error)]
    while work:
        row, status, error = work.pop()
        _set_status(conn, row["job_id"], status, now, error)
        if _may_lock(row):
            unlock(conn, row["job_id"], effects)
        _slot_freed(row, effects)
        effects.job(row["job_id"], status, row["workload"], row["executor"],
                    **({"last_error": error} if error else {}))
        if row["job_id"] != first and status != JobStatus.DONE:
            closed.append(row["job_id"])
        groups: list[str] = [row["parent_job_id"]] if row["parent_job_id"] else []
        if row["has_dependents"]:  # set when a job naming this one in depends_on is stored
            if status == JobStatus.DONE:
                rewrites = rewrites or _rewrites(conn)
                work.extend(_promote_waiters(conn, row["job_id"], now, effects, promoted,
                                             rewrites))
            else:
                groups += _fail_dependents(conn, row["job_id"], status, error, now, effects,
                                           closed)
        for parent_id in groups:
            settled = _settle_group(conn, parent_id)
            if settled is not None:
                work.append(settled)
    return closed


def _promote_waiters(conn: sqlite3.Connection, job_id: str, now: float, effects: Effects,
                     promoted: list[str] | None = None,
                     rewrites: templates.Rewrites | None = None
                     ) -> list[tuple[sqlite3.Row, str, str | None]]:
    """Queue the waiters of a job just done whose every dependency is done; the waiters whose
    template references cannot be resolved come back, to be failed by the caller. `rewrites`
    are those of the whole close, so that all its promotions share one budget."""
    rewrites = rewrites or _rewrites(conn)
    unresolvable: list[tuple[sqlite3.Row, str, str | None]] = []
    # CROSS JOIN keeps job_deps first: left to itself SQLite walked every waiting job in seq
    # order (for the ORDER BY), which made each step along a long chain cost the chain's length.
    waiters = conn.execute(
        "SELECT j.* FROM job_deps d CROSS JOIN jobs j ON j.job_id = d.job_id "
        "WHERE d.depends_on = ? AND j.status = 'waiting' ORDER BY j.seq", (job_id,)).fetchall()
    for waiter in waiters:
        open_dep = conn.execute(
            "SELECT 1 FROM job_deps d JOIN jobs j ON j.job_id = d.depends_on "
            "WHERE d.job_id = ? AND j.status != 'done' LIMIT 1", (waiter["job_id"],)).fetchone()
        if open_dep:
            continue
        if waiter["is_group"]:
            _set_status(conn, waiter["job_id"], JobStatus.QUEUED, now)
            effects.job(waiter["job_id"], JobStatus.QUEUED, waiter["workload"], waiter["executor"])
            if promoted is not None:
                promoted.append(waiter["job_id"])
            continue
        spec = json.loads(waiter["spec"])
        try:
            spec = _rewritten(rewrites, spec)
        except templates.Unresolvable as exc:
            unresolvable.append((waiter, JobStatus.FAILED, str(exc)))
            continue
        conn.execute("UPDATE jobs SET spec = ?, status = 'queued', updated_at = ? "
                     "WHERE job_id = ?", (json.dumps(spec), now, waiter["job_id"]))
        effects.job(waiter["job_id"], JobStatus.QUEUED, waiter["workload"], waiter["executor"])
        if promoted is not None:
            promoted.append(waiter["job_id"])
        fresh = job_row(conn, waiter["job_id"])
        assert fresh is not None
        effects.claimable.append(route_of(fresh))
    return unresolvable


# Every waiting job that depends on a job, directly or through other waiting jobs, with the
# dependency it waited on (`via`). The walk goes over job ids alone, so each doomed job is
# expanded once and the cost is the graph's edges: walking (job, the dependency it was reached
# through) pairs expanded a job once per dependency it has, and 10,000 jobs each waiting on the
# 100 before it took 80 s (N * K * K). The dependency a job names in its sentence is found
# afterwards, among its own: the root when it waits on it directly, else the first of its
# doomed dependencies by id.
_FAIL_DEPENDENTS = """
WITH RECURSIVE doomed(job_id) AS (
    SELECT d.job_id FROM job_deps d JOIN jobs j ON j.job_id = d.job_id
    WHERE d.depends_on = :root AND j.status = 'waiting'
    UNION
    SELECT d.job_id FROM doomed JOIN job_deps d ON d.depends_on = doomed.job_id
    JOIN jobs j ON j.job_id = d.job_id WHERE j.status = 'waiting'
), named(job_id, via) AS (
    SELECT d.job_id, MIN(CASE WHEN d.depends_on = :root THEN '' ELSE d.depends_on END)
    FROM doomed JOIN job_deps d ON d.job_id = doomed.job_id
    WHERE d.depends_on = :root OR d.depends_on IN (SELECT job_id FROM doomed)
    GROUP BY d.job_id
)
UPDATE jobs SET status = 'failed', updated_at = :now, finished_at = :now, lease_deadline = NULL,
    last_error = CASE WHEN named.via = '' THEN :error
                      ELSE 'dependency ''' || named.via || ''' failed: ' || :error END
FROM named WHERE jobs.job_id = named.job_id
RETURNING seq, jobs.job_id AS job_id, workload, executor, parent_job_id, last_error
"""


def _fail_dependents(conn: sqlite3.Connection, root: str, status: str, error: str | None,
                     now: float, effects: Effects, closed: list[str]) -> list[str]:
    """Fail every job waiting on `root`, however long the chain, in one statement, and add
    their ids to `closed`. Each gets one short sentence: a direct dependent names the root and
    its reason; one further along names the dependency it waited on, then the root and its
    reason, so the text stays two names long however long the chain. The fan-out parents to
    settle come back.

    Only the first CASCADE_EVENTS of them get a job event on the live stream, then one
    `cascade` event counts them all: 10,000 events in one burst to each of hundreds of stream
    clients held the event loop for over a second. The listeners still get every job."""
    reason = _dependency_error(root, status, error)
    rows = conn.execute(_FAIL_DEPENDENTS, {"root": root, "now": now, "error": reason}).fetchall()
    rows.sort(key=lambda r: r["seq"])  # RETURNING comes in no promised order
    for r in rows[:CASCADE_EVENTS]:
        effects.job(r["job_id"], JobStatus.FAILED, r["workload"], r["executor"],
                    last_error=r["last_error"])
    if len(rows) > CASCADE_EVENTS:
        effects.unstreamed.extend(
            {"type": "job", "job_id": r["job_id"], "status": JobStatus.FAILED,
             "workload": r["workload"], "executor": r["executor"],
             "last_error": r["last_error"]} for r in rows[CASCADE_EVENTS:])
        effects.emit("cascade", job_id=root, failed=len(rows), streamed=CASCADE_EVENTS,
                     last_error=reason)
    doomed = {r["job_id"] for r in rows}
    closed.extend(r["job_id"] for r in rows)
    return list(dict.fromkeys(r["parent_job_id"] for r in rows
                              if r["parent_job_id"] and r["parent_job_id"] not in doomed))


def _stream_few(effects: Effects, start: int, parent_id: str, status: str) -> None:
    """Of the job events a fan-out's children got since effects.events[start] (stored, or
    cancelled with their parent), only the first CASCADE_EVENTS stay on the live stream, and one
    `fanout` event counts them all; the listeners still get every one, and the parent's own
    event (its group closing as the last child does) stays on the stream. As for a cascade
    (_fail_dependents): 9,999 children's events to 200 stream clients held the event loop for
    a second beyond the transaction's own time."""
    added = effects.events[start:]
    jobs = [event for event in added if event["type"] == "job" and event["job_id"] != parent_id]
    if len(jobs) <= CASCADE_EVENTS:
        return
    held_back = {id(event) for event in jobs[CASCADE_EVENTS:]}
    effects.events[start:] = [event for event in added if id(event) not in held_back]
    effects.unstreamed.extend(jobs[CASCADE_EVENTS:])
    effects.emit("fanout", job_id=parent_id, status=status, jobs=len(jobs),
                 streamed=CASCADE_EVENTS)


def _settle_group(conn: sqlite3.Connection, parent_id: str
                  ) -> tuple[sqlite3.Row, str, str | None] | None:
    """How a fan-out parent closes once every child is closed (done, failed or cancelled);
    None while a child is open or the parent is already closed."""
    if conn.execute("SELECT 1 FROM jobs WHERE parent_job_id = ? AND status IN "
                    "('queued', 'waiting', 'claimed') LIMIT 1", (parent_id,)).fetchone():
        return None  # the usual answer, found without reading every child
    parent = job_row(conn, parent_id)
    if parent is None or parent["status"] in FINAL:
        return None
    children = conn.execute("SELECT job_id, status, last_error FROM jobs "
                            "WHERE parent_job_id = ? ORDER BY seq", (parent_id,)).fetchall()
    failed = [c for c in children if c["status"] == JobStatus.FAILED]
    cancelled = [c for c in children if c["status"] == JobStatus.CANCELLED]
    if failed:
        detail = "; ".join(f"{c['job_id']}: {c['last_error']}" for c in failed[:5])
        return (parent, JobStatus.FAILED,
                f"{len(failed)} of {len(children)} fan-out children failed ({detail})"[:2000])
    if cancelled:
        return (parent, JobStatus.CANCELLED,
                f"{len(cancelled)} of {len(children)} fan-out children were cancelled")
    return parent, JobStatus.DONE, None


def _rewritten(rewrites: templates.Rewrites, spec: JobSpec) -> JobSpec:
    """The spec with its template references resolved, checked again as POST /jobs checks a
    spec: a reference may stand where text is kept (a workload, a pool, a match expression) and
    resolve to an object, a number or text that does not compile, and the job would be stored
    and handed out as no job could be sent (Unresolvable: the job fails, saying why)."""
    if not templates.references(spec):
        return spec
    rewritten = cast(JobSpec, rewrites.rewrite(spec))
    try:
        return check_spec(rewritten)
    except BadRequest as exc:
        raise templates.Unresolvable(
            f"with its template references resolved, the spec is not one a job may have: "
            f"{exc.message}") from None


def _rewrites(conn: sqlite3.Connection) -> templates.Rewrites:
    """The template rewrites of one promotion or one request: each dependency's rows are read
    once, and each row's metrics parsed once, however many references and waiters name them
    (a query and a parse per reference made 1,500 references to one metric 1,500 reads of a
    600 kB row).

    A reference's value comes from the rows of the claim that closed the job: its final row
    first, then its summary, then the newest. Rows of lapsed attempts, and hand-back rows (their
    artifact is saved progress), never count. Nor do the rows of an earlier claim under the
    same attempt number (a release, a preemption or an undelivered poll hands the number out
    again): a final row its holder posted after handing the job back, while it waited, outranked
    the closing claim's own and chose the input of every job downstream. The closing claim's
    rows are those stored between its start and the close (as the claimant's row replaces one
    stored before its claim began, _CLAIMANT_ROW), and for a device job those of its device."""
    rows_of: dict[str, list[dict[str, Any]]] = {}

    def lookup(job_id: str, kind: str, key: str | None) -> Any:
        rows = rows_of.get(job_id)
        if rows is None:
            rows = rows_of[job_id] = [dict(row) for row in conn.execute(
                _CLOSING_CLAIMS_ROWS, (job_id,))]
        for row in rows:
            if kind == "artifact":
                artifacts = json.loads(row["artifacts"]) or _test_artifacts(row["extra"])
                if artifacts:
                    return artifacts[0]
            else:
                if isinstance(row["metrics"], str):
                    row["metrics"] = json.loads(row["metrics"])
                metrics = row["metrics"]
                if key in metrics and metrics[key] is not None:
                    return metrics[key]
        return None

    return templates.Rewrites(lookup)


_CLOSING_CLAIMS_ROWS = """
SELECT r.metrics, r.artifacts, r.extra FROM jobs j JOIN results r ON r.job_id = j.job_id
WHERE j.job_id = ? AND r.preempted = 0 AND r.attempt = j.attempts
  AND (j.claimed_at IS NULL OR r.created_at >= j.claimed_at)
  AND (j.finished_at IS NULL OR r.created_at <= j.finished_at)
  AND (j.executor != 'device' OR r.device_id = j.claimed_by)
ORDER BY r.final DESC, r.iter = 0 DESC, r.id DESC
"""


def _test_artifacts(extra: str | None) -> list[str]:
    """The hashes a row lists under test.artifacts, as the original's host executors post them
    ({"test": {"artifacts": [...]}}: a sha256, or an object with one), when its artifacts
    field is empty."""
    if not extra or '"test"' not in extra:
        return []
    test = json.loads(extra).get("test")
    entries = test.get("artifacts") if isinstance(test, dict) else None
    if not isinstance(entries, list):
        return []
    hashes = [entry.get("sha256") if isinstance(entry, dict) else entry for entry in entries]
    return [sha for sha in hashes if isinstance(sha, str) and _SHA256.fullmatch(sha)]


_SHA256 = re.compile(r"[0-9a-f]{64}")


# ---------------------------------------------------------------------------------------------
# operator and agent actions


def release(conn: sqlite3.Connection, job_id: str, device_id: str, now: float,
            effects: Effects, caller: str | None = None) -> dict[str, Any]:
    """Hand a claimed job back. `device_id` is the claimant: a device's id, or for a host job
    the executor's name; `caller` is the mesh node the request came from (None off the mesh)."""
    row = job_row(conn, job_id)
    if row is None:
        raise NotFound(f"no job {job_id!r}")
    if caller is not None:
        node = None
        if row["executor"] == Executor.DEVICE:
            found = conn.execute("SELECT mesh_node FROM devices WHERE device_id = ?",
                                 (device_id,)).fetchone()
            node = found["mesh_node"] if found else None
        authority.check_speaker(conn, row["executor"], device_id, node, caller, now)
    if row["status"] != JobStatus.CLAIMED or row["claimed_by"] != device_id:
        raise Conflict(f"{device_id} does not hold a claim on job {job_id} "
                       f"(it is {row['status']}"
                       + (f", claimed by {row['claimed_by']})" if row["claimed_by"] else ")"))
    # Rows of this attempt only: a late row of an earlier, lapsed attempt never blocks it.
    if conn.execute("SELECT 1 FROM results WHERE job_id = ? AND attempt = ? LIMIT 1",
                    (job_id, row["attempts"])).fetchone():
        raise Conflict(f"job {job_id} already has result rows, so it cannot be released; "
                       "post a final row instead")
    _requeue(conn, row, now, effects, outcome=AttemptOutcome.RELEASED, error=None,
             attempt_back=True, keep_error=True)
    return {"ok": True, "job_id": job_id, "status": JobStatus.QUEUED}


CANCELLED_BY_OPERATOR = "cancelled by an operator"  # the error of a job an operator cancelled


def cancel(conn: sqlite3.Connection, job_id: str, now: float, effects: Effects, *,
           reason: str | None = None) -> dict[str, Any]:
    """Cancel an open job (a fan-out parent with its open children); its last_error is the
    operator's reason when one was given."""
    why = reason or CANCELLED_BY_OPERATOR
    row = job_row(conn, job_id)
    if row is None:
        raise NotFound(f"no job {job_id!r}")
    if row["status"] in FINAL:
        raise Conflict(f"job {job_id} is already {row['status']}")
    was = row["status"]
    cascaded: list[str] = []
    # The device locks its closing releases: its own, or a fan-out's children's.
    locks = conn.execute("SELECT COUNT(*) FROM device_locks WHERE job_id = ? OR job_id IN "
                         "(SELECT job_id FROM jobs WHERE parent_job_id = ?)",
                         (job_id, job_id)).fetchone()[0]
    if row["is_group"]:
        streamed_from = len(effects.events)
        cascaded += _cancel_idle_children(conn, job_id, why, now, effects)
        for child in conn.execute("SELECT * FROM jobs WHERE parent_job_id = ? AND status IN "
                                  "('queued', 'waiting', 'claimed')", (job_id,)).fetchall():
            _end_attempt(conn, child, AttemptOutcome.CANCELLED, why, now)
            cascaded.append(child["job_id"])
            cascaded += _close(conn, child, JobStatus.CANCELLED, why, now,
                               effects)
        settled = _settle_group(conn, job_id)  # when no child closed one by one settled it
        if settled is not None:
            cascaded += _close(conn, *settled, now, effects)
        _stream_few(effects, streamed_from, job_id, JobStatus.CANCELLED)
        row = job_row(conn, job_id)
        assert row is not None
    if row["status"] not in FINAL:
        _end_attempt(conn, row, AttemptOutcome.CANCELLED, why, now)
        cascaded += _close(conn, row, JobStatus.CANCELLED, why, now, effects)
    cascaded = [j for j in dict.fromkeys(cascaded) if j != job_id]
    return {"ok": True, "job_id": job_id, "was": was, "cascaded": cascaded,
            "locks_released": int(locks)}


# A fan-out's children that closing asks nothing more of: not claimed (no attempt, lease or
# claimant's slot to end), holding no device locks (neither exclusive nor a host job's), and
# with no job waiting on them. Cancelled in one statement, not one by one.
_CANCEL_IDLE_CHILDREN = """
UPDATE jobs SET status = 'cancelled', updated_at = :now, finished_at = :now, last_error = :why,
                lease_deadline = NULL
WHERE parent_job_id = :parent AND status IN ('queued', 'waiting') AND has_dependents = 0
  AND exclusive = 0 AND executor != 'host'
RETURNING seq, job_id, workload, executor
"""


def _cancel_idle_children(conn: sqlite3.Connection, parent_id: str, why: str, now: float,
                          effects: Effects) -> list[str]:
    """Cancel a fan-out's idle children (see _CANCEL_IDLE_CHILDREN) at once: closed one by one,
    9,999 children held the event loop about half a second in their transaction. Their ids."""
    rows = conn.execute(_CANCEL_IDLE_CHILDREN,
                        {"parent": parent_id, "now": now, "why": why}).fetchall()
    rows.sort(key=lambda r: r["seq"])  # RETURNING comes in no promised order
    for r in rows:
        effects.job(r["job_id"], JobStatus.CANCELLED, r["workload"], r["executor"],
                    last_error=why)
    return [r["job_id"] for r in rows]


def retry(conn: sqlite3.Connection, job_id: str, now: float, effects: Effects) -> dict[str, Any]:
    row = job_row(conn, job_id)
    if row is None:
        raise NotFound(f"no job {job_id!r}")
    if row["status"] not in UNSUCCESSFUL:
        raise Conflict(f"job {job_id} is {row['status']}; only failed or cancelled jobs can be "
                       "retried")
    base = row["job_id"]
    stem, sep, number = base.rpartition("-r")
    if sep and number.isdigit():
        base = stem
    taken = {r[0] for r in conn.execute("SELECT job_id FROM jobs WHERE job_id LIKE ? ESCAPE '\\'",
                                        (like_escape(base) + "-r%",))}
    suffix = 2
    while f"{base}-r{suffix}" in taken:
        suffix += 1
    clone = f"{base}-r{suffix}"
    if not validate.is_job_id(clone):  # only its length can fail: the id itself passed it
        raise Conflict(f"job {job_id} cannot be retried: its clone's id {clone[:40]}... would "
                       f"be {len(clone)} characters, more than the {JOB_ID_CHARS} a job id may "
                       "have; enqueue a copy of its spec under a shorter job_id instead")
    spec = json.loads(row["spec"])
    refuse_lone_surrogates(spec, f"job {job_id}'s stored spec")
    spec["job_id"] = clone
    params = spec.get("params")
    if isinstance(params, dict):
        params.pop("resume_from", None)
    if row["is_group"]:
        spec.setdefault("fanout", True)
    try:
        # A stored spec is a new job's again: one whose references were resolved to what no
        # spec may hold (stored before that was checked), or that a later rule refuses, is
        # refused here rather than stored (a dict where a pool is kept made this a 500).
        spec = check_spec(spec)
    except BadRequest as exc:
        raise Conflict(f"job {job_id} cannot be retried: its stored spec does not pass the "
                       f"checks a new job's does ({exc.message}); enqueue a corrected copy "
                       "instead") from None
    reply = _store(conn, spec, now, effects, _Tally(conn, 1), template_id=row["template_id"],
                   parent=None)
    return {"ok": True, "job_id": spec["job_id"], "retry_of": job_id, "status": reply["status"],
            **({"fanout": reply["fanout"]} if "fanout" in reply else {})}


def refuse_lone_surrogates(spec: Mapping[str, Any], whose: str,
                           remedy: str = "enqueue a corrected copy instead") -> None:
    """Refuse (409) to store again a spec read back from the database that holds a lone
    surrogate: an older collector stored such bodies, and their text cannot go into SQLite's
    UTF-8 columns. Only specs from the database need this; bodies are checked as they arrive."""
    problem = jsonio.lone_surrogate(spec)
    if problem:
        raise Conflict(f"{whose} holds text that is not Unicode ({problem}); {remedy}")


PRIORITY_RANGE = (-1000, 1000)  # schemas/job.json's bounds


def check_priority_change(body: dict[str, Any]) -> int:
    """PATCH /api/jobs/{id}'s body: the new priority, an integer from -1000 to 1000; 1e2 is
    taken as 100, as a spec's priority is when the job is queued."""
    if set(body) != {"priority"}:
        raise BadRequest("only priority can be changed: send {\"priority\": <integer>}")
    priority = validate.integer_within(body["priority"], *PRIORITY_RANGE)
    if priority is None:
        raise BadRequest("priority must be an integer from -1000 to 1000")
    return priority


def set_priority(conn: sqlite3.Connection, job_id: str, priority: int, now: float,
                 effects: Effects) -> sqlite3.Row:
    row = job_row(conn, job_id)
    if row is None:
        raise NotFound(f"no job {job_id!r}")
    if row["status"] in FINAL:
        raise Conflict(f"job {job_id} is already {row['status']}; its priority no longer matters")
    spec = json.loads(row["spec"])
    spec["priority"] = priority
    conn.execute("UPDATE jobs SET priority = ?, spec = ?, updated_at = ? WHERE job_id = ?",
                 (priority, json.dumps(spec), now, job_id))
    effects.job(job_id, row["status"], row["workload"], row["executor"], priority=priority)
    fresh = job_row(conn, job_id)
    assert fresh is not None
    if fresh["status"] == JobStatus.QUEUED:
        effects.claimable.append(route_of(fresh))
    return fresh

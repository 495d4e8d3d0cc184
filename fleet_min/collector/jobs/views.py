"""Read-side queries behind the /api listings: jobs, devices, results, beacons, overview.

Every filter is a bound parameter; pages are 50 rows. Times in and out are ISO-8601 UTC.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import sqlite3
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fleet_min import jsonio
from fleet_min.collector.jobs import authority, executors, locks, queue, rules
from fleet_min.collector.jobs.devices import device_record
from fleet_min.collector.jobs.kinds import JOB_STATUSES, DeviceStatus, Executor
from fleet_min.collector.jobs.results import result_record
from fleet_min.collector.jobs.specs import JobSpec
from fleet_min.db import Database, like_escape
from fleet_min.errors import BadRequest, NotFound
from fleet_min.query import int_param, page_param, time_param, time_range
from fleet_min.timeutil import iso

PER_PAGE = 50


def _paged(total: int, page: int, key: str, items: list[Any]) -> dict[str, Any]:
    return {"page": page, "per_page": PER_PAGE, "total": total,
            "pages": max(1, -(-total // PER_PAGE)), key: items}


def _job_filters(query: Mapping[str, str]) -> tuple[list[str], list[Any]]:
    """The WHERE terms of GET /api/jobs other than status (the facets count under these)."""
    where: list[str] = ["1 = 1"]
    params: list[Any] = []
    for name, column in (("workload", "workload"), ("executor", "executor"), ("pool", "pool")):
        if query.get(name):
            where.append(f"{column} = ?")
            params.append(query[name])
    if query.get("device"):
        where.append("(claimed_by = ? OR target_device = ?)")
        params += [query["device"], query["device"]]
    if query.get("q"):
        where.append("(job_id LIKE ? ESCAPE '\\' OR last_error LIKE ? ESCAPE '\\')")
        pattern = "%" + like_escape(query["q"]) + "%"
        params += [pattern, pattern]
    time_range(query, "created_at", where, params)
    return where, params


def _status_filter(query: Mapping[str, str]) -> tuple[str | None, list[str]]:
    status = query.get("status")
    if not status:
        return None, []
    wanted = [s for s in status.split(",") if s]
    bad = [s for s in wanted if s not in JOB_STATUSES]
    if bad:
        raise BadRequest(f"status {bad[0]!r} is not one of {', '.join(JOB_STATUSES)}")
    return f"status IN ({','.join('?' * len(wanted))})", wanted


async def _facets(db: Database, clause: str, params: list[Any]) -> dict[str, Any]:
    """What the filter controls offer: the count of each status under the other filters, and
    every workload and pool any job has named (a short list: open sets, but few in practice)."""
    counts = dict.fromkeys(JOB_STATUSES, 0)
    for row in await db.read(f"SELECT status, COUNT(*) AS n FROM jobs WHERE {clause} "
                             "GROUP BY status", params):
        counts[row["status"]] = row["n"]
    workloads = await db.read("SELECT DISTINCT workload FROM jobs ORDER BY workload LIMIT 500")
    pools = await db.read("SELECT DISTINCT pool FROM jobs WHERE pool IS NOT NULL "
                          "ORDER BY pool LIMIT 500")
    return {"status_counts": counts, "workloads": [r[0] for r in workloads],
            "pools": [r[0] for r in pools]}


async def list_jobs(db: Database, query: Mapping[str, str]) -> dict[str, Any]:
    where, params = _job_filters(query)
    status_clause, statuses = _status_filter(query)
    page = page_param(query)
    facets = await _facets(db, " AND ".join(where), params)
    if status_clause:
        where, params = [*where, status_clause], [*params, *statuses]
    clause = " AND ".join(where)
    total_row = await db.read_one(f"SELECT COUNT(*) FROM jobs WHERE {clause}", params)
    rows = await db.read(f"SELECT {_LISTED_JOB} FROM jobs WHERE {clause} ORDER BY seq DESC "
                         "LIMIT ? OFFSET ?", [*params, PER_PAGE, (page - 1) * PER_PAGE])
    total = total_row[0] if total_row else 0
    return {"jobs": [_listed_trimmed(r) for r in rows], "page": page, "per_page": PER_PAGE,
            "total": total, "pages": max(1, -(-total // PER_PAGE)), **facets}


def _listed(row: Any) -> dict[str, Any]:
    """A job as the /api listings show it: the record plus `pool` (targets.pool, what the
    pool filter matches), so a filtered list shows why each row is in it."""
    return {**queue.job_record(row), "pool": row["pool"]}


def _listed_trimmed(row: Any) -> dict[str, Any]:
    """_listed for a row read with _LISTED_JOB: its spec may be cut down (SPEC_TRIM)."""
    return {**_listed(row), "trimmed": _trimmed_names(row, "spec")}


async def get_job(db: Database, job_id: str) -> dict[str, Any]:
    row = await db.read_one("SELECT * FROM jobs WHERE job_id = ?", (job_id,))
    if row is None:
        raise NotFound(f"no job {job_id!r}")
    return _listed(row)


# Result rows the record of one job carries: its final rows, and its newest other rows up to
# this many, each cut down as a listing's are (RESULT_TRIM). A job may hold a million rows of
# nearly a megabyte each (iter to 1,000,000, a body to 1 MiB): read whole, 200 of them made
# GET /api/jobs/{id} take 3 GB and hold the loop 8 s. All of them page through
# GET /api/results?job=<id>.
DETAIL_ROWS = 1000


async def _detail_rows(db: Database, job_id: str) -> tuple[list[Any], int]:
    """The job's rows the detail shows, ordered by attempt, device and iteration, and how many
    it has in all."""
    finals = await db.read(f"SELECT {_LISTED_RESULT} FROM results WHERE job_id = ? AND final = 1 "
                           "ORDER BY attempt DESC, id DESC LIMIT ?", (job_id, DETAIL_ROWS))
    others = await db.read(f"SELECT {_LISTED_RESULT} FROM results WHERE job_id = ? AND final = 0 "
                           "ORDER BY attempt DESC, id DESC LIMIT ?", (job_id, DETAIL_ROWS))
    shown = [*finals, *others]
    total = len(shown)
    if len(finals) == DETAIL_ROWS or len(others) == DETAIL_ROWS:
        counted = await db.read_one("SELECT COUNT(*) FROM results WHERE job_id = ?", (job_id,))
        total = int(counted[0]) if counted else total
    return sorted(shown, key=lambda r: (r["attempt"] or 0, r["device_id"], r["iter"])), total


async def job_detail(db: Database, job_id: str) -> dict[str, Any]:
    record = await get_job(db, job_id)
    results, results_total = await _detail_rows(db, job_id)
    children = await db.read("SELECT job_id, status, claimed_by, last_error, target_device "
                             "FROM jobs WHERE parent_job_id = ? ORDER BY seq", (job_id,))
    attempts = await db.read("SELECT * FROM job_attempts WHERE job_seq = "
                             "(SELECT seq FROM jobs WHERE job_id = ?) ORDER BY attempt, id",
                             (job_id,))
    deps = await db.read("SELECT d.depends_on AS job_id, j.status FROM job_deps d "
                         "LEFT JOIN jobs j ON j.job_id = d.depends_on WHERE d.job_id = ?",
                         (job_id,))
    listed = {dep: n for n, dep in enumerate((record["spec"] or {}).get("depends_on") or [])}
    deps = sorted(deps, key=lambda d: listed.get(d["job_id"], len(listed)))
    dependents = await db.read("SELECT d.job_id, j.status FROM job_deps d "
                               "JOIN jobs j ON j.job_id = d.job_id WHERE d.depends_on = ?",
                               (job_id,))
    rows = [{**_listed_result(r), "payload": result_payload(r)} for r in results]
    tried = [{"attempt": a["attempt"], "claimed_by": a["claimed_by"],
              "claimed_at": iso(a["claimed_at"]), "ended_at": iso(a["ended_at"]),
              "outcome": a["outcome"], "error": a["error"]} for a in attempts]
    record.update({
        "parent": record["parent_job_id"],
        "results": rows,
        "results_total": results_total,
        "artifacts": await _job_artifacts(db, record["spec"], rows),
        "children": [dict(c) for c in children],
        "attempts": tried,
        # The ids as the spec lists them (the spec's own shape, and the original's), and each
        # with its status beside them.
        "depends_on": [d["job_id"] for d in deps],
        "dependencies": [dict(d) for d in deps],
        "dependents": [dict(d) for d in dependents],
        "derived_timeline": derived_timeline(record, tried, rows),
    })
    return record


_HASH_IN_TEXT = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")


async def _job_artifacts(db: Database, spec: dict[str, Any], rows: list[dict[str, Any]]
                         ) -> list[dict[str, Any]]:
    """Each artifact the job touches with its role: `input` when its spec names the hash (a
    model, an app build, params.input_sha256, resume_from), `output` when a result row lists it
    (in `artifacts`, or in a field such as test.artifacts); `in_store` says whether the bytes
    are here, with the stored name and size."""
    roles: dict[str, str] = {sha: "input" for sha in
                             _HASH_IN_TEXT.findall(json.dumps(spec).lower())}
    for row in rows:
        payload = row["payload"]
        named = list(row["artifacts"]) + _HASH_IN_TEXT.findall(
            json.dumps({k: v for k, v in payload.items() if k not in ("artifacts", "metrics")}))
        for sha in named:
            roles.setdefault(sha, "output")
    if not roles:
        return []
    shas = sorted(roles)[:500]
    stored = {r["sha256"]: r for r in await db.read(
        f"SELECT sha256, name, size FROM artifacts WHERE sha256 IN ({','.join('?' * len(shas))})",
        shas)}
    return [{"sha256": sha, "role": roles[sha], "in_store": sha in stored,
             "name": stored[sha]["name"] if sha in stored else None,
             "size": stored[sha]["size"] if sha in stored else None,
             "url": f"/artifacts/{sha}"}
            for sha in sorted(shas, key=lambda h: (roles[h] != "input", h))]


def derived_timeline(job: dict[str, Any], attempts: list[dict[str, Any]],
                     rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The job's life as events in time order, derived from its row, its attempts and its
    results (nothing stored for it): created, each claim and how it ended, the first result
    row, the final row, and the close."""
    events = [{"at": job["created_at"], "event": "created", "detail": job["workload"]}]
    for attempt in attempts:
        events.append({"at": attempt["claimed_at"], "event": "claimed",
                       "detail": f"attempt {attempt['attempt']} by {attempt['claimed_by']}"})
        if attempt["ended_at"] and attempt["outcome"]:
            events.append({"at": attempt["ended_at"], "event": f"attempt {attempt['outcome']}",
                           "detail": attempt["error"]})
    if rows:
        first = min(rows, key=lambda r: r["created_at"] or "")
        events.append({"at": first["created_at"], "event": "first result",
                       "detail": f"{first['device_id']} iteration {first['iter']}"})
    for row in rows:
        if row["final"]:
            verdict = "ok" if row["ok"] else (row["error"] or "not ok")
            events.append({"at": row["created_at"], "event": "final result",
                           "detail": f"{row['device_id']}: {verdict}"})
    if job["finished_at"]:
        events.append({"at": job["finished_at"], "event": job["status"],
                       "detail": job["last_error"]})
    # ISO-8601 UTC strings of one format sort as times; a stable sort keeps causes first.
    return sorted((e for e in events if e["at"]), key=lambda e: e["at"])


def result_payload(row: Any) -> dict[str, Any]:
    """A stored row as its agent posted it (the original's clients read `payload`), rebuilt
    from the stored columns and the extra fields rather than stored twice: fields left at their
    defaults may come back spelled out (final false, empty metrics), a row posted without iter
    comes back as iteration 0."""
    payload: dict[str, Any] = {
        "schema": 1, "kind": "result", "job_id": row["job_id"], "device_id": row["device_id"],
        "iter": row["iter"], "final": bool(row["final"]), "metrics": json.loads(row["metrics"]),
        "artifacts": json.loads(row["artifacts"])}
    if row["ok"] is not None:
        payload["ok"] = bool(row["ok"])
    if row["preempted"]:
        payload["preempted"] = True
    if row["error"] is not None:
        payload["error"] = row["error"]
    if row["device"]:
        payload["device"] = json.loads(row["device"])
    if row["extra"]:
        payload.update(json.loads(row["extra"]))
    return payload


async def get_result(db: Database, result_id: str) -> dict[str, Any]:
    """One result row whole (listings and the job's detail cut bulky fields down)."""
    row = await db.read_one("SELECT * FROM results WHERE id = ?", (int(result_id),))
    if row is None:
        raise NotFound(f"no result row {result_id}")
    return {**result_record(row), "payload": result_payload(row)}


async def list_results(db: Database, query: Mapping[str, str]) -> dict[str, Any]:
    where: list[str] = ["1 = 1"]
    params: list[Any] = []
    for name, column in (("job", "job_id"), ("device", "device_id"), ("workload", "workload")):
        if query.get(name):
            where.append(f"{column} = ?")
            params.append(query[name])
    time_range(query, "created_at", where, params)
    page = page_param(query)
    clause = " AND ".join(where)
    total_row = await db.read_one(f"SELECT COUNT(*) FROM results WHERE {clause}", params)
    rows = await db.read(f"SELECT {_LISTED_RESULT} FROM results WHERE {clause} "
                         "ORDER BY created_at DESC, id DESC LIMIT ? OFFSET ?",
                         [*params, PER_PAGE, (page - 1) * PER_PAGE])
    total = total_row[0] if total_row else 0
    return _paged(total, page, "results", [_listed_result(r) for r in rows])


def _listed_result(row: Any) -> dict[str, Any]:
    """A result row read with _LISTED_RESULT: its bulky JSON may be cut down (RESULT_TRIM)."""
    return {**result_record(row), "trimmed": _trimmed_names(row, *_RESULT_TRIMMED)}


# Listings carry a stored JSON object (a device's descriptor and last beacon, a job's spec)
# whole up to `whole` characters; a larger one is cut down by SQLite, before it reaches Python,
# to its first `keys` fields that are plain (numbers, booleans, null), or text (and with
# `nested`, objects and arrays as JSON) no longer than `field` characters, and the record names
# it in `trimmed`. The record of the one device or job has it whole. Without this, 25,000
# devices of 16 KiB made a device listing of 800 MB, 50 jobs of 1 MiB made every page of jobs
# 50 MB, and a page of result rows near the body limit as much; the dashboard reloads them on
# every change.
@dataclass(frozen=True)
class Trim:
    whole: int
    field: int
    keys: int
    nested: bool


# An agent's descriptor and beacon are a few hundred characters; a listing shows their model,
# os, battery and thermal fields.
DEVICE_TRIM = Trim(whole=2048, field=200, keys=32, nested=False)
# A spec's targets, lease and constraints are short; params can be large (a prompt, a flow).
SPEC_TRIM = Trim(whole=8192, field=1024, keys=64, nested=True)


def _trimmed_json(column: str, trim: Trim) -> str:
    """SQL for `column` (a JSON object) as a listing carries it, and `<column>_trimmed`."""
    sized = "'text', 'object', 'array'" if trim.nested else "'text'"
    value = ("CASE type WHEN 'true' THEN json('true') WHEN 'false' THEN json('false') "
             "WHEN 'object' THEN json(value) WHEN 'array' THEN json(value) ELSE value END")
    return (f"CASE WHEN {column} IS NULL OR length({column}) <= {trim.whole} THEN {column} "
            f"ELSE (SELECT json_group_object(key, {value}) FROM (SELECT key, type, value FROM "
            f"json_each({column}) WHERE type IN ('integer', 'real', 'true', 'false', 'null') "
            f"OR (type IN ({sized}) AND length(value) <= {trim.field}) LIMIT {trim.keys})) END "
            f"AS {column}, length({column}) > {trim.whole} AS {column}_trimmed")


def _trimmed_list(column: str, trim: Trim) -> str:
    """SQL for `column` (a JSON array of names) as a listing carries it: whole up to
    `trim.whole` characters, else its first `trim.keys` names of at most `trim.field`
    characters; and `<column>_trimmed`."""
    return (f"CASE WHEN {column} IS NULL OR length({column}) <= {trim.whole} THEN {column} "
            f"ELSE (SELECT json_group_array(value) FROM (SELECT value FROM json_each({column}) "
            f"WHERE type = 'text' AND length(value) <= {trim.field} LIMIT {trim.keys})) END "
            f"AS {column}, length({column}) > {trim.whole} AS {column}_trimmed")


def _trimmed_names(row: Any, *columns: str) -> list[str]:
    return [column for column in columns if row[f"{column}_trimmed"]]


# The columns queue.job_record and _listed read, the spec cut down for a listing.
_LISTED_JOB = ("job_id, workload, executor, backend, status, priority, claimed_by, attempts, "
               "max_attempts, ttl_s, lease_deadline, last_error, parent_job_id, template_id, "
               "is_group, created_at, updated_at, claimed_at, finished_at, warnings, pin, pool, "
               f"{_trimmed_json('spec', SPEC_TRIM)}")

# A result row's metrics are a few numbers and its device three names, but metrics, device and
# the fields an agent adds (kept in `extra`) may fill the body limit; its error (at most 4,000
# characters) and artifacts (at most 100 digests) are bounded by validation. The row as posted
# is in the job's own record.
RESULT_TRIM = Trim(whole=8192, field=1024, keys=64, nested=True)
_RESULT_TRIMMED = ("metrics", "device", "extra")
# The columns results.result_record reads, the bulky ones cut down for a listing.
_LISTED_RESULT = (
    "id, job_id, device_id, iter, attempt, workload, ok, final, preempted, error, artifacts, "
    f"created_at, {_trimmed_json('metrics', RESULT_TRIM)}, "
    f"{_trimmed_json('device', DEVICE_TRIM)}, {_trimmed_json('extra', RESULT_TRIM)}")

# A shelf device declares a few pools and a few dozen capabilities, but validation lets each
# list hold 256 names of 200 characters: 25,000 such devices made a device listing of 2 GB
# (5.8 GB of the collector's memory, the loop held 17 s). A listing carries each list whole up
# to 1,024 characters of JSON, else its first 32 short names; the device's own record has all.
NAMES_TRIM = Trim(whole=1024, field=64, keys=32, nested=False)
_LISTED_DEVICE_LISTS = ("pools", "pools_override", "capabilities")
_LISTED_DEVICE = (
    "SELECT device_id, name, notes, platform, kind, ttl_s, "
    "first_seen, last_seen, last_beacon_at, busy_job_id, busy_collector, busy_at, address, "
    f"mesh_node, {_trimmed_json('descriptor', DEVICE_TRIM)}, "
    f"{_trimmed_json('last_beacon', DEVICE_TRIM)}, "
    + ", ".join(_trimmed_list(column, NAMES_TRIM) for column in _LISTED_DEVICE_LISTS)
    + " FROM devices {where} ORDER BY last_seen DESC, device_id")


# A listing is built on a connection and a thread of its own (Database.read_in_thread), so the
# shared reader and the loop stay free while it is; at most this many are built at once, so a
# client asking again and again queues behind itself instead of filling the worker threads and
# memory (a listing of 25,000 devices at the registry's limits is 136 MB of JSON).
DEVICE_LISTINGS_AT_ONCE = 2
MAX_DEVICES_LIMIT = 1_000_000  # ?limit= past any registry; FLEET_MAX_DEVICES bounds the answer
# Pages of the registry (a ?limit= of this or less: the dashboard's screens and pages) queue for
# slots of their own: behind a dozen clients asking for all of 25,000 devices (25 MB each), the
# dashboard's page of 100 waited 30 s, and a client asking again and again held it for good.
DEVICE_PAGE_LIMIT = 2000


def _listing_slots(db: Database, asked: DeviceQuery) -> asyncio.Semaphore:
    small = asked.limit is not None and asked.limit <= DEVICE_PAGE_LIMIT
    return db.slots("device pages" if small else "device listings", DEVICE_LISTINGS_AT_ONCE)


@dataclass(frozen=True)
class DeviceQuery:
    """What GET /api/devices asks: expired temporary devices too, only those first seen after
    a time, and at most `limit` devices (those seen last)."""

    include_expired: bool = False
    first_seen_after: float | None = None
    limit: int | None = None


def device_query(query: Mapping[str, str]) -> DeviceQuery:
    """GET /api/devices's query string (400 for a time or a limit that does not parse)."""
    limit = (int_param(query, "limit", 0, 1, MAX_DEVICES_LIMIT)
             if query.get("limit", "").strip() else None)
    return DeviceQuery(include_expired=query.get("expired", "").lower() in ("1", "true", "yes"),
                       first_seen_after=time_param(query, "first_seen_after"), limit=limit)


async def list_devices(db: Database, now: float, asked: DeviceQuery) -> dict[str, Any]:
    """The registry as its listing, or with `first_seen_after` only the devices first seen
    since then (the Add-a-device page watches for arrivals without reading every device)."""
    async with _listing_slots(db, asked):
        return await db.read_in_thread(_device_listing, now, asked, named=True)


async def list_devices_body(db: Database, now: float, asked: DeviceQuery) -> bytearray:
    """list_devices as the JSON body of GET /api/devices, encoded in the worker thread too: the
    records of a large registry are never built, encoded or freed on the loop's thread."""
    async with _listing_slots(db, asked):
        return await db.read_in_thread(_device_listing_body, now, asked, named=True)


def _device_listing_body(conn: sqlite3.Connection, now: float, asked: DeviceQuery
                         ) -> bytearray:
    """_device_listing as JSON, each record encoded as it is made into the one buffer sent: no
    record outlives its row, the body is never copied whole (136 MB for 25,000 devices at the
    registry's limits), and no single encoding holds the GIL the loop's thread needs for long."""
    head = b'{"devices":['
    body = bytearray(head)

    def add(record: dict[str, Any]) -> None:
        if len(body) > len(head):
            body.extend(b",")
        body.extend(jsonio.dumps_body(record))

    listing = _device_listing(conn, now, asked, add)
    del listing["devices"]
    body.extend(b"],")
    body.extend(memoryview(jsonio.dumps_body(listing))[1:])  # {"pools": ..., ...} less its {
    return body


def _device_listing(conn: sqlite3.Connection, now: float, asked: DeviceQuery,
                    each: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """In a worker thread: the listing's records, the facet of their pools, how many expired
    devices it leaves out and, with a limit, how many devices it would list without one. With
    `each`, every record goes to it instead of into `devices`."""
    where, params = ["1 = 1"], []
    if asked.first_seen_after is not None:
        where.append("first_seen > ?")
        params.append(asked.first_seen_after)
    # rules.is_expired, in SQL, so a limit counts only the devices listed.
    expired = "(ttl_s IS NOT NULL AND ? - last_seen > ttl_s)"
    hidden = 0
    if not asked.include_expired:
        hidden = conn.execute(f"SELECT count(*) FROM devices WHERE {' AND '.join(where)} "
                              f"AND {expired}", (*params, now)).fetchone()[0]
        where.append(f"NOT {expired}")
        params.append(now)
    sql = _LISTED_DEVICE.format(where="WHERE " + " AND ".join(where))
    if asked.limit is not None:
        sql += " LIMIT ?"
    records: list[dict[str, Any]] = []
    listed = 0
    pools: set[str] = set()  # the facet the pool filter offers: the effective pools listed
    for row in conn.execute(sql, (*params, asked.limit) if asked.limit is not None else params):
        record = device_record(row, now)
        # `beacon`, the original's name for last_beacon, is the same object.
        record["trimmed"] = _trimmed_names(row, "descriptor", "last_beacon",
                                           *_LISTED_DEVICE_LISTS)
        pools.update(record["pools"])
        listed += 1
        if each is None:
            records.append(record)
        else:
            each(record)
    # So a count of devices can say how many it leaves out, not read as the whole registry.
    listing: dict[str, Any] = {"devices": records, "pools": sorted(pools),
                               "expired_hidden": hidden}
    if asked.limit is not None:
        total = (listed if listed < asked.limit else conn.execute(
            f"SELECT count(*) FROM devices WHERE {' AND '.join(where)}", params).fetchone()[0])
        listing.update(devices_total=total, cut=total > listed)
    return listing


async def get_device(db: Database, device_id: str, now: float) -> dict[str, Any]:
    row = await db.read_one("SELECT * FROM devices WHERE device_id = ?", (device_id,))
    if row is None:
        raise NotFound(f"no device {device_id!r}")
    record = device_record(row, now)
    running = await db.read("SELECT job_id, workload, lease_deadline FROM jobs "
                            "WHERE status = 'claimed' AND claimed_by = ?", (device_id,))
    record["running"] = [{"job_id": r["job_id"], "workload": r["workload"],
                          "lease_deadline": iso(r["lease_deadline"])} for r in running]
    record.update(await device_history(db, device_id))
    return record


DEVICE_HISTORY = 50  # recent jobs and benchmark rows on a device's detail


async def device_history(db: Database, device_id: str) -> dict[str, Any]:
    """The device detail's history as the original shows it: `jobs`, the newest jobs it
    claimed, was pinned to or reported on; `benchmarks`, its newest benchmark summary rows."""
    jobs = await db.read(
        f"SELECT {_LISTED_JOB} FROM jobs WHERE is_group = 0 AND (claimed_by = ? OR "
        "target_device = ? OR "
        "job_id IN (SELECT job_id FROM results WHERE device_id = ?)) ORDER BY seq DESC LIMIT ?",
        (device_id, device_id, device_id, DEVICE_HISTORY))
    benches = await db.read(
        f"SELECT {_LISTED_RESULT} FROM results WHERE device_id = ? AND workload = 'benchmark' "
        "AND iter = 0 ORDER BY created_at DESC, id DESC LIMIT ?", (device_id, DEVICE_HISTORY))
    return {"jobs": [_listed_trimmed(r) for r in jobs],
            "benchmarks": [_listed_result(r) for r in benches]}


BEACON_PAGE_ROWS = 1000  # the newest beacons one answer carries
# ... and the most stored beacon text: the answer holds each beacon twice (beacons, samples), and
# 1,000 beacons of 16 KiB made a 27 MB answer that held the event loop half a second.
BEACON_PAGE_BYTES = 2 << 20


async def device_beacons(db: Database, device_id: str, query: Mapping[str, str], now: float
                         ) -> dict[str, Any]:
    since = time_param(query, "since") or 0.0
    if query.get("hours") and not query.get("since"):
        since = now - int_param(query, "hours", 24, 1, 24 * 365) * 3600
    rows = await db.read("SELECT job_id, at, body FROM beacons WHERE device_id = ? AND at >= ? "
                         "ORDER BY at DESC LIMIT ?", (device_id, since, BEACON_PAGE_ROWS))
    # A forgotten device's history stays (forget keeps beacons): 404 only when there is none.
    if not rows and await db.read_one("SELECT 1 FROM devices WHERE device_id = ?",
                                      (device_id,)) is None:
        raise NotFound(f"no device {device_id!r}")
    kept, size = 0, 0
    for row in rows:  # newest first: the oldest are left out
        size += len(row["body"])
        if kept and size > BEACON_PAGE_BYTES:
            break
        kept += 1
    # The record's own time and job come last: a beacon's fields of the same name do not win.
    beacons = [{**json.loads(r["body"]), "at": iso(r["at"]), "job_id": r["job_id"]}
               for r in reversed(rows[:kept])]
    # `samples` (with `ts`) is the original's name for the same list, oldest first.
    samples = [{**b, "ts": b["at"]} for b in beacons]
    return {"device_id": device_id, "beacons": beacons, "samples": samples,
            "truncated": len(rows) == BEACON_PAGE_ROWS or kept < len(rows)}


async def preview_targets(db: Database, spec: JobSpec, now: float, *,
                          any_workload: bool = False) -> dict[str, Any]:
    """What a fan-out of this spec would reach now, as queue.fanout_devices and
    queue.fanout_executors would choose: the devices (newest seen first), or for a host job the
    executors. With any_workload, the devices are not asked whether they run the workload."""
    if spec["executor"] == Executor.HOST:
        rows = await db.read(executors.RECENT_SQL, (executors.recent_since(now),))
        device = (spec.get("targets") or {}).get("device_id")
        found = await db.read_one(authority.ATTACHED_TO_SQL, (device,)) if device else None
        names = queue.pick_executors(
            [(row[0], executors.decoded(row[1])) for row in rows], spec,
            authority.attached_host(found[0]) if found else None)
        return {"count": len(names), "devices": [], "executors": names}
    async with db.slots("target choices", TARGET_CHOICES_AT_ONCE):
        return await db.read_in_thread(_previewed_devices, spec, now, any_workload, named=True)


def _previewed_devices(conn: sqlite3.Connection, spec: JobSpec, now: float,
                       any_workload: bool) -> dict[str, Any]:
    """In a worker thread: the preview's answer for a device job."""
    chosen = queue.fanout_devices(conn, spec, now, any_workload=any_workload)
    return {"count": len(chosen), "devices": [
        {"device_id": d.device_id, "platform": d.descriptor.get("platform"),
         "model": d.descriptor.get("model"), "pools": d.pools} for d in chosen]}


# Choosing the targets of a fan-out or a preview, and finding that no registered device declares
# a workload, read every registered device, on a worker thread of its own
# (Database.read_in_thread): at most this many at once, so a client asking again and again
# queues behind itself instead of taking every worker thread.
TARGET_CHOICES_AT_ONCE = 2


async def transact_reading_first(transact: Callable[..., Awaitable[Any]],
                                 fn: Callable[..., Any], *args: Any,
                                 prepare: Callable[[], Awaitable[queue.Prepared | None]],
                                 prepared: queue.Prepared | None = None, **kwargs: Any) -> Any:
    """transact(fn, *args, prepared=, bounded=True, **kwargs) for an enqueue (queue.enqueue, or
    one that calls it); when the transaction stops for more of the registry than it may read
    (queue.ReadFirst), `prepare()` reads it off the event loop's thread and the transaction
    runs again with what was read."""
    try:
        return await transact(fn, *args, prepared=prepared, bounded=True, **kwargs)
    except queue.ReadFirst:
        return await transact(fn, *args, prepared=await prepare(), bounded=False, **kwargs)


async def prepare_enqueue(db: Database, specs: list[JobSpec], now: float, *,
                          separately: bool = False) -> queue.Prepared:
    """queue.prepare_enqueue for a request's specs (or, `separately`, a tick's runs), off
    the event loop's thread."""
    async with db.slots("target choices", TARGET_CHOICES_AT_ONCE):
        return await db.read_in_thread(
            functools.partial(queue.prepare_enqueue, separately=separately), specs, now,
            named=True)


LowBattery = Callable[[list[dict[str, Any]], float], list[str]]


def _device_glance(conn: sqlite3.Connection, now: float, low_battery: LowBattery | None,
                   devices_sql: str) -> tuple[dict[str, int], list[Any]]:
    """In a worker thread: the devices by status, and those low_battery names. Every device
    row is read, and at 25,000 devices reading and judging them on the event loop's thread held
    it a third of a second for each overview asked for."""
    by_status = dict.fromkeys((s.value for s in DeviceStatus), 0)
    devices = [dict(row) for row in conn.execute(devices_sql)]
    for row in devices:
        if not rules.is_expired(row["ttl_s"], row["last_seen"], now):
            by_status[rules.device_status(row["last_seen"], now)] += 1
    return by_status, (low_battery(devices, now) if low_battery else [])


# What the overview reads of each device without a low-battery rule: columns an index holds.
OVERVIEW_DEVICES = "SELECT device_id, last_seen, ttl_s FROM devices"


async def overview(db: Database, now: float, low_battery: LowBattery | None = None,
                   devices_sql: str = OVERVIEW_DEVICES) -> dict[str, Any]:
    """The fleet at a glance. `low_battery` names the devices whose battery is low (the
    low-battery alert's rule, passed in by the caller so the queue's room needs no alerts),
    from the rows of `devices_sql` (the columns that rule reads, not whole rows: a device's
    descriptor and last beacon may be 16 KiB each)."""
    by_status, low = await db.read_in_thread(_device_glance, now, low_battery, devices_sql,
                                             named=True)
    counts = dict.fromkeys(JOB_STATUSES, 0)
    for row in await db.read("SELECT status, COUNT(*) AS n FROM jobs WHERE is_group = 0 "
                             "GROUP BY status"):
        counts[row["status"]] = row["n"]
    # The columns shown only: a spec may be a megabyte.
    running = await db.read("SELECT job_id, workload, claimed_by, claimed_at, lease_deadline "
                            "FROM jobs WHERE status = 'claimed' ORDER BY claimed_at LIMIT 100")
    failures = await db.read("SELECT job_id, workload, last_error, finished_at, attempts, "
                             "max_attempts FROM jobs WHERE status = 'failed' "
                             "ORDER BY finished_at DESC LIMIT 20")
    # Progress is the current attempt's: late rows of a lapsed one are not this run's.
    progress = await db.read(
        "SELECT r.job_id, r.device_id, MAX(r.iter) AS iter, COUNT(*) AS rows FROM jobs j "
        "JOIN results r ON r.job_id = j.job_id AND r.attempt = j.attempts "
        "WHERE j.status = 'claimed' GROUP BY r.job_id, r.device_id")
    rows_by_job = {r["job_id"]: {"rows": r["rows"], "last_iter": r["iter"]} for r in progress}
    return {
        "devices": {"total": sum(by_status.values()), **by_status, "low_battery_devices": low},
        "queue": {**counts, **await _closed_24h(db, now)},
        "schedules": await _schedule_counts(db),
        "running": [{"job_id": r["job_id"], "workload": r["workload"],
                     "claimed_by": r["claimed_by"], "claimed_at": iso(r["claimed_at"]),
                     "lease_deadline": iso(r["lease_deadline"]),
                     "progress": rows_by_job.get(r["job_id"], {"rows": 0, "last_iter": None})}
                    for r in running],
        "recent_failures": [{"job_id": r["job_id"], "workload": r["workload"],
                             "last_error": r["last_error"], "finished_at": iso(r["finished_at"]),
                             "attempts": r["attempts"], "max_attempts": r["max_attempts"]}
                            for r in failures],
        "now": iso(now),
        "generated_at": iso(now),  # the original's name for `now`
    }


async def list_executors(db: Database, waiting: set[str], hold_s: float,
                         now: float) -> dict[str, Any]:
    """Every host executor seen (registered or polled): its status, what it declared, its
    attached devices and the jobs it holds. `waiting`: names with a poll waiting now. Read on
    a worker thread (two at a time): finding the attached devices reads every device's
    descriptor, and at 25,000 devices registered at their limits that held the shared reader
    (and every request waiting for it) 2 s a listing."""
    async with db.slots("registry reads", TARGET_CHOICES_AT_ONCE):
        return await db.read_in_thread(_executor_listing, waiting, hold_s, now, named=True)


def _executor_listing(conn: sqlite3.Connection, waiting: set[str], hold_s: float,
                      now: float) -> dict[str, Any]:
    rows = conn.execute(executors.LIST_SQL).fetchall()
    held: dict[str, list[dict[str, Any]]] = {}
    for job in conn.execute(executors.HELD_SQL):
        held.setdefault(job["claimed_by"], []).append(
            {"job_id": job["job_id"], "workload": job["workload"]})
    attached: dict[str, list[dict[str, Any]]] = {}
    for device in conn.execute(executors.ATTACHED_SQL):
        attached.setdefault(str(device["host"]), []).append(
            {"device_id": device["device_id"],
             "status": rules.device_status(device["last_seen"], now)})
    return {"executors": [{
        "name": row["name"],
        "status": executors.executor_status(row, row["name"] in held, row["name"] in waiting,
                                            hold_s, now),
        "capabilities": executors.decoded(row["capabilities"]),
        "slots": row["slots"],
        "agent": row["agent"],
        "attached": attached.get(row["name"], []),
        "jobs": held.get(row["name"], []),
        "first_seen": iso(row["first_seen"]),
        "last_seen": iso(executors.last_seen(row)),
        "registered_at": iso(row["registered_at"]) if row["registered_at"] else None,
    } for row in rows]}


async def list_locks(db: Database) -> dict[str, Any]:
    """Every device lock: the job holding it, its holder (the job's claimant) and when it
    expires (the job's lease deadline: a lock lasts as long as its job's claim)."""
    return {"locks": [{
        "device_id": row["device_id"], "job_id": row["job_id"], "holder": row["claimed_by"],
        "executor": row["executor"], "acquired_at": iso(row["locked_at"]),
        "expires_at": iso(row["lease_deadline"]),
    } for row in await db.read(locks.LIST_SQL)]}


async def _closed_24h(db: Database, now: float) -> dict[str, int]:
    """Jobs closed in the last day, by outcome: the original's done_24h, failed_24h and
    cancelled_24h beside our all-time counts."""
    closed = {"done_24h": 0, "failed_24h": 0, "cancelled_24h": 0}
    for row in await db.read("SELECT status, COUNT(*) AS n FROM jobs WHERE is_group = 0 AND "
                             "finished_at >= ? AND status IN ('done', 'failed', 'cancelled') "
                             "GROUP BY status", (now - 86400,)):
        closed[f"{row['status']}_24h"] = row["n"]
    return closed


async def _schedule_counts(db: Database) -> dict[str, int]:
    row = await db.read_one("SELECT COUNT(*) AS total, COALESCE(SUM(enabled), 0) AS enabled "
                            "FROM schedules")
    total, enabled = (row["total"], row["enabled"]) if row else (0, 0)
    return {"total": total, "enabled": enabled}

"""Shaped views of stored results for charts and tables: bench, ui, drain and soak.

Each view reads with bound parameters and does its arithmetic in plain Python. The choices
(which rows count, how gaps are treated) are written down in docs/collector-insight.md.
"""

from __future__ import annotations

import math
import sqlite3
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fleet_min import numbers
from fleet_min.collector.insight import result_runs
from fleet_min.db import Database
from fleet_min.errors import BadRequest
from fleet_min.query import int_param, time_range
from fleet_min.timeutil import iso

BENCH_METRICS = ("decode_tok_s", "prefill_tok_s", "ttft_ms", "peak_mem_mb")
BENCH_ROW_CAP = 50_000  # newest result rows a bench view reads; `truncated` says when it stopped
UI_PER_PAGE = 50
UI_ROWS_PER_JOB = 5_000  # newest rows a ui job's flows and runs are read from; `truncated` past it
DRAIN_MAX_GAP_S = 300.0  # the spec's energy rule: gaps over 5 minutes are skipped
DRAIN_DEFAULT_HOURS, DRAIN_MAX_HOURS = 24, 168
DRAIN_DEVICES = 200  # devices one drain answer lists, in device order; `cut` past it
DRAIN_BEACONS = 500_000  # beacons one drain answer reads; `cut` when a device's would pass it
SOAK_WORKLOADS = ("app-soak", "soak")
SOAK_DEFAULT_POINTS, SOAK_MAX_POINTS = 2000, 10_000


# -- shared parsing ----------------------------------------------------------------------------


@dataclass
class _Filter:
    """WHERE fragments over the `results r` alias, with their bound parameters."""

    clauses: list[str] = field(default_factory=list)
    params: list[Any] = field(default_factory=list)

    def add(self, clause: str, *params: Any) -> None:
        self.clauses.append(clause)
        self.params.extend(params)

    def times(self, query: Mapping[str, str], column: str) -> _Filter:
        time_range(query, column, self.clauses, self.params)
        return self

    def common(self, query: Mapping[str, str]) -> _Filter:
        """device, job, from and to over result rows."""
        if query.get("device"):
            self.add("r.device_id = ?", query["device"])
        if query.get("job"):
            self.add("r.job_id = ?", query["job"])
        return self.times(query, "r.created_at")

    @property
    def where(self) -> str:
        return " AND ".join(self.clauses) if self.clauses else "1 = 1"


def summary(values: list[float]) -> dict[str, Any]:
    middle = numbers.median(values)
    if middle is None:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": round(middle, 3), "min": min(values), "max": max(values), "n": len(values)}


# -- bench -------------------------------------------------------------------------------------


@dataclass
class _Run:
    """One attempt of a job on one device: its iteration rows and its summary rows. (A lapsed
    attempt's rows and the next attempt's are two runs, never one run's samples twice.)"""

    model: str | None
    backend: str | None
    device_name: str | None
    quant: str | None = None
    iterations: list[dict[str, Any]] = field(default_factory=list)
    summaries: list[dict[str, Any]] = field(default_factory=list)
    last_at: float = 0.0

    @property
    def mem_method(self) -> str | None:
        for metrics in (*self.summaries, *self.iterations):
            if isinstance(metrics.get("mem_method"), str):
                return str(metrics["mem_method"])
        return None

    def samples(self, metric: str) -> list[float]:
        """Per-iteration values when the run has them, else the summary's: never both."""
        for rows in (self.iterations, self.summaries):
            values = [v for v in (numbers.finite(m.get(metric)) for m in rows) if v is not None]
            if values:
                return values
        return []


async def bench(db: Database, query: Mapping[str, str]) -> dict[str, Any]:
    workload = query.get("workload") or "benchmark"
    where = _Filter().common(query)
    where.add("r.workload = ?", workload)
    where.add("r.preempted = 0 AND (r.ok IS NULL OR r.ok = 1)")
    model_sql = "COALESCE(json_extract(j.spec, '$.model.name'), j.backend)"
    if query.get("model"):
        where.add(f"{model_sql} = ?", query["model"])
    rows = await db.read(
        f"""
        SELECT r.job_id, r.device_id, r.iter, r.attempt, {_BENCH_FIGURES}, r.created_at,
               j.backend, {model_sql} AS model, d.name AS device_name,
               json_extract(j.spec, '$.model.quant') AS quant
        FROM results r JOIN jobs j ON j.job_id = r.job_id
        LEFT JOIN devices d ON d.device_id = r.device_id
        WHERE {where.where} ORDER BY r.created_at DESC LIMIT ?
        """, [*where.params, BENCH_ROW_CAP + 1])
    runs = _bench_runs(rows[:BENCH_ROW_CAP])
    return {"workload": workload, "metrics": list(BENCH_METRICS),
            "rows": _bench_groups(runs.items()), "truncated": len(rows) > BENCH_ROW_CAP,
            "configs": result_runs.bench_configs(_config_runs(runs))}


# What a run reads of its rows' metrics (_Run, result_runs.headline), read by SQLite: the bench
# view reads up to 50,000 rows, and parsing each row's metrics on the loop made 1,000 rows of
# 900 KB hold it 3.2 s and 1.8 GB.
_BENCH_NAMES = (*dict.fromkeys((*BENCH_METRICS, *result_runs.RUN_METRICS)), "mem_method")
_BENCH_FIGURES = ", ".join([
    *(result_runs.figure_sql(result_runs.METRICS, name) for name in _BENCH_NAMES[:-1]),
    result_runs.text_sql(result_runs.METRICS, "mem_method")])


def _config_runs(runs: dict[tuple[str, str, int], _Run]) -> Iterable[dict[str, Any]]:
    """Each run flattened for the original's by-configuration grouping."""
    for (job_id, device_id, _attempt), run in runs.items():
        yield {"config": result_runs.config_label(run.model, run.quant, run.backend),
               "model": run.model, "quant": run.quant, "backend": run.backend,
               "device_id": device_id, "device_name": run.device_name, "job_id": job_id,
               "last_at": run.last_at, "mem_method": run.mem_method,
               **{m: result_runs.headline(run.summaries, run.iterations, m)
                  for m in result_runs.RUN_METRICS}}


def _bench_runs(rows: Iterable[Any]) -> dict[tuple[str, str, int], _Run]:
    runs: dict[tuple[str, str, int], _Run] = {}
    for row in rows:
        key = (row["job_id"], row["device_id"], row["attempt"])
        run = runs.get(key)
        if run is None:
            model = row["model"] if isinstance(row["model"], str) else None
            quant = row["quant"] if isinstance(row["quant"], str) else None
            run = runs[key] = _Run(model, row["backend"], row["device_name"], quant)
        metrics = result_runs.figures(row, _BENCH_NAMES)
        (run.iterations if row["iter"] >= 1 else run.summaries).append(metrics)
        run.last_at = max(run.last_at, row["created_at"])
    return runs


def _bench_groups(runs: Iterable[tuple[tuple[str, str, int], _Run]]) -> list[dict[str, Any]]:
    """Group runs by device, model and mem_method: memory measured differently never mixes."""
    groups: dict[tuple[str, str | None, str | None], list[_Run]] = defaultdict(list)
    for (_job_id, device_id, _attempt), run in runs:
        groups[(device_id, run.model, run.mem_method)].append(run)
    out = []
    for (device_id, model, mem_method), members in sorted(
            groups.items(), key=lambda item: tuple(str(part) for part in item[0])):
        row: dict[str, Any] = {
            "device_id": device_id, "device_name": members[0].device_name, "model": model,
            "backends": sorted({r.backend for r in members if r.backend}),
            "mem_method": mem_method, "runs": len(members),
            "last_at": iso(max(r.last_at for r in members))}
        for metric in BENCH_METRICS:
            row[metric] = summary([v for r in members for v in r.samples(metric)])
        out.append(row)
    return out


# -- ui ----------------------------------------------------------------------------------------


async def ui(db: Database, query: Mapping[str, str]) -> dict[str, Any]:
    workload = query.get("workload") or "ui-test"
    page = int_param(query, "page", 1, 1, 1_000_000)
    jobs_where = _Filter().times(query, "j.created_at")
    jobs_where.add("j.workload = ? AND j.is_group = 0", workload)
    if query.get("job"):
        jobs_where.add("j.job_id = ?", query["job"])
    if query.get("device"):
        jobs_where.add("EXISTS (SELECT 1 FROM results r WHERE r.job_id = j.job_id "
                       "AND r.device_id = ?)", query["device"])
    total_row = await db.read_one(f"SELECT COUNT(*) FROM jobs j WHERE {jobs_where.where}",
                                  jobs_where.params)
    jobs = await db.read(
        f"""SELECT j.job_id, j.status, j.last_error, j.created_at, j.finished_at,
                   json_extract(j.spec, '$.app.name') AS app,
                   json_extract(j.spec, '$.app.build') AS build
            FROM jobs j WHERE {jobs_where.where} ORDER BY j.seq DESC LIMIT ? OFFSET ?""",
        [*jobs_where.params, UI_PER_PAGE, (page - 1) * UI_PER_PAGE])
    rows, cut = await _ui_rows(db, [j["job_id"] for j in jobs])
    flows = _ui_flows(rows, query.get("device"))
    total = total_row[0] if total_row else 0
    return {"workload": workload, "page": page, "per_page": UI_PER_PAGE, "total": total,
            "pages": max(1, -(-total // UI_PER_PAGE)),
            "jobs": [_ui_job(j, flows.get(j["job_id"], {}), j["job_id"] in cut) for j in jobs],
            **result_runs.ui_runs(jobs, rows)}


# A row's flow (`flow`, else `browser`, else `iter <n>`) and test counts, read by SQLite from its
# extra fields, so the loop parses no row's JSON.
_EXTRA = "CASE WHEN json_valid(extra) THEN extra END"
_UI_ROW = f"""
    SELECT id, job_id, device_id, iter, attempt, ok, error, created_at,
           CASE WHEN json_type({_EXTRA}, '$.flow') = 'text'
                     AND json_extract({_EXTRA}, '$.flow') != ''
                THEN json_extract({_EXTRA}, '$.flow')
                WHEN json_type({_EXTRA}, '$.browser') = 'text'
                     AND json_extract({_EXTRA}, '$.browser') != ''
                THEN json_extract({_EXTRA}, '$.browser')
                ELSE 'iter ' || iter END AS flow,
           CASE WHEN json_type({_EXTRA}, '$.test.passed') IN ('integer', 'real')
                THEN json_extract({_EXTRA}, '$.test.passed') END AS passed,
           CASE WHEN json_type({_EXTRA}, '$.test.failed') IN ('integer', 'real')
                THEN json_extract({_EXTRA}, '$.test.failed') END AS failed
    FROM results WHERE job_id = ? AND preempted = 0
    ORDER BY created_at DESC, id DESC LIMIT ?"""


async def _ui_rows(db: Database, job_ids: list[str]) -> tuple[list[Any], set[str]]:
    """The newest UI_ROWS_PER_JOB rows of each job, oldest first, and the jobs that had more:
    one query per job, so a job of 20,000 rows costs the loop 5,000 short ones."""
    rows: list[Any] = []
    cut: set[str] = set()
    for job_id in job_ids:
        newest = await db.read(_UI_ROW, (job_id, UI_ROWS_PER_JOB + 1))
        if len(newest) > UI_ROWS_PER_JOB:
            cut.add(job_id)
        rows.extend(reversed(newest[:UI_ROWS_PER_JOB]))
    return rows, cut


def _ui_flows(rows: list[Any], device: str | None) -> dict[str, dict[str, dict[str, Any]]]:
    """Each job's flows from its per-iteration rows (those of `device` only, when given)."""
    flows: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        if row["iter"] < 1 or (device and row["device_id"] != device):
            continue
        flow = flows[row["job_id"]].setdefault(row["flow"], {
            "flow": row["flow"], "runs": 0, "pass": 0, "fail": 0, "devices": {}, "attempts": {},
            "latest_error": None, "latest_error_at": None, "last_at": None})
        flow["runs"] += 1
        if row["ok"] is not None:
            flow["pass" if row["ok"] else "fail"] += 1
        flow["devices"][row["device_id"]] = None  # a dict keeps first-seen order
        flow["attempts"][row["attempt"]] = None
        if row["ok"] == 0 and row["error"]:
            flow["latest_error"], flow["latest_error_at"] = row["error"], iso(row["created_at"])
        flow["last_at"] = iso(row["created_at"])
    for by_name in flows.values():
        for flow in by_name.values():
            flow["devices"], flow["attempts"] = list(flow["devices"]), list(flow["attempts"])
    return flows


def _ui_job(job: Any, flows: dict[str, dict[str, Any]], truncated: bool) -> dict[str, Any]:
    ordered = [flows[name] for name in sorted(flows)]
    return {"job_id": job["job_id"], "status": job["status"], "app": job["app"],
            "last_error": job["last_error"], "created_at": iso(job["created_at"]),
            "finished_at": iso(job["finished_at"]),
            "pass": sum(f["pass"] for f in ordered), "fail": sum(f["fail"] for f in ordered),
            "flows": ordered, "truncated": truncated}


# -- drain -------------------------------------------------------------------------------------


@dataclass
class _Drain:
    """Battery spent over the covered stretches of one device's beacons."""

    device_id: str
    samples: int = 0
    drop: float = 0.0
    covered_s: float = 0.0
    gaps: int = 0
    charging_s: float = 0.0
    hours: dict[int, list[float]] = field(default_factory=dict)  # hour start -> [drop, covered]

    def add_segment(self, start: float, end: float, drop: float) -> None:
        """Spread one measured segment over the clock hours it overlaps, in proportion."""
        self.drop += drop
        self.covered_s += end - start
        hour = math.floor(start / 3600) * 3600
        while hour < end:
            overlap = min(end, hour + 3600) - max(start, hour)
            if overlap > 0:
                bucket = self.hours.setdefault(hour, [0.0, 0.0])
                bucket[0] += drop * overlap / (end - start)
                bucket[1] += overlap
            hour += 3600


# A beacon's battery reading when it is a number a double holds: json_extract alone reads `true`
# as 1, and a 400-digit integer as infinity. Beacons without one are not samples.
_PCT = ("CASE WHEN json_type(body, '$.battery_pct') IN ('integer', 'real') "
        "THEN json_extract(body, '$.battery_pct') END")
_SAMPLE = f"abs({_PCT}) <= 1.7976931348623157e308"


DRAIN_REPORTS_AT_ONCE = 2


async def drain(db: Database, query: Mapping[str, str], now: float) -> dict[str, Any]:
    hours = int_param(query, "hours", DRAIN_DEFAULT_HOURS, 1, DRAIN_MAX_HOURS)
    start = now - hours * 3600
    where = _Filter()
    where.add("at >= ? AND at <= ?", start, now)
    where.add(_SAMPLE)
    if query.get("device"):
        where.add("device_id = ?", query["device"])
    if query.get("job"):
        where.add("job_id = ?", query["job"])
    # Up to 500,000 beacons on a thread of its own; a few at once, so a client asking for many
    # queues behind itself instead of taking the worker threads the other reads share.
    async with db.slots("drain reports", DRAIN_REPORTS_AT_ONCE):
        records, total, cut = await db.read_in_thread(_drain_devices, where, start, now)
    return {"metric": "drain_pct_per_h", "hours": hours, "from": iso(start), "to": iso(now),
            "max_gap_s": DRAIN_MAX_GAP_S, "devices": records, "devices_total": total,
            "cut": cut, "runs": await result_runs.drain_runs(db, query)}


# Beacons come one per POST /results and are not capped by the device cap (forgotten devices
# keep theirs), so a window may hold any number of devices and beacons: 25,000 devices made a
# week's answer 333 MB (an entry per hour per device) and held the loop 6.9 s. An answer lists
# the first DRAIN_DEVICES devices with a sample, in device order, while their beacons fit in
# DRAIN_BEACONS (the first device always, read to that many), and says how many had a sample.
# The walk runs in a worker thread on a connection of its own, so the loop and the shared
# reader stay free however many beacons it reads; `device` reaches any device.
_DRAIN_DEVICE_COUNTS = """
    SELECT device_id, SUM(COUNT(*)) OVER (ORDER BY device_id), COUNT(*) OVER ()
    FROM beacons WHERE {where} GROUP BY device_id ORDER BY device_id LIMIT ?"""
_DRAIN_BEACONS = f"""
    SELECT device_id, at, {_PCT}, json_extract(body, '$.charging') = 1
    FROM beacons WHERE {{where}} AND device_id <= ? ORDER BY device_id, at LIMIT ?"""


def _drain_devices(conn: sqlite3.Connection, where: _Filter, start: float, end: float
                   ) -> tuple[list[dict[str, Any]], int, bool]:
    """In a worker thread (Database.read_in_thread): the records of the devices that fit one
    answer, how many devices had a sample in the window, and whether the answer left any
    device or beacon out."""
    counts = conn.execute(_DRAIN_DEVICE_COUNTS.format(where=where.where),
                          [*where.params, DRAIN_DEVICES]).fetchall()
    if not counts:
        return [], 0, False
    fits = [c for c in counts if c[1] <= DRAIN_BEACONS] or counts[:1]
    rows = conn.execute(_DRAIN_BEACONS.format(where=where.where),
                        [*where.params, fits[-1][0], DRAIN_BEACONS])
    devices = _drain_walk(rows)
    total = counts[0][2]
    cut = len(fits) < total or fits[-1][1] > DRAIN_BEACONS
    return [_drain_record(devices[d], start, end) for d in sorted(devices)], total, cut


def _drain_walk(rows: Iterable[tuple[str, float, float, int | None]]) -> dict[str, _Drain]:
    """Each device's drain from its beacons (device_id, at, battery_pct, charging), in device
    and time order."""
    devices: dict[str, _Drain] = {}
    previous: dict[str, tuple[float, float, bool]] = {}
    for device_id, at, pct, charging in rows:
        state = devices.setdefault(device_id, _Drain(device_id))
        state.samples += 1
        last = previous.get(device_id)
        previous[device_id] = (at, pct, bool(charging))
        if last is None or at <= last[0]:
            continue
        if at - last[0] > DRAIN_MAX_GAP_S:
            state.gaps += 1  # skipped, never bridged: no extrapolation
        elif charging or last[2]:
            state.charging_s += at - last[0]
        else:
            state.add_segment(last[0], at, last[1] - pct)
    return devices


def _rate(drop: float, covered_s: float) -> float | None:
    return round(drop / covered_s * 3600, 3) if covered_s > 0 else None


def _drain_record(state: _Drain, start: float, end: float) -> dict[str, Any]:
    series = []
    hour = math.floor(start / 3600) * 3600
    while hour <= end:
        drop, covered = state.hours.get(hour, (0.0, 0.0))
        series.append({"hour": iso(hour), "drain_pct_per_h": _rate(drop, covered),
                       "covered_s": round(covered, 1)})
        hour += 3600
    return {"device_id": state.device_id, "drain_pct_per_h": _rate(state.drop, state.covered_s),
            "covered_s": round(state.covered_s, 1), "charging_s": round(state.charging_s, 1),
            "gaps_skipped": state.gaps, "samples": state.samples, "series": series}


# -- soak --------------------------------------------------------------------------------------


# What a soak point reads of its row's metrics, read by SQLite (as bench's figures are).
_SOAK_FIGURES = ", ".join([
    *(result_runs.figure_sql(result_runs.METRICS, name)
      for name in ("mem_mb", "peak_mem_mb", "errors")),
    result_runs.text_sql(result_runs.METRICS, "mem_method")])


def _soak_point(row: Any) -> tuple[str | None, dict[str, Any]]:
    metrics = result_runs.figures(row, ("mem_mb", "peak_mem_mb", "errors", "mem_method"))
    memory = numbers.finite(metrics.get("mem_mb"))
    if memory is None:
        memory = numbers.finite(metrics.get("peak_mem_mb"))
    errors = metrics.get("errors")
    if isinstance(errors, bool) or not isinstance(errors, int) or errors < 0:
        errors = 1 if row["ok"] == 0 else 0
    method = metrics.get("mem_method") if isinstance(metrics.get("mem_method"), str) else None
    return method, {"at": iso(row["created_at"]), "job_id": row["job_id"], "iter": row["iter"],
                    "attempt": row["attempt"], "workload": row["workload"], "mem_mb": memory,
                    "errors": errors, "ok": None if row["ok"] is None else bool(row["ok"]),
                    "error": row["error"]}


async def soak(db: Database, query: Mapping[str, str]) -> dict[str, Any]:
    workload = query.get("workload")
    if workload and workload not in SOAK_WORKLOADS:
        raise BadRequest(f"workload must be one of {', '.join(SOAK_WORKLOADS)}")
    limit = int_param(query, "limit", SOAK_DEFAULT_POINTS, 1, SOAK_MAX_POINTS)
    where = _Filter().common(query)
    wanted = [workload] if workload else list(SOAK_WORKLOADS)
    where.add(f"r.workload IN ({','.join('?' * len(wanted))})", *wanted)
    where.add("r.iter >= 1 AND r.preempted = 0")
    rows = await db.read(f"SELECT r.job_id, r.device_id, r.iter, r.attempt, r.ok, r.error, "
                         f"{_SOAK_FIGURES}, r.workload, r.created_at FROM results r "
                         f"WHERE {where.where} "
                         "ORDER BY r.created_at DESC, r.id DESC LIMIT ?",
                         [*where.params, limit + 1])
    series: dict[tuple[str, str | None], list[dict[str, Any]]] = defaultdict(list)
    for row in reversed(rows[:limit]):
        method, point = _soak_point(row)
        series[(row["device_id"], method)].append(point)
    return {"workloads": wanted, "truncated": len(rows) > limit, "series": [
        _soak_series(device_id, method, points)
        for (device_id, method), points in sorted(series.items(),
                                                  key=lambda i: (i[0][0], str(i[0][1])))],
            "runs": await result_runs.job_runs(db, wanted, {})}


async def vision(db: Database, query: Mapping[str, str]) -> dict[str, Any]:
    """The original's vision view: vision jobs, newest first, each device's newest row."""
    return {"workload": "vision", "runs": await result_runs.job_runs(db, ["vision"], query)}


def _soak_series(device_id: str, method: str | None, points: list[dict[str, Any]]
                 ) -> dict[str, Any]:
    memory = [p["mem_mb"] for p in points if p["mem_mb"] is not None]
    return {"device_id": device_id, "mem_method": method, "points": points,
            "mem_first_mb": memory[0] if memory else None,
            "mem_last_mb": memory[-1] if memory else None,
            "mem_min_mb": min(memory) if memory else None,
            "mem_max_mb": max(memory) if memory else None,
            "mem_growth_mb": round(memory[-1] - memory[0], 3) if memory else None,
            "errors": sum(p["errors"] for p in points)}

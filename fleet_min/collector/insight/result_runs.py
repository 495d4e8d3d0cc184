"""The result views in the original's shapes, added beside ours (docs/collector-insight.md,
"The original's shapes"): bench `configs`, ui `runs`, `devices` and `matrix`, drain and soak
`runs`, and the vision view. They read the same rows as result_views and only group them
differently, so a script written against the original reads our collector unchanged.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from fleet_min import numbers
from fleet_min.db import Database
from fleet_min.query import int_param
from fleet_min.timeutil import iso

RUNS_LIMIT = 200  # jobs a drain, soak or vision listing reads, newest first
RUN_DEVICES = 1_000  # devices one of their runs lists (in device order); `truncated` past it
ANSWER_DEVICES = 10_000  # devices one answer lists across its runs
RUN_METRICS = ("decode_tok_s", "prefill_tok_s", "ttft_ms", "peak_mem_mb")
# A soak or vision run's metrics up to this many characters are carried whole; a larger one is
# cut to its first RUN_METRICS_KEYS fields whose name and value fit RUN_METRIC_CHARS (`trimmed`).
RUN_METRICS_WHOLE, RUN_METRICS_KEYS, RUN_METRIC_CHARS = 2048, 32, 64


def _object(text: str | None) -> dict[str, Any]:
    value = json.loads(text) if text else {}
    return value if isinstance(value, dict) else {}


# -- figures SQLite reads out of a row's JSON --------------------------------------------------

# A row's metrics are a few figures, but the open `metrics` object may fill the 1 MiB body limit
# and every view reads many rows: parsed in Python, 1,000 rows of 900 KB held the event loop
# 3-5 s and 2-4 GB. So the views ask SQLite for the figures they show and the loop parses no
# row's metrics. (Each call looks the parsed document up again, so no json_valid guard is
# repeated around every one: the intake stores metrics as a JSON object, and the column is NOT
# NULL; the guard made 1,000 rows of 900 KB cost SQLite 1.9 s instead of 1.2 s.)
METRICS = "r.metrics"


def figure_sql(column: str, name: str) -> str:
    """SQL for the number at `$.<name>` of a JSON column, as `<name>`; NULL for anything else
    (json_extract alone reads `true` as 1). A number no double holds reads as infinity, which
    numbers.finite turns into no figure, as it did the integer json.loads made of it."""
    path = f"'$.{name}'"
    return (f"CASE WHEN json_type({column}, {path}) IN ('integer', 'real') "
            f"THEN json_extract({column}, {path}) END AS {name}")


def text_sql(column: str, name: str) -> str:
    """SQL for the text at `$.<name>` of a JSON column, as `<name>`; NULL for anything else."""
    path = f"'$.{name}'"
    return (f"CASE WHEN json_type({column}, {path}) = 'text' "
            f"THEN json_extract({column}, {path}) END AS {name}")


def figures(row: Any, names: Iterable[str]) -> dict[str, Any]:
    """The figures SQLite read (figure_sql, text_sql) as the metrics object they came from."""
    return {name: row[name] for name in names}


# -- bench: by configuration -------------------------------------------------------------------


def config_label(model: str | None, quant: str | None, backend: str | None) -> str:
    """The original's configuration name: "<model> <quant> · <backend>", parts it lacks left
    out (a synthetic run has no model: just its backend)."""
    left = " ".join(part for part in (model, quant) if part)
    return " · ".join(part for part in (left, backend) if part) or "unnamed"


def headline(summaries: list[dict[str, Any]], iterations: list[dict[str, Any]],
             metric: str) -> float | None:
    """A run's figure for one metric: its summary row's when it sent one (what the device
    reported for the run), else the median of its iterations."""
    for metrics in summaries:
        value = numbers.finite(metrics.get(metric))
        if value is not None:
            return value
    values = [v for v in (numbers.finite(m.get(metric)) for m in iterations) if v is not None]
    middle = numbers.median(values)
    return None if middle is None else round(middle, 3)


def bench_configs(runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Group runs (dicts with config, device_id, job_id, last_at and the metrics) by
    configuration, then device: each device's newest run is its `latest`, with its count."""
    by_config: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        by_config[run["config"]][run["device_id"]].append(run)
    out = []
    for config in sorted(by_config):
        devices = []
        for device_id, members in sorted(by_config[config].items()):
            newest = max(members, key=lambda r: r["last_at"])
            devices.append({"device_id": device_id, "device_name": newest["device_name"],
                            "runs": len(members), "latest": {
                                "job_id": newest["job_id"], "at": iso(newest["last_at"]),
                                "mem_method": newest["mem_method"],
                                **{m: newest[m] for m in RUN_METRICS}}})
        first = next(iter(by_config[config].values()))[0]
        out.append({"config": config, "model": first["model"], "quant": first["quant"],
                    "backend": first["backend"], "devices": devices})
    return out


# -- ui: runs and the build x device matrix ----------------------------------------------------


def _count(value: Any) -> int | None:
    number = numbers.finite(value)
    return None if number is None else int(number)


def ui_runs(jobs: list[Any], rows: list[Any]) -> dict[str, Any]:
    """One run per (job, device) of the listed jobs: the device's newest row (of `rows`, the
    jobs' rows oldest first), final or not (a host executor files each device's verdict as a
    row of its own), with the `test` counts SQLite read from it. An executor's own `host:`
    summary row is not a device and is left out."""
    builds = {j["job_id"]: j for j in jobs}
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    first: dict[tuple[str, str], tuple[float, int]] = {}
    for row in rows:
        if row["device_id"][:5].lower() == "host:":  # as SQL's LIKE 'host:%' read it
            continue
        key = (row["job_id"], row["device_id"])
        first.setdefault(key, (row["created_at"], row["id"]))
        job = builds[row["job_id"]]
        latest[key] = {
            "job_id": row["job_id"], "device_id": row["device_id"],
            "build": " ".join(p for p in (job["app"], job["build"]) if p) or row["job_id"],
            "ok": None if row["ok"] is None else bool(row["ok"]),
            "passed": _count(row["passed"]), "failed": _count(row["failed"]),
            "error": row["error"], "at": iso(row["created_at"])}
    # Newest first; runs at the same time in the order their first rows were stored.
    runs = sorted(latest.values(), key=lambda r: first[(r["job_id"], r["device_id"])])
    runs.sort(key=lambda r: r["at"] or "", reverse=True)
    devices = sorted({r["device_id"] for r in runs})
    return {"runs": runs, "devices": devices, "matrix": _matrix(runs, devices)}


def _matrix(runs: list[dict[str, Any]], devices: list[str]) -> list[dict[str, Any]]:
    """Rows by build (newest run first), a cell per device: its newest run of that build."""
    by_build: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:  # newest first: the first run seen for a cell is its latest
        by_build.setdefault(run["build"], {}).setdefault(run["device_id"], run)
    return [{"build": build, "cells": [{"device": d, "latest": cells.get(d)} for d in devices]}
            for build, cells in by_build.items()]


# -- drain, soak and vision: per job -----------------------------------------------------------


# Each device's newest row of one job and how many rows it filed, the first `LIMIT` devices in
# device order; an executor's own `host:` summary is not a device. SQLite counts and picks (the
# grouping walks the (job_id, device_id, ...) index and stops at the limit), so a job of 10,000
# devices costs the loop 1,000 short rows, not 10,000 x 10,000 comparisons. `columns` are what
# the view reads of the newest row's metrics, never the metrics whole.
def _newest_by_device(columns: str) -> str:
    return f"""
    SELECT l.device_id, l.n, r.id, r.ok, r.error, r.created_at, {columns} FROM (
        SELECT device_id, COUNT(*) AS n FROM results
        WHERE job_id = ? AND preempted = 0 AND substr(device_id, 1, 5) != 'host:'
        GROUP BY device_id ORDER BY device_id LIMIT ?) l
    JOIN results r ON r.id = (
        SELECT id FROM results WHERE job_id = ? AND device_id = l.device_id AND preempted = 0
        ORDER BY created_at + 0 DESC, id DESC LIMIT 1)
    ORDER BY l.device_id"""


DRAIN_FIGURES = ("drain_pct_per_h", "decode_tok_s", "battery_start_pct", "battery_end_pct")
_DRAIN_ROWS = _newest_by_device(", ".join(figure_sql(METRICS, f) for f in DRAIN_FIGURES))

# Soak and vision runs carry the newest row's metrics, which a host executor may file near the
# body limit under each of 1,000 devices of a run: carried whole, 1,000 rows of 900 KB made a
# vision answer of 922 MB and held 3.6 GB. Real metrics are a dozen figures, so SQLite hands
# back metrics of up to RUN_METRICS_WHOLE characters whole and cuts a larger one down, before
# Python sees it, as listings do (jobs/views.py, _trimmed_json), but tighter, since one answer
# may list 10,000 devices: only fields whose name is short, and whose value is a number a double
# holds (json_group_object would write a larger one as `Inf`, which is not JSON), a boolean,
# null, or short text, array or object. The row whole is GET /api/results/{result_id}.
_KEPT_VALUE = ("CASE type WHEN 'true' THEN json('true') WHEN 'false' THEN json('false') "
               "WHEN 'object' THEN json(value) WHEN 'array' THEN json(value) ELSE value END")
_RUN_METRICS = f"""
    CASE WHEN length(r.metrics) <= {RUN_METRICS_WHOLE} THEN r.metrics
         WHEN NOT json_valid(r.metrics) THEN '{{}}'
         ELSE (SELECT json_group_object(key, {_KEPT_VALUE}) FROM (
                   SELECT key, type, value FROM json_each(r.metrics)
                   WHERE length(key) <= {RUN_METRIC_CHARS}
                     AND (type IN ('true', 'false', 'null')
                          OR (type IN ('integer', 'real')
                              AND abs(value) <= 1.7976931348623157e308)
                          OR (type IN ('text', 'object', 'array')
                              AND length(value) <= {RUN_METRIC_CHARS}))
                   LIMIT {RUN_METRICS_KEYS})) END AS metrics,
    length(r.metrics) > {RUN_METRICS_WHOLE} AS metrics_trimmed"""
_RUN_ROWS = _newest_by_device(_RUN_METRICS)


async def _jobs_with_devices(db: Database, workloads: list[str], query: Mapping[str, str],
                             newest: str) -> list[tuple[Any, list[Any], bool]]:
    """The newest jobs of the workloads, each with its devices' newest rows read by `newest`
    (RUN_DEVICES at most, ANSWER_DEVICES for all of them) and whether some were left out."""
    limit = int_param(query, "limit", 50, 1, RUNS_LIMIT)
    jobs = await db.read(
        "SELECT job_id, workload, status, created_at, finished_at FROM jobs "
        f"WHERE workload IN ({','.join('?' * len(workloads))}) AND is_group = 0 "
        "ORDER BY seq DESC LIMIT ?", [*workloads, limit])
    out = []
    room = ANSWER_DEVICES
    for job in jobs:
        take = min(RUN_DEVICES, room)
        rows = await db.read(newest, (job["job_id"], take + 1, job["job_id"]))
        out.append((job, rows[:take], len(rows) > take))
        room -= len(rows[:take])
    return out


def drain_rate(metrics: Mapping[str, Any]) -> tuple[float | None, bool]:
    """A drain row's rate in percent per hour and whether it was inferred: the named field
    `drain_pct_per_h`, else the legacy rows' `decode_tok_s` (the original's runner once filed
    the rate under the benchmark's field), flagged so a chart can mark it."""
    named = numbers.finite(metrics.get("drain_pct_per_h"))
    if named is not None:
        return named, False
    legacy = numbers.finite(metrics.get("decode_tok_s"))
    return legacy, legacy is not None


def _job_head(job: Any) -> dict[str, Any]:
    return {"job_id": job["job_id"], "workload": job["workload"], "status": job["status"],
            "created_at": iso(job["created_at"]), "finished_at": iso(job["finished_at"])}


async def drain_runs(db: Database, query: Mapping[str, str]) -> list[dict[str, Any]]:
    out = []
    for job, rows, truncated in await _jobs_with_devices(db, ["drain"], query, _DRAIN_ROWS):
        devices = []
        for row in rows:
            metrics = figures(row, DRAIN_FIGURES)
            rate, inferred = drain_rate(metrics)
            devices.append({"device_id": row["device_id"], "pct_per_h": rate,
                            "pct_per_h_inferred": inferred,
                            "battery_start_pct": numbers.finite(metrics["battery_start_pct"]),
                            "battery_end_pct": numbers.finite(metrics["battery_end_pct"]),
                            "ok": None if row["ok"] is None else bool(row["ok"]),
                            "at": iso(row["created_at"])})
        out.append({**_job_head(job), "devices": devices, "truncated": truncated})
    return out


async def job_runs(db: Database, workloads: list[str], query: Mapping[str, str]
                   ) -> list[dict[str, Any]]:
    """Soak and vision runs: each job with each device's newest row (its metrics, cut down past
    RUN_METRICS_WHOLE characters, and verdict) and how many rows it filed."""
    return [{**_job_head(job), "devices": [
                {"device_id": row["device_id"], "rows": row["n"], "result_id": row["id"],
                 "ok": None if row["ok"] is None else bool(row["ok"]), "error": row["error"],
                 "metrics": _object(row["metrics"]), "at": iso(row["created_at"]),
                 "trimmed": ["metrics"] if row["metrics_trimmed"] else []}
                for row in rows], "truncated": truncated}
            for job, rows, truncated in await _jobs_with_devices(db, workloads, query,
                                                                 _RUN_ROWS)]

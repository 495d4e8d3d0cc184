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


def _object(text: str | None) -> dict[str, Any]:
    value = json.loads(text) if text else {}
    return value if isinstance(value, dict) else {}


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
# devices costs the loop 1,000 short rows, not 10,000 x 10,000 comparisons.
_NEWEST_BY_DEVICE = """
    SELECT l.device_id, l.n, r.ok, r.error, r.metrics, r.created_at FROM (
        SELECT device_id, COUNT(*) AS n FROM results
        WHERE job_id = ? AND preempted = 0 AND substr(device_id, 1, 5) != 'host:'
        GROUP BY device_id ORDER BY device_id LIMIT ?) l
    JOIN results r ON r.id = (
        SELECT id FROM results WHERE job_id = ? AND device_id = l.device_id AND preempted = 0
        ORDER BY created_at + 0 DESC, id DESC LIMIT 1)
    ORDER BY l.device_id"""


async def _jobs_with_devices(db: Database, workloads: list[str], query: Mapping[str, str]
                             ) -> list[tuple[Any, list[Any], bool]]:
    """The newest jobs of the workloads, each with its devices' newest rows (RUN_DEVICES at
    most, ANSWER_DEVICES for all of them) and whether some were left out."""
    limit = int_param(query, "limit", 50, 1, RUNS_LIMIT)
    jobs = await db.read(
        "SELECT job_id, workload, status, created_at, finished_at FROM jobs "
        f"WHERE workload IN ({','.join('?' * len(workloads))}) AND is_group = 0 "
        "ORDER BY seq DESC LIMIT ?", [*workloads, limit])
    out = []
    room = ANSWER_DEVICES
    for job in jobs:
        take = min(RUN_DEVICES, room)
        rows = await db.read(_NEWEST_BY_DEVICE, (job["job_id"], take + 1, job["job_id"]))
        out.append((job, rows[:take], len(rows) > take))
        room -= len(rows[:take])
    return out


def drain_rate(metrics: dict[str, Any]) -> tuple[float | None, bool]:
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
    for job, rows, truncated in await _jobs_with_devices(db, ["drain"], query):
        devices = []
        for row in rows:
            metrics = _object(row["metrics"])
            rate, inferred = drain_rate(metrics)
            devices.append({"device_id": row["device_id"], "pct_per_h": rate,
                            "pct_per_h_inferred": inferred,
                            "battery_start_pct": numbers.finite(metrics.get("battery_start_pct")),
                            "battery_end_pct": numbers.finite(metrics.get("battery_end_pct")),
                            "ok": None if row["ok"] is None else bool(row["ok"]),
                            "at": iso(row["created_at"])})
        out.append({**_job_head(job), "devices": devices, "truncated": truncated})
    return out


async def job_runs(db: Database, workloads: list[str], query: Mapping[str, str]
                   ) -> list[dict[str, Any]]:
    """Soak and vision runs: each job with each device's newest row (its metrics and verdict)
    and how many rows it filed."""
    return [{**_job_head(job), "devices": [
                {"device_id": row["device_id"], "rows": row["n"],
                 "ok": None if row["ok"] is None else bool(row["ok"]), "error": row["error"],
                 "metrics": _object(row["metrics"]), "at": iso(row["created_at"])}
                for row in rows], "truncated": truncated}
            for job, rows, truncated in await _jobs_with_devices(db, workloads, query)]

"""Next-hour demand per repository, from weekly history and from workflow schedules.

Demand is the peak number of a repository's self-hosted jobs that needed a runner at once
(queued or running: from creation to completion) within a clock hour (UTC).

- history: the same weekday and hour in each of the last WEEKS weeks that the collected history
  covers (from the later of the backfill's start and the repository's oldest recorded run). The
  prediction is the median of those weekly peaks, made only with at least MIN_WEEKS covered
  weeks (a week before the history begins is unknown, not idle). Confidence: high with 6+
  weeks whose peaks agree (interquartile range at most half the median, or 1), medium with 4+,
  low with 3.
- schedule: every `on.schedule` cron of the default branch's workflow files that is due in the
  hour, read in its own time zone (GitHub's `timezone`, else UTC) with the collector's cron
  (full crontab syntax). Each due run brings its self-hosted jobs (matrix jobs counted); runs
  due in the same minute add up. Confidence high that they are due; GitHub may start them late.
- combined: the larger of the two (past scheduled runs are already part of the history).

Predictions are stored when made (the first one for an hour wins) and scored once the hour is
over and the history has caught up with it: the actual peak, computed the same way, is written
next to the prediction.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from fleet_min import cron
from fleet_min.controlplane.analysis.stats import median, peak_overlap, percentile
from fleet_min.controlplane.analysis.workflows import MAX_SCHEDULES, Workflow
from fleet_min.timeutil import iso

HOUR = 3600.0
WEEK = 7 * 86400.0
WEEKS = 8
MIN_WEEKS = 3
SCORE_AFTER_S = 2 * HOUR


def next_hour(now: float) -> float:
    return math.floor(now / HOUR) * HOUR + HOUR


def slot_peak(intervals: Iterable[tuple[float, float]], start: float, end: float) -> int:
    """Peak overlap of the intervals clipped to [start, end)."""
    clipped = ((max(a, start), min(b, end)) for a, b in intervals if a < end and b > start)
    return peak_overlap(clipped)[0]


def _confidence(weeks: int, peaks: Sequence[int], middle: float) -> str:
    ordered = sorted(peaks)
    q1, q3 = percentile(ordered, 25) or 0, percentile(ordered, 75) or 0
    if weeks >= 6 and q3 - q1 <= max(1.0, middle / 2):
        return "high"
    return "medium" if weeks >= 4 else "low"


def history_prediction(intervals: Sequence[tuple[float, float]], hour_start: float,
                       covered_since: float | None) -> dict[str, Any]:
    """The median of weekly peaks for the hour's weekday and time, or why there is none."""
    peaks, slots = [], []
    for week in range(1, WEEKS + 1):
        start = hour_start - week * WEEK
        if covered_since is None or start < covered_since:
            break
        peak = slot_peak(intervals, start, start + HOUR)
        peaks.append(peak)
        slots.append({"hour_start": iso(start), "peak": peak})
    base = {"source": "history", "weeks": len(peaks), "weekly_peaks": slots}
    if len(peaks) < MIN_WEEKS:
        return {**base, "value": None, "confidence": None,
                "reason": f"{len(peaks)} week(s) of history cover this hour; "
                          f"{MIN_WEEKS} are needed"}
    middle = median(peaks) or 0.0
    return {**base, "value": middle, "confidence": _confidence(len(peaks), peaks, middle),
            "reason": f"median of the peaks of the same hour in the last {len(peaks)} weeks"}


def _jobs_per_run(flow: Workflow) -> int:
    jobs = 0
    for job in flow.jobs:
        if job.self_hosted:
            size = job.matrix.size if job.matrix and job.matrix.size is not None else 1
            jobs += max(1, size)
    return jobs


def due_times(expression: str, zone: str, start: float, end: float) -> list[float]:
    """Due minutes of a cron in [start, end), read in time zone `zone`."""
    tz = ZoneInfo(zone)
    parsed = cron.parse(expression)
    out: list[float] = []
    t = start - 1
    while True:
        t = parsed.next_after(t, tz)
        if t >= end:
            return out
        out.append(t)


MAX_RUNS_LISTED = 500  # runs a schedule prediction lists (runs_total counts them all)


def schedule_prediction(flows: Sequence[Workflow], hour_start: float) -> dict[str, Any]:
    """The runs the workflows' schedules start in the hour, and the most jobs due in one
    minute. Each workflow's first MAX_SCHEDULES schedules are read (workflows.MAX_SCHEDULES)
    and the first MAX_RUNS_LISTED runs listed; the value counts every run read."""
    end = hour_start + HOUR
    runs: list[dict[str, Any]] = []
    total = 0
    errors: list[str] = []
    by_minute: dict[float, int] = {}
    for flow in flows:
        jobs = _jobs_per_run(flow)
        if len(flow.schedules) > MAX_SCHEDULES:
            errors.append(f"{flow.path}: more than {MAX_SCHEDULES} schedules; the first "
                          f"{MAX_SCHEDULES} are read")
        for schedule in flow.schedules[:MAX_SCHEDULES]:
            try:
                due = due_times(schedule.cron, schedule.timezone, hour_start, end)
            except (cron.CronError, ZoneInfoNotFoundError, ValueError) as exc:
                errors.append(f"{flow.path}: {schedule.cron!r} ({schedule.timezone}): {exc}")
                continue
            total += len(due)
            for t in due:
                by_minute[t] = by_minute.get(t, 0) + jobs
                if len(runs) < MAX_RUNS_LISTED:
                    runs.append({"file": flow.path, "workflow": flow.name,
                                 "cron": schedule.cron, "timezone": schedule.timezone,
                                 "due_at": iso(t), "jobs": jobs})
    return {"source": "schedule", "value": max(by_minute.values(), default=0),
            "confidence": "high", "runs": runs, "runs_total": total, "errors": errors,
            "reason": f"{total} scheduled run(s) due in the hour"}


def combine(history: Mapping[str, Any], schedule: Mapping[str, Any]) -> dict[str, Any]:
    values = [p["value"] for p in (history, schedule) if p["value"] is not None]
    if history["value"] is None and not schedule["runs"]:
        return {"source": "combined", "value": None, "confidence": None,
                "reason": "no usable history and no schedule due"}
    chosen = history if (history["value"] or 0) >= schedule["value"] and \
        history["value"] is not None else schedule
    return {"source": "combined", "value": max(values), "confidence": chosen["confidence"],
            "reason": f"the larger of history and schedule (from {chosen['source']})"}


def score_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """How good the scored predictions were: mean absolute error, bias, share within one job."""
    scored = [r for r in rows if r["actual"] is not None]
    if not scored:
        return {"scored": 0, "mae": None, "bias": None, "within_one_pct": None}
    errors = [r["predicted"] - r["actual"] for r in scored]
    return {"scored": len(scored),
            "mae": round(sum(abs(e) for e in errors) / len(errors), 2),
            "bias": round(sum(errors) / len(errors), 2),
            "within_one_pct": round(100 * sum(abs(e) <= 1 for e in errors) / len(errors), 1)}

"""Replay a repository's recorded jobs against hypothetical runner counts.

Each recorded job that ran becomes an arrival (its creation, i.e. start minus queue time) and a
service time (its recorded duration). For a count of c runners the jobs are served first come,
first served by c identical runners: a job starts at its arrival or when the earliest runner
frees up, whichever is later. The replay is event-driven: a heap holds the c runners' free-at
times, so each job costs one heap operation (O(n log c)); arrivals are sorted once and shared by
every count. The same input always gives the same output (ties are broken by job id).

What it cannot know: labels (every job may use every runner), jobs that would have been
cancelled or superseded by a faster queue, and runners' start-up time.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fleet_min.controlplane.stats import peak_overlap, percentile

MAX_COUNT = 256
MAX_COUNTS = 16


@dataclass(frozen=True)
class Trace:
    """Recorded jobs as parallel arrays sorted by arrival."""
    arrivals: list[float]
    durations: list[float]
    recorded_waits: list[float]

    @classmethod
    def build(cls, jobs: Sequence[tuple[int, float, float, float]]) -> Trace:
        """jobs: (job id, created, started, completed) of jobs that ran."""
        ordered = sorted(jobs, key=lambda j: (j[1], j[0]))
        return cls([j[1] for j in ordered], [max(0.0, j[3] - j[2]) for j in ordered],
                   [max(0.0, j[2] - j[1]) for j in ordered])


def replay(trace: Trace, runners: int) -> list[float]:
    """Each job's wait (s) with `runners` runners, in arrival order."""
    arrivals, durations = trace.arrivals, trace.durations
    if runners <= 0:
        return [math.inf] * len(arrivals)
    free = [arrivals[0] if arrivals else 0.0] * min(runners, max(1, len(arrivals)))
    heapq.heapify(free)
    waits = []
    replace = heapq.heapreplace
    for arrival, duration in zip(arrivals, durations, strict=True):
        earliest = free[0]
        start = arrival if arrival >= earliest else earliest
        replace(free, start + duration)
        waits.append(start - arrival)
    return waits


def _figures(waits: list[float], slo_s: float) -> dict[str, Any]:
    ordered = sorted(waits)
    over = len(waits) - _count_at_most(ordered, slo_s)
    finite = [w for w in ordered if w != math.inf]

    def pct(p: int) -> float | None:
        value = percentile(ordered, p)
        return None if value is None or value == math.inf else round(value, 1)

    return {"wait_s": {"p50": pct(50), "p90": pct(90), "p95": pct(95),
                       "max": round(finite[-1], 1) if len(finite) == len(ordered) and finite
                       else None},
            "over_slo": over, "over_slo_pct": round(100 * over / len(waits), 2) if waits else None}


def _count_at_most(ordered: list[float], limit: float) -> int:
    lo, hi = 0, len(ordered)
    while lo < hi:
        mid = (lo + hi) // 2
        if ordered[mid] <= limit:
            lo = mid + 1
        else:
            hi = mid
    return lo


def compare(trace: Trace, counts: Sequence[int], slo_s: float) -> dict[str, Any]:
    """Queue figures per runner count, plus the recorded reality for reference."""
    busy_s = sum(trace.durations)
    span_s = (max(a + d for a, d in zip(trace.arrivals, trace.durations, strict=True))
              - trace.arrivals[0]) if trace.arrivals else 0.0
    unconstrained, _ = peak_overlap(
        (a, a + d) for a, d in zip(trace.arrivals, trace.durations, strict=True))
    results = []
    for count in counts:
        waits = replay(trace, count)
        any_wait = any(w > 0 for w in waits)
        results.append({
            "runners": count, **_figures(waits, slo_s),
            "busy_runner_hours": round(busy_s / 3600, 2) if count else 0.0,
            "provisioned_runner_hours": round(count * span_s / 3600, 2),
            "utilization_pct": round(100 * busy_s / (count * span_s), 1)
            if count and span_s else None,
            "peak_concurrency": count if any_wait and count else min(count, unconstrained)})
    return {"jobs": len(trace.arrivals), "slo_s": slo_s,
            "demand_peak": unconstrained,
            "recorded": _figures(trace.recorded_waits, slo_s),
            "results": results}

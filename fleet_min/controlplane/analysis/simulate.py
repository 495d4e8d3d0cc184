"""Replay a repository's recorded jobs against hypothetical runner counts.

Each recorded job that ran becomes an arrival (its creation, i.e. start minus queue time) and a
service time (its recorded duration). For a count of c runners the jobs are served first come,
first served by c identical runners: a job starts at its arrival or when the earliest runner
frees up, whichever is later. The replay is event-driven: a heap holds the c runners' free-at
times, so each job costs one heap operation (O(n log c)); arrivals are sorted once and shared by
every count. Counts are replayed from the smallest up: once a count lets every job start on
arrival, every larger count gives exactly the same waits (the jobs running at any arrival are the
same, and fewer than that count), so those are not replayed again. The same input always gives
the same output (ties are broken by job id).

What it cannot know: labels (every job may use every runner), jobs that would have been
cancelled or superseded by a faster queue, and runners' start-up time.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import add, itemgetter
from typing import Any

from fleet_min.controlplane.analysis.stats import Ordered, peak_overlap

MAX_COUNT = 256
MAX_COUNTS = 16


@dataclass(frozen=True)
class Trace:
    """Recorded jobs as parallel arrays sorted by arrival."""
    arrivals: Sequence[float]
    durations: Sequence[float]
    recorded_waits: Sequence[float]

    @classmethod
    def build(cls, jobs: Sequence[Sequence[Any]]) -> Trace:
        """jobs: (job id, created, started, completed) of jobs that ran (any sequence whose
        first four items are those, such as a database row)."""
        return cls.from_ordered(sorted(jobs, key=itemgetter(1, 0)))

    @classmethod
    def from_ordered(cls, jobs: Iterable[Sequence[Any]]) -> Trace:
        """build() of jobs already in order of (created, job id), such as a cursor over rows
        sorted by the database: a loop in Python, where the GIL changes hands, and no sort
        (one sorted() of a million rows with a C key holds the GIL for seconds)."""
        # Arrays of doubles: the garbage collector walks every item of a young list.
        arrivals, durations, waits = array("d"), array("d"), array("d")
        for job in jobs:
            arrivals.append(job[1])
            # `x if x > 0.0 else 0.0` is max(0.0, x) without a call per job.
            durations.append(d if (d := job[3] - job[2]) > 0.0 else 0.0)
            waits.append(w if (w := job[2] - job[1]) > 0.0 else 0.0)
        return cls(arrivals, durations, waits)


def replay(trace: Trace, runners: int) -> Sequence[float]:
    """Each job's wait (s) with `runners` runners, in arrival order."""
    arrivals, durations = trace.arrivals, trace.durations
    if runners <= 0:
        return array("d", [math.inf]) * len(arrivals)
    waits = array("d")
    append = waits.append
    if runners == 1 or len(arrivals) <= 1:  # one runner: its free-at time needs no heap
        free_at = arrivals[0] if arrivals else 0.0
        for arrival, duration in zip(arrivals, durations, strict=True):
            start = arrival if arrival >= free_at else free_at
            free_at = start + duration
            append(start - arrival)
        return waits
    free = [arrivals[0]] * min(runners, len(arrivals))
    replace = heapq.heapreplace
    for arrival, duration in zip(arrivals, durations, strict=True):
        earliest = free[0]
        start = arrival if arrival >= earliest else earliest
        replace(free, start + duration)
        append(start - arrival)
    return waits


def _figures(waits: Sequence[float], slo_s: float) -> tuple[dict[str, Any], bool]:
    """(the figures of these waits, whether any job waited)."""
    ordered = Ordered(waits)  # sorted in pieces: one sort of a million holds the GIL
    over = len(ordered) - ordered.count_le(slo_s)
    last = ordered.last()

    def pct(p: int) -> float | None:
        value = ordered.percentile(p)
        return None if value is None or value == math.inf else round(value, 1)

    return ({"wait_s": {"p50": pct(50), "p90": pct(90), "p95": pct(95),
                        "max": round(last, 1) if last is not None and last != math.inf
                        else None},
             "over_slo": over,
             "over_slo_pct": round(100 * over / len(waits), 2) if waits else None},
            last is not None and last > 0)


def compare(trace: Trace, counts: Sequence[int], slo_s: float) -> dict[str, Any]:
    """Queue figures per runner count, plus the recorded reality for reference."""
    busy_s = sum(trace.durations)
    # A generator, not map(add, ...): a C loop over a million jobs holds the GIL throughout.
    span_s = (max(a + d for a, d in zip(trace.arrivals, trace.durations, strict=True))
              - trace.arrivals[0]
              if trace.arrivals else 0.0)
    unconstrained, _ = peak_overlap(
        zip(trace.arrivals, map(add, trace.arrivals, trace.durations), strict=True))
    replayed: dict[int, tuple[dict[str, Any], bool]] = {}
    no_wait_from: int | None = None  # the smallest count replayed with no job waiting
    for count in sorted(set(counts)):
        if no_wait_from is not None and count > no_wait_from:
            replayed[count] = replayed[no_wait_from]  # the same waits, all of them zero
            continue
        replayed[count] = _figures(replay(trace, count), slo_s)
        if count > 0 and not replayed[count][1]:
            no_wait_from = count
    results = []
    for count in counts:
        figures, any_wait = replayed[count]
        results.append({
            "runners": count, **figures, "wait_s": dict(figures["wait_s"]),
            "busy_runner_hours": round(busy_s / 3600, 2) if count else 0.0,
            "provisioned_runner_hours": round(count * span_s / 3600, 2),
            "utilization_pct": round(100 * busy_s / (count * span_s), 1)
            if count and span_s else None,
            "peak_concurrency": count if any_wait and count else min(count, unconstrained)})
    return {"jobs": len(trace.arrivals), "slo_s": slo_s,
            "demand_peak": unconstrained,
            "recorded": _figures(trace.recorded_waits, slo_s)[0],
            "results": results}

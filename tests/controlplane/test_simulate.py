"""The replay's fast paths (one runner without a heap, counts above the first one with no wait
not replayed again, peak concurrency from bisects) give exactly what the straightforward
versions below give, on random traces with the awkward cases: equal arrivals, zero and integer
durations, count 0, repeated and unsorted counts, more runners than jobs, no jobs at all."""

from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_right
from typing import Any

import pytest

from fleet_min.controlplane.analysis import stats
from fleet_min.controlplane.analysis.simulate import Trace, compare


def _peak_overlap(intervals: Any) -> tuple[int, float | None]:
    events: list[tuple[float, int]] = []
    for start, end in intervals:
        if end > start:
            events.append((start, 1))
            events.append((end, -1))
    events.sort()  # at equal times -1 sorts before +1: touching intervals do not overlap
    best, at, current = 0, None, 0
    for when, delta in events:
        current += delta
        if current > best:
            best, at = current, when
    return best, at


def _build(jobs: list[tuple[int, float, float, float]]) -> tuple[list[Any], ...]:
    ordered = sorted(jobs, key=lambda j: (j[1], j[0]))
    return ([j[1] for j in ordered], [max(0.0, j[3] - j[2]) for j in ordered],
            [max(0.0, j[2] - j[1]) for j in ordered])


def _replay(arrivals: list[Any], durations: list[Any], runners: int) -> list[float]:
    if runners <= 0:
        return [math.inf] * len(arrivals)
    free = [arrivals[0] if arrivals else 0.0] * min(runners, max(1, len(arrivals)))
    heapq.heapify(free)
    waits = []
    for arrival, duration in zip(arrivals, durations, strict=True):
        earliest = free[0]
        start = arrival if arrival >= earliest else earliest
        heapq.heapreplace(free, start + duration)
        waits.append(start - arrival)
    return waits


def _figures(waits: list[float], slo_s: float) -> dict[str, Any]:
    ordered = sorted(waits)
    over = len(waits) - sum(1 for w in ordered if w <= slo_s)
    finite = [w for w in ordered if w != math.inf]

    def pct(p: int) -> float | None:
        value = stats.percentile(ordered, p)
        return None if value is None or value == math.inf else round(value, 1)

    return {"wait_s": {"p50": pct(50), "p90": pct(90), "p95": pct(95),
                       "max": round(finite[-1], 1) if len(finite) == len(ordered) and finite
                       else None},
            "over_slo": over, "over_slo_pct": round(100 * over / len(waits), 2) if waits else None}


def _compare(jobs: list[tuple[int, float, float, float]], counts: list[int], slo_s: float
             ) -> dict[str, Any]:
    arrivals, durations, recorded = _build(jobs)
    busy_s = sum(durations)
    span_s = (max(a + d for a, d in zip(arrivals, durations, strict=True)) - arrivals[0]
              ) if arrivals else 0.0
    unconstrained, _ = _peak_overlap(
        (a, a + d) for a, d in zip(arrivals, durations, strict=True))
    results = []
    for count in counts:
        waits = _replay(arrivals, durations, count)
        any_wait = any(w > 0 for w in waits)
        results.append({
            "runners": count, **_figures(waits, slo_s),
            "busy_runner_hours": round(busy_s / 3600, 2) if count else 0.0,
            "provisioned_runner_hours": round(count * span_s / 3600, 2),
            "utilization_pct": round(100 * busy_s / (count * span_s), 1)
            if count and span_s else None,
            "peak_concurrency": count if any_wait and count else min(count, unconstrained)})
    return {"jobs": len(arrivals), "slo_s": slo_s, "demand_peak": unconstrained,
            "recorded": _figures(recorded, slo_s), "results": results}


def _jobs(rng: random.Random, n: int) -> list[tuple[int, Any, Any, Any]]:
    jobs, t = [], 1_700_000_000.0
    for job_id in rng.sample(range(10 * n + 1), n):
        t += rng.choice([0, 0, 1, rng.expovariate(1 / 40)])  # bursts of equal arrivals
        queue = rng.choice([0, 0.0, 3, rng.expovariate(1 / 20), -1.0])  # -1: a clock skew
        duration = rng.choice([0, 0.0, 60, rng.lognormvariate(5, 0.8)])
        created = int(t) if rng.random() < 0.2 else t
        jobs.append((job_id, created, created + queue, created + queue + duration))
    rng.shuffle(jobs)
    return jobs


@pytest.mark.parametrize("seed", range(40))
def test_compare_equals_the_straightforward_replay(seed: int) -> None:
    rng = random.Random(seed)
    jobs = _jobs(rng, rng.choice([0, 1, 2, 7, 50, 400]))
    counts = [rng.randrange(0, 12) for _ in range(rng.randrange(1, 8))]
    counts += [rng.choice(counts), 256]
    slo = rng.choice([0, 30, 300])
    assert compare(Trace.build(jobs), counts, slo) == _compare(jobs, counts, slo)


def test_counts_above_the_first_without_waits_are_not_replayed_but_equal() -> None:
    rng = random.Random(99)
    jobs = _jobs(rng, 3000)
    counts = [64, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128]
    got = compare(Trace.build(jobs), counts, 120)
    assert got == _compare(jobs, counts, 120)
    no_wait = [r["runners"] for r in got["results"] if r["wait_s"]["max"] == 0]
    assert no_wait and max(no_wait) == 128 and min(no_wait) < 128  # the shortcut was taken
    assert got["results"][0] is not got["results"][-2]  # repeated counts: separate objects
    assert got["results"][0]["wait_s"] is not got["results"][-2]["wait_s"]


@pytest.mark.parametrize("seed", range(30))
def test_peak_overlap_equals_the_event_sweep(seed: int) -> None:
    rng = random.Random(seed)
    intervals = []
    for _ in range(rng.randrange(0, 300)):
        start = rng.choice([rng.randrange(0, 50), rng.uniform(0, 50)])
        intervals.append((start, start + rng.choice([0, -1, 1, rng.uniform(0, 20)])))
    assert stats.peak_overlap(iter(intervals)) == _peak_overlap(intervals)


# --- the pieces that keep a million jobs from holding the GIL ----------------------------------

@pytest.mark.parametrize("seed", range(20))
def test_order_statistics_found_across_sorted_pieces_equal_one_sort(seed: int) -> None:
    rng = random.Random(seed)
    values = [rng.choice([0, 0.0, 2.5, math.inf, rng.random() * 100])
              for _ in range(rng.randrange(1, 300))]
    ordered = stats.Ordered(values, piece=rng.choice([1, 2, 3, 7, 64]))
    expect = sorted(values)
    assert [ordered.at(k) for k in range(1, len(values) + 1)] == expect
    assert list(ordered.ascending()) == expect and ordered.last() == expect[-1]
    assert [ordered.percentile(p) for p in (1, 50, 90, 95, 100)] == \
        [stats.percentile(expect, p) for p in (1, 50, 90, 95, 100)]
    assert all(ordered.count_le(x) == bisect_right(expect, x) for x in (-1, 0, 50, math.inf))


@pytest.mark.parametrize("seed", range(20))
def test_peak_overlap_walked_in_pieces_equals_the_event_sweep(seed: int) -> None:
    rng = random.Random(seed)
    arrivals, durations, _ = _build(_jobs(rng, rng.choice([1, 2, 50, 400])))
    intervals = [(a, a + d) for a, d in zip(arrivals, durations, strict=True)]
    assert stats.peak_overlap(intervals, piece=rng.choice([1, 3, 16])) == \
        _peak_overlap(intervals)


def test_a_trace_of_rows_in_arrival_order_equals_one_built_by_sorting() -> None:
    jobs = _jobs(random.Random(5), 500)
    trace = Trace.from_ordered(sorted(jobs, key=lambda j: (j[1], j[0])))
    assert [list(trace.arrivals), list(trace.durations), list(trace.recorded_waits)] == \
        list(_build(jobs))

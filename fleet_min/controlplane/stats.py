"""The few statistics the analysis pages use, defined once so every figure means the same thing.

- Percentiles are nearest-rank: p50 of [1, 2, 3, 4] is 2, an actual observation, never an
  interpolated value nobody saw. An empty sample has no percentile (None).
- Peak concurrency is the largest number of [start, end) intervals that overlap at one instant;
  an interval that ends exactly when another starts does not overlap it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(ordered: Sequence[float], pct: float) -> float | None:
    """Nearest-rank percentile of an already sorted sample."""
    if not ordered:
        return None
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def percentiles(values: Iterable[float], pcts: Sequence[int] = (50, 90, 95),
                digits: int = 1) -> dict[str, float | None]:
    """{"p50": ..., "p90": ..., ...} of the sample, rounded; None when it is empty."""
    ordered = sorted(values)
    out: dict[str, float | None] = {}
    for pct in pcts:
        value = percentile(ordered, pct)
        out[f"p{pct}"] = None if value is None else round(value, digits)
    return out


def median(values: Iterable[float]) -> float | None:
    """The ordinary median (mean of the two middle values for an even count)."""
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        return None
    mid = n // 2
    return float(ordered[mid]) if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def peak_overlap(intervals: Iterable[tuple[float, float]]) -> tuple[int, float | None]:
    """(largest number of intervals open at once, the first instant it was reached)."""
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


def rate(part: int, whole: int, digits: int = 4) -> float | None:
    return round(part / whole, digits) if whole else None

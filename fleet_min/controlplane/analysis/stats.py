"""The few statistics the analysis pages use, defined once so every figure means the same thing.

- Percentiles are nearest-rank: p50 of [1, 2, 3, 4] is 2, an actual observation, never an
  interpolated value nobody saw. An empty sample has no percentile (None).
- Peak concurrency is the largest number of [start, end) intervals that overlap at one instant;
  an interval that ends exactly when another starts does not overlap it.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import sub

from fleet_min.numbers import median as median  # the one median (see fleet_min.numbers)


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


def peak_overlap(intervals: Iterable[tuple[float, float]]) -> tuple[int, float | None]:
    """(largest number of intervals open at once, the first instant it was reached)."""
    starts: list[float] = []
    ends: list[float] = []
    for start, end in intervals:
        if end > start:
            starts.append(start)
            ends.append(end)
    if not starts:
        return 0, None
    starts.sort()
    ends.sort()
    # Just after the k-th start (in time order) k intervals have started and those ending at or
    # before that instant have ended (touching intervals do not overlap). The counts come from
    # C-level loops (map, bisect) over two sorted lists of numbers, not a sort of 2n tuples.
    ended = map(bisect_right, repeat(ends, len(starts)), starts)
    open_after = list(map(sub, range(1, len(starts) + 1), ended))
    best = max(open_after)
    return best, starts[open_after.index(best)]


def rate(part: int, whole: int, digits: int = 4) -> float | None:
    return round(part / whole, digits) if whole else None

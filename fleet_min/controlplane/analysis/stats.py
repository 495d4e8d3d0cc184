"""The few statistics the analysis pages use, defined once so every figure means the same thing.

- Percentiles are nearest-rank: p50 of [1, 2, 3, 4] is 2, an actual observation, never an
  interpolated value nobody saw. An empty sample has no percentile (None).
- Peak concurrency is the largest number of [start, end) intervals that overlap at one instant;
  an interval that ends exactly when another starts does not overlap it.

A year of a busy repository is a million values. One sorted() of them, or one C-level loop such
as map(bisect, ...), holds the GIL for a quarter of a second or more, and a worker thread doing
it freezes the event loop as surely as the loop's own thread would. So large samples are sorted
in pieces of PIECE values (a few ms each) and their order statistics are found across the pieces
(Ordered); peak_overlap merges them in Python, where the GIL changes hands. Long columns of
numbers are arrays of doubles, not lists: the garbage collector walks every item of a young list
(a million floats, 50 to 170 ms a pass), and an array holds no objects to walk.
"""

from __future__ import annotations

import heapq
import math
from array import array
from bisect import bisect_left, bisect_right
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


PIECE = 1 << 15  # values sorted by one call: about 5 ms


class Ordered:
    """A sample's order statistics without one sort of the whole sample: it is sorted in pieces
    of at most `piece` values, and a rank is found across them by bisection."""

    def __init__(self, values: Iterable[float], piece: int = PIECE) -> None:
        sample = values if isinstance(values, (list, array)) else array("d", values)
        self.pieces = [array("d", sorted(sample[i:i + piece]))
                       for i in range(0, len(sample), piece)]
        self.size = len(sample)

    def __len__(self) -> int:
        return self.size

    def at(self, rank: int) -> float:
        """The rank-th smallest value (1-based): sorted(values)[rank - 1]."""
        pieces = self.pieces
        if len(pieces) == 1:
            return pieces[0][rank - 1]
        lo, hi = [0] * len(pieces), [len(p) for p in pieces]
        k = rank - 1  # among the values still between lo and hi
        while True:
            # The middle value of the widest range: each round drops at least half of it.
            widest = max(range(len(pieces)), key=lambda i: hi[i] - lo[i])
            pivot = pieces[widest][(lo[widest] + hi[widest]) // 2]
            below = [bisect_left(p, pivot, lo[i], hi[i]) for i, p in enumerate(pieces)]
            upto = [bisect_right(p, pivot, lo[i], hi[i]) for i, p in enumerate(pieces)]
            under = sum(b - a for a, b in zip(lo, below, strict=True))
            through = sum(b - a for a, b in zip(lo, upto, strict=True))
            if k < under:
                hi = below
            elif k < through:
                return pivot
            else:
                k -= through
                lo = upto

    def percentile(self, pct: float) -> float | None:
        """Nearest-rank percentile, as percentile() of the sorted sample."""
        if not self.size:
            return None
        return self.at(max(1, math.ceil(pct / 100 * self.size)))

    def count_le(self, value: float) -> int:
        return sum(bisect_right(p, value) for p in self.pieces)

    def last(self) -> float | None:
        return max(p[-1] for p in self.pieces) if self.pieces else None

    def ascending(self) -> Iterable[float]:
        """Every value in order, merged in Python (the GIL changes hands as it goes)."""
        return self.pieces[0] if len(self.pieces) == 1 else heapq.merge(*self.pieces)


def percentiles(values: Iterable[float], pcts: Sequence[int] = (50, 90, 95),
                digits: int = 1) -> dict[str, float | None]:
    """{"p50": ..., "p90": ..., ...} of the sample, rounded; None when it is empty."""
    ordered = Ordered(values)
    out: dict[str, float | None] = {}
    for pct in pcts:
        value = ordered.percentile(pct)
        out[f"p{pct}"] = None if value is None else round(value, digits)
    return out


def peak_overlap(intervals: Iterable[tuple[float, float]], piece: int = PIECE
                 ) -> tuple[int, float | None]:
    """(largest number of intervals open at once, the first instant it was reached)."""
    starts, ends = array("d"), array("d")
    for start, end in intervals:
        if end > start:
            starts.append(start)
            ends.append(end)
    if not starts:
        return 0, None
    if len(starts) > piece:
        return _peak_in_steps(Ordered(starts, piece), Ordered(ends, piece))
    starts, ends = array("d", sorted(starts)), array("d", sorted(ends))
    # Just after the k-th start (in time order) k intervals have started and those ending at or
    # before that instant have ended (touching intervals do not overlap). The counts come from
    # C-level loops (map, bisect) over two sorted lists of numbers, not a sort of 2n tuples.
    ended = map(bisect_right, repeat(ends, len(starts)), starts)
    open_after = list(map(sub, range(1, len(starts) + 1), ended))
    best = max(open_after)
    return best, starts[open_after.index(best)]


def _peak_in_steps(starts: Ordered, ends: Ordered) -> tuple[int, float | None]:
    """peak_overlap of many intervals: the same count, by a walk in Python over both merged."""
    best, at, ended = 0, None, 0
    later = iter(ends.ascending())
    next_end = next(later, math.inf)
    for k, start in enumerate(starts.ascending(), 1):
        while next_end <= start:  # touching intervals do not overlap
            ended += 1
            next_end = next(later, math.inf)
        if k - ended > best:
            best, at = k - ended, start
    return best, at


def rate(part: int, whole: int, digits: int = 4) -> float | None:
    return round(part / whole, digits) if whole else None

"""Numbers read back from stored JSON, and the median the pages show of them.

A stored document's number can be anything JSON allows: the intake refuses NaN, Infinity and
floats past the double range, but an integer of 400 digits is valid JSON and is kept with every
digit. `float()` of such an integer raises OverflowError, and the mean of two finite doubles near
the top of the range is infinite, which the json module would write as `Infinity` (not JSON).
Every figure computed from stored numbers goes through here so it stays a finite float.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def finite(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else: a bool, text, NaN, infinity, or
    an integer too large for a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def median(values: Iterable[float]) -> float | None:
    """The ordinary median of finite floats (the mean of the two middle values for an even
    count), never infinite: two middle values near the top of the range are halved before they
    are added. None for an empty sample."""
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        return None
    mid = n // 2
    if n % 2:
        return float(ordered[mid])
    low, high = ordered[mid - 1], ordered[mid]
    mean = (low + high) / 2
    return mean if math.isfinite(mean) else low / 2 + high / 2

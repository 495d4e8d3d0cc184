"""fleet_min.numbers: stored JSON numbers as finite floats, and a median that never overflows."""

from __future__ import annotations

import math
import statistics

import pytest

from fleet_min import numbers


@pytest.mark.parametrize(("value", "expected"), [
    (3, 3.0), (2.5, 2.5), (-0.0, 0.0), (1.7e308, 1.7e308), (2 ** 1023, float(2 ** 1023)),
    (10 ** 400, None), (-(10 ** 400), None), (math.nan, None), (math.inf, None),
    (-math.inf, None), (True, None), (False, None), ("12", None), (None, None), ([1], None),
])
def test_finite_takes_what_a_float_holds(value, expected):
    assert numbers.finite(value) == expected


@pytest.mark.parametrize("sample", [
    [1], [1, 2], [3, 1, 2], [1, 2, 3, 10], [0.1, 0.2], [-5, 5], [2.5, 2.5, 7.25, -1.0],
])
def test_median_is_the_ordinary_median(sample):
    assert numbers.median(sample) == statistics.median(sample)


def test_median_of_the_largest_doubles_stays_finite():
    top = 1.7e308
    assert numbers.median([top, top]) == top
    assert numbers.median([-top, -top]) == -top
    assert numbers.median([1.0, top, top, top]) == top
    assert numbers.median([]) is None

"""The pixel difference of two PNG screenshots (fleet_min/collector/artifacts/pixels.py)."""

from __future__ import annotations

import io

import pytest

from fleet_min.collector.artifacts import pixels
from tests.support.images import png_bytes, with_stripe


def compare(a: bytes, b: bytes, **kw) -> pixels.Difference:
    return pixels.compare(io.BytesIO(a), io.BytesIO(b), **kw)


def test_identical_pictures_do_not_differ():
    found = compare(png_bytes(40, 20), png_bytes(40, 20))
    assert (found.width, found.height, found.differing, found.pct) == (40, 20, 0, 0.0)


def test_the_share_of_differing_pixels_is_counted():
    found = compare(png_bytes(40, 20), png_bytes(40, 20, with_stripe(4)))
    assert found.differing == 4 * 20 and found.pct == 10.0


def test_one_channel_off_by_one_is_a_difference():
    found = compare(png_bytes(10, 10), png_bytes(10, 10, lambda x, y: (40, 90, 200, 254)))
    assert found.pct == 100.0


def test_the_same_pixels_in_another_encoding_match():
    # RGB against RGBA with an opaque alpha: the same picture, other bytes.
    assert compare(png_bytes(30, 10), png_bytes(30, 10, alpha=False)).differing == 0


def test_a_different_size_differs_everywhere():
    found = compare(png_bytes(30, 10), png_bytes(30, 12))
    assert (found.width, found.height, found.pct) == (30, 12, 100.0)


@pytest.mark.parametrize(("first", "second", "words"), [
    (b"not a png", png_bytes(4, 4), "the baseline is not a PNG image"),
    (png_bytes(4, 4), b"\x89PNG\r\n\x1a\n", "the capture is not a PNG image"),
    (png_bytes(50, 50, with_stripe(9)), png_bytes(50, 50)[:120], "cut short or damaged"),
])
def test_files_that_cannot_be_compared_say_why(first, second, words):
    with pytest.raises(pixels.NotComparable, match=words):
        compare(first, second)


def test_a_comparison_past_its_budget_gives_up():
    with pytest.raises(pixels.NotComparable, match="took longer than"):
        compare(png_bytes(20, 20), png_bytes(20, 20, with_stripe(3)), budget_s=-1.0)


def test_a_picture_past_the_pixel_limit_is_refused(monkeypatch):
    monkeypatch.setattr(pixels, "MAX_PIXELS", 99)
    with pytest.raises(pixels.NotComparable, match="more than the 99 this compares"):
        compare(png_bytes(10, 10), png_bytes(10, 10))

"""The pixel difference of two PNG screenshots (fleet_min/collector/artifacts/pixels.py)."""

from __future__ import annotations

import io
import re
import struct
import tracemalloc
import zlib

import png
import pytest

from fleet_min.collector.artifacts import pixels
from tests.support.images import palette_png, png_bytes, png_chunk, with_stripe


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


def _interlaced_zeros(width: int, height: int) -> bytes:
    """A valid interlaced (Adam7) RGBA PNG of transparent black, made chunk by chunk: the
    scanlines of its seven passes compress to almost nothing, whatever the size."""
    passes = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4),
              (1, 0, 2, 2), (0, 1, 1, 2)]  # (x0, y0, dx, dy)
    squeeze = zlib.compressobj()
    idat = b""
    for x0, y0, dx, dy in passes:
        columns, rows = -(-(width - x0) // dx), -(-(height - y0) // dy)
        if columns > 0 and rows > 0:
            for _ in range(rows):  # a filter byte and the row's bytes, all zero
                idat += squeeze.compress(bytes(1 + 4 * columns))
    idat += squeeze.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 1)  # 8-bit RGBA, Adam7
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", idat)
            + png_chunk(b"IEND", b""))


@pytest.mark.parametrize("make", [
    lambda: _interlaced_zeros(2000, 2000),  # decoded whole, this took some 200 MB
    lambda: _written_interlaced(8, 8),
])
def test_an_interlaced_picture_is_refused_before_it_is_decoded(make):
    """pypng decodes an interlaced PNG whole, some 50 bytes a pixel: a 150 KB file of 40M
    pixels (under the pixel limit) took a comparison to 2 GB. It is refused from its header."""
    png_file = make()
    png.Reader(bytes=png_file).read_flat()  # a valid picture, all the same
    with pytest.raises(pixels.NotComparable, match="the capture is an interlaced PNG"):
        compare(png_bytes(8, 8), png_file)


def _written_interlaced(width: int, height: int) -> bytes:
    out = io.BytesIO()
    png.Writer(width, height, greyscale=False, alpha=True, interlace=True).write(
        out, [[0] * (4 * width)] * height)
    return out.getvalue()


@pytest.mark.parametrize(("width", "height", "words"), [
    (40_000_000, 1, "the capture is 40,000,000 pixels wide, wider than the 16,384"),
    (16_385, 1, "the capture is 16,385 pixels wide"),
    (1, 65_537, "the capture is 65,537 pixels tall, taller than the 65,536"),
])
def test_a_row_too_wide_or_a_picture_too_tall_is_refused_from_its_header(width, height, words):
    """pypng turns a palette row into a tuple a pixel in Python: the 39 KB PNG of 40,000,000 x
    1 passed the pixel limit and took one comparison to 2.3 GB and 18 s."""
    png_file = palette_png(width, height)
    tracemalloc.start()
    try:
        with pytest.raises(pixels.NotComparable, match=words):
            compare(palette_png(8, 8), png_file)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # the header is read; no row is


def test_an_idat_chunk_that_inflates_to_much_more_than_the_picture_is_read_in_pieces():
    """pypng inflates each IDAT chunk in one call: 64 KB of deflated zeros behind a 16 x 16
    header was a 64 MB allocation (twice) before the first row. The reader hands the chunk on
    in pieces, and rows past the header's height are never decoded."""
    bomb = palette_png(16, 16, inflated=64 << 20)
    assert len(bomb) < 100_000
    tracemalloc.start()
    try:
        found = compare(palette_png(16, 16), bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (found.width, found.height, found.differing) == (16, 16, 0)
    assert peak < 4 << 20, peak


def test_a_wide_palette_picture_within_the_limits_compares():
    found = compare(palette_png(16_384, 3), palette_png(16_384, 3))
    assert (found.width, found.height, found.differing) == (16_384, 3, 0)


def _one_pixel(before_image: bytes = b"", idat: bytes | None = None, header: bool = True
               ) -> bytes:
    """A 1 x 1 palette PNG of black with `before_image` chunks before its image data (without
    `header`, no IHDR and no palette)."""
    row = zlib.compress(b"\x00\x00")  # the filter byte, palette index 0
    head = (png_chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 3, 0, 0, 0))
            + png_chunk(b"PLTE", bytes(6))) if header else b""
    return (b"\x89PNG\r\n\x1a\n" + head + before_image
            + png_chunk(b"IDAT", row if idat is None else idat) + png_chunk(b"IEND", b""))


@pytest.mark.parametrize("filler", [png_chunk(b"IDAT", b""), png_chunk(b"tEXt", b"k\x00v")],
                         ids=["empty-idat", "text"])
def test_the_budget_holds_while_chunks_are_read_not_only_between_rows(filler):
    """Eight million empty chunks before a one-pixel row took a comparison two minutes, past
    a budget checked only between rows (and the one lock every comparison waits for held as
    long). The budget counts from the first chunk read: past it, no further chunk is read."""
    hostile = io.BytesIO(_one_pixel(filler * 200_000))
    with pytest.raises(pixels.NotComparable, match="took longer than"):
        pixels.compare(io.BytesIO(_one_pixel()), hostile, budget_s=-1.0)
    assert hostile.tell() < 100, hostile.tell()  # stopped at its first chunk, not its last
    assert compare(_one_pixel(), _one_pixel(filler * 1000)).differing == 0  # in time: compared


def test_an_idat_chunk_is_read_from_the_file_in_pieces():
    """pypng reads a chunk whole: a one-pixel PNG whose IDAT chunk carries 400 MiB after its
    row held 400 MiB (two such files at once, 849 MB). The reader reads IDAT a piece at a
    time, checking the chunk's checksum as it goes."""
    padded = _one_pixel(idat=zlib.compress(b"\x00\x00") + bytes(16 << 20))
    plain = _one_pixel()
    tracemalloc.start()
    try:
        found = compare(plain, padded)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (found.width, found.height, found.differing) == (1, 1, 0)
    assert peak < 4 << 20, peak
    damaged = bytearray(plain)
    damaged[-16] ^= 1  # the IDAT chunk's checksum (its end is read with the row)
    with pytest.raises(pixels.NotComparable, match="checksum error in an IDAT chunk"):
        compare(_one_pixel(), bytes(damaged))


@pytest.mark.parametrize(("hostile", "words"), [
    pytest.param(_one_pixel(png_chunk(b"tEXt", b"x" * ((8 << 20) + 1))),
                 "a b'tEXt' chunk of 8,388,609 bytes", id="large-text-chunk"),
    pytest.param(_one_pixel(header=False),
                 "the capture has no PNG header (IHDR) before its image data", id="no-ihdr"),
    pytest.param(_one_pixel(idat=b"\x78\x9c\xff\xff\xff"),
                 "a screenshot is cut short or damaged (Error -3", id="bad-deflate"),
    pytest.param(_one_pixel(idat=zlib.compress(b"\x00\x05")),
                 "a screenshot is cut short or damaged", id="index-past-palette"),
])
def test_a_file_pypng_fails_on_in_any_way_is_a_sentence_not_an_error(hostile, words):
    """A corrupt deflate stream (zlib.error), no IHDR (AttributeError) and a palette index past
    the palette (IndexError) escaped the comparison, and the suite's whole matrix answered
    500 on every view. A chunk other than IDAT is read whole, so it has a bound."""
    with pytest.raises(pixels.NotComparable, match=re.escape(words)):
        compare(_one_pixel(), hostile)

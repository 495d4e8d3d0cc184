"""How much two screenshots differ: the share of pixels that are not the same.

PNG decoding is pypng's (one pure-Python module, so fleet.pyz carries it as it carries aiohttp's
pure-Python build). Both images are read a row at a time, side by side, so memory stays at two
rows however large the screenshot. pypng works a row in Python lists (a palette row becomes a
tuple a pixel), so a row may be no wider than MAX_WIDTH: a 40,000,000 x 1 palette PNG of 39 KB
passes the pixel limit and took one comparison to 2.3 GB. pypng also inflates each IDAT chunk
whole, so the reader hands it on in pieces of IDAT_PIECE bytes (deflate inflates at most some
1,032 to one: a piece is at most about 1 MiB of rows). An interlaced PNG is refused: pypng
assembles one whole, and screenshot tools do not write them. Every format PNG allows is compared
as 8-bit RGBA, so a palette or a 16-bit image compares with an RGB one.

A pixel differs when any of its four channels differs: screenshots of the same build on the same
profile are pixel-identical, and any tolerance would hide a one-pixel border that moved. Rows are
compared as whole byte strings first (the common case: equal), and a row that differs is counted
pixel by pixel as arrays of 32-bit words, which the interpreter compares in C.
"""

from __future__ import annotations

import itertools
import time
from array import array
from dataclasses import dataclass
from typing import Any, BinaryIO

# pypng is imported by the functions that read images: a collector that never compares one
# keeps its memory.

MAX_PIXELS = 40_000_000  # 8K by 5K; past it a screenshot is not what this compares
MAX_WIDTH = 16_384  # a row's pixels: twice an 8K screen's width
MAX_HEIGHT = 65_536  # a full-page capture of a long page, at most
IDAT_PIECE = 1024  # compressed bytes handed to the inflater at a time
BUDGET_S = 20.0  # a comparison that takes longer gives up (a slow Pi, a huge image)


class NotComparable(Exception):
    """The two files cannot be compared; the message is a sentence for the review page."""


@dataclass(frozen=True)
class Difference:
    width: int
    height: int
    differing: int  # pixels

    @property
    def pct(self) -> float:
        total = self.width * self.height
        return round(100.0 * self.differing / total, 4) if total else 0.0


def _reader(file: BinaryIO) -> Any:
    """A pypng reader whose IDAT chunks come in pieces of IDAT_PIECE bytes: pypng inflates each
    chunk it is handed in one call, and a 1 MB chunk of zeros inflates to 1 GB."""
    import png

    class PieceReader(png.Reader):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.idat, self.at = b"", 0

        def chunk(self, lenient: bool = False) -> tuple[bytes, bytes]:
            if self.at >= len(self.idat):
                kind, data = super().chunk(lenient=lenient)
                if kind != b"IDAT":
                    return kind, data
                self.idat, self.at = data, 0
            self.at += IDAT_PIECE
            return b"IDAT", self.idat[self.at - IDAT_PIECE:self.at]

    return PieceReader(file=file)


def _check_size(width: int, height: int, which: str) -> None:
    """Refuse a picture from its header, before a row is decoded."""
    if width > MAX_WIDTH:
        raise NotComparable(f"the {which} is {width:,} pixels wide, wider than the "
                            f"{MAX_WIDTH:,} this compares")
    if height > MAX_HEIGHT:
        raise NotComparable(f"the {which} is {height:,} pixels tall, taller than the "
                            f"{MAX_HEIGHT:,} this compares")
    if width * height > MAX_PIXELS:
        raise NotComparable(f"the {which} has {width}x{height} pixels, more than the "
                            f"{MAX_PIXELS:,} this compares")


def _open(file: BinaryIO, which: str) -> tuple[int, int, Any]:
    import png

    try:
        reader = _reader(file)
        reader.preamble()  # the header chunks only: nothing is decoded before the checks below
        width, height = reader.width, reader.height
        _check_size(width, height, which)
        if reader.interlace:
            # pypng decodes an interlaced image whole, as a list of every channel of every
            # pixel: some 50 bytes a pixel (2 GB for a 40M-pixel file of 150 KB) before the
            # first row could be compared.
            raise NotComparable(f"the {which} is an interlaced PNG, which this does not "
                                "compare; save screenshots as plain (non-interlaced) PNG")
        _, _, rows, _info = reader.asRGBA8()
    except (png.Error, ValueError, EOFError) as exc:
        raise NotComparable(f"the {which} is not a PNG image pypng can read ({exc})") from None
    # Rows past the header's height (data after the image) are never decoded.
    return width, height, itertools.islice(rows, height)


def compare(baseline: BinaryIO, capture: BinaryIO, budget_s: float = BUDGET_S) -> Difference:
    """The difference of two open PNG files. Images of different sizes differ in every pixel
    (a layout that grew is a change to review, not a crop to line up)."""
    import png

    width, height, base_rows = _open(baseline, "baseline")
    cap_width, cap_height, cap_rows = _open(capture, "capture")
    if (width, height) != (cap_width, cap_height):
        return Difference(cap_width, cap_height, cap_width * cap_height)
    deadline = time.monotonic() + budget_s
    differing = 0
    try:
        for base_row, cap_row in zip(base_rows, cap_rows, strict=True):
            a, b = bytes(base_row), bytes(cap_row)
            if a != b:
                differing += sum(map(int.__ne__, array("I", a), array("I", b)))
            if time.monotonic() > deadline:
                raise NotComparable(f"comparing {width}x{height} pixels took longer than "
                                    f"{budget_s:g} s")
    except (png.Error, ValueError, EOFError) as exc:
        raise NotComparable(f"a screenshot is cut short or damaged ({exc})") from None
    return Difference(width, height, differing)

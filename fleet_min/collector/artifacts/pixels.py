"""How much two screenshots differ: the share of pixels that are not the same.

PNG decoding is pypng's (one pure-Python module, so fleet.pyz carries it as it carries aiohttp's
pure-Python build). Both images are read a row at a time, side by side, so memory stays at two
rows however large the screenshot. pypng works a row in Python lists (a palette row becomes a
tuple a pixel), so a row may be no wider than MAX_WIDTH: a 40,000,000 x 1 palette PNG of 39 KB
passes the pixel limit and took one comparison to 2.3 GB. pypng also reads each chunk whole and
inflates each IDAT chunk whole, so the reader reads IDAT in pieces of IDAT_PIECE bytes and hands
each on (deflate inflates at most some 1,032 to one: a piece is at most about 1 MiB of rows). An
interlaced PNG is refused: pypng assembles one whole, and screenshot tools do not write them.
Every format PNG allows is compared as 8-bit RGBA, so a palette or a 16-bit image compares with
an RGB one.

A pixel differs when any of its four channels differs: screenshots of the same build on the same
profile are pixel-identical, and any tolerance would hide a one-pixel border that moved. Rows are
compared as whole byte strings first (the common case: equal), and a row that differs is counted
pixel by pixel as arrays of 32-bit words, which the interpreter compares in C.
"""

from __future__ import annotations

import itertools
import struct
import time
import zlib
from array import array
from dataclasses import dataclass
from typing import Any, BinaryIO

# pypng is imported by the functions that read images: a collector that never compares one
# keeps its memory.

MAX_PIXELS = 40_000_000  # 8K by 5K; past it a screenshot is not what this compares
MAX_WIDTH = 16_384  # a row's pixels: twice an 8K screen's width
MAX_HEIGHT = 65_536  # a full-page capture of a long page, at most
IDAT_PIECE = 1024  # compressed bytes handed to the inflater at a time
MAX_OTHER_CHUNK = 8 << 20  # any chunk but IDAT (a colour profile, text): read whole
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


class _OverBudget(Exception):
    """The comparison's time ran out while a file was being read."""


def _reader(file: BinaryIO, deadline: float) -> Any:
    """A pypng reader that reads IDAT chunks from the file in pieces of IDAT_PIECE bytes (their
    checksum kept as they go) and hands each piece on: pypng reads a chunk whole and inflates
    it in one call, so a 400 MiB chunk held 400 MiB and a 1 MB chunk of zeros inflated to 1 GB.
    Any other chunk may be at most MAX_OTHER_CHUNK. Every chunk read checks the deadline: eight
    million empty chunks before the first row took two minutes, past the budget that was
    checked only between rows."""
    import png

    class PieceReader(png.Reader):
        atchunk: Any  # pypng's: the (length, type) of the chunk whose header was read

        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.left, self.crc = 0, 0  # of the IDAT chunk being read

        def chunk(self, lenient: bool = False) -> tuple[bytes, bytes]:
            if time.monotonic() > deadline:
                raise _OverBudget
            if self.left:
                return b"IDAT", self._piece()
            self.validate_signature()
            if not self.atchunk:
                self.atchunk = self._chunk_len_type()
            if not self.atchunk:
                raise png.ChunkError("No more chunks.")
            length, kind = self.atchunk
            if kind != b"IDAT":
                if length > MAX_OTHER_CHUNK:
                    raise png.FormatError(f"a {kind!r} chunk of {length:,} bytes")
                return super().chunk(lenient=lenient)
            self.atchunk = None
            self.left, self.crc = length, zlib.crc32(kind)
            return b"IDAT", self._piece() if length else self._checked(b"")

        def _piece(self) -> bytes:
            data = self.file.read(min(IDAT_PIECE, self.left))
            if not data:
                raise png.ChunkError("an IDAT chunk is cut short")
            self.left -= len(data)
            self.crc = zlib.crc32(data, self.crc)
            return self._checked(data) if not self.left else data

        def _checked(self, data: bytes) -> bytes:
            if self.file.read(4) != struct.pack("!I", self.crc):
                raise png.ChunkError("checksum error in an IDAT chunk")
            return data

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


def _open(file: BinaryIO, which: str, deadline: float) -> tuple[int, int, Any]:
    try:
        reader = _reader(file, deadline)
        reader.preamble()  # the header chunks only: nothing is decoded before the checks below
        width, height = getattr(reader, "width", None), getattr(reader, "height", None)
        if not isinstance(width, int) or not isinstance(height, int):
            raise NotComparable(f"the {which} has no PNG header (IHDR) before its image data")
        _check_size(width, height, which)
        if reader.interlace:
            # pypng decodes an interlaced image whole, as a list of every channel of every
            # pixel: some 50 bytes a pixel (2 GB for a 40M-pixel file of 150 KB) before the
            # first row could be compared.
            raise NotComparable(f"the {which} is an interlaced PNG, which this does not "
                                "compare; save screenshots as plain (non-interlaced) PNG")
        _, _, rows, _info = reader.asRGBA8()
    except (NotComparable, _OverBudget):
        raise
    except Exception as exc:  # pypng on a hostile file: zlib, index, attribute errors
        raise NotComparable(f"the {which} is not a PNG image pypng can read "
                            f"({_said(exc)})") from None
    # Rows past the header's height (data after the image) are never decoded.
    return width, height, itertools.islice(rows, height)


def _said(exc: Exception) -> str:
    return str(exc)[:200] or type(exc).__name__


def compare(baseline: BinaryIO, capture: BinaryIO, budget_s: float = BUDGET_S) -> Difference:
    """The difference of two open PNG files. Images of different sizes differ in every pixel
    (a layout that grew is a change to review, not a crop to line up). The budget counts from
    the first byte read, the files' headers and chunks included."""
    deadline = time.monotonic() + budget_s
    over = f"comparing the screenshots took longer than {budget_s:g} s"
    try:
        width, height, base_rows = _open(baseline, "baseline", deadline)
        cap_width, cap_height, cap_rows = _open(capture, "capture", deadline)
        if (width, height) != (cap_width, cap_height):
            return Difference(cap_width, cap_height, cap_width * cap_height)
        over = f"comparing {width}x{height} pixels took longer than {budget_s:g} s"
        differing = 0
        for base_row, cap_row in zip(base_rows, cap_rows, strict=True):
            a, b = bytes(base_row), bytes(cap_row)
            if a != b:
                differing += sum(map(int.__ne__, array("I", a), array("I", b)))
            if time.monotonic() > deadline:
                raise _OverBudget
    except _OverBudget:
        raise NotComparable(over) from None
    except NotComparable:
        raise
    except Exception as exc:  # pypng on a hostile file: zlib, index, attribute errors
        raise NotComparable(f"a screenshot is cut short or damaged ({_said(exc)})") from None
    return Difference(width, height, differing)

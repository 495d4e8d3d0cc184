"""Small PNG screenshots made in the test, for the visual review (pypng writes them)."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable

import png

Pixel = Callable[[int, int], tuple[int, int, int, int]]


def solid(_x: int, _y: int) -> tuple[int, int, int, int]:
    return (40, 90, 200, 255)


def png_bytes(width: int, height: int, pixel: Pixel = solid, alpha: bool = True) -> bytes:
    """An 8-bit RGBA (or RGB, alpha dropped) PNG whose pixel (x, y) is pixel(x, y)."""
    channels = 4 if alpha else 3
    rows = [[value for x in range(width) for value in pixel(x, y)[:channels]]
            for y in range(height)]
    out = io.BytesIO()
    png.Writer(width, height, greyscale=False, alpha=alpha).write(out, rows)
    return out.getvalue()


def with_stripe(columns: int, base: Pixel = solid) -> Pixel:
    """The base picture with its first `columns` columns painted red."""
    return lambda x, y: (255, 0, 0, 255) if x < columns else base(x, y)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def palette_png(width: int, height: int, inflated: int | None = None) -> bytes:
    """An 8-bit palette PNG of black, its rows (or `inflated` zero bytes, rows and whatever
    follows them) deflated into one IDAT chunk: zeros compress some 1,000 to one."""
    squeeze = zlib.compressobj(9)
    size = inflated if inflated is not None else height * (1 + width)
    idat = b"".join(squeeze.compress(bytes(min(1 << 20, size - at)))
                    for at in range(0, size, 1 << 20)) + squeeze.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 3, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"PLTE", bytes(6))
            + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b""))

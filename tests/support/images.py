"""Small PNG screenshots made in the test, for the visual review (pypng writes them)."""

from __future__ import annotations

import io
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

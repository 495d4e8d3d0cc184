"""Time on the wire: UTC ISO-8601 with a trailing Z. Internally, float epoch seconds."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from typing import Any


def now() -> float:
    return time.time()


_second: list[Any] = [None, ""]  # the last whole second formatted, reused within that second


def iso(ts: float | None) -> str | None:
    """Epoch seconds -> '2026-11-21T19:35:50.123456Z' (None stays None).

    Called for every event and row served, so the date part is formatted once per second.
    """
    if ts is None:
        return None
    whole = math.floor(ts)
    micros = round((ts - whole) * 1_000_000)
    if micros == 1_000_000:
        whole, micros = whole + 1, 0
    if _second[0] != whole:
        _second[0], _second[1] = whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    return f"{_second[1]}.{micros:06d}Z"


def parse_iso(text: str) -> float:
    """Parse an ISO-8601 timestamp (or a bare date) into epoch seconds; naive means UTC.

    Raises ValueError with a readable message on anything else.
    """
    value = text.strip()
    if value.endswith(("Z", "z")):
        value = value[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{text!r} is not an ISO-8601 time such as 2026-01-31T12:00:00Z") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()

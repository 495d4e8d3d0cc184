"""Time on the wire: UTC ISO-8601 with a trailing Z. Internally, float epoch seconds."""

from __future__ import annotations

import time
from datetime import UTC, datetime


def now() -> float:
    return time.time()


def iso(ts: float | None) -> str | None:
    """Epoch seconds -> '2026-11-21T19:35:50.123456Z' (None stays None)."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


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

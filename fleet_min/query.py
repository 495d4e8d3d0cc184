"""Query-string parameters shared by the listings: pages, bounded integers, ISO times.

Pure functions over a mapping, so domain modules use them without importing aiohttp.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from fleet_min.errors import BadRequest
from fleet_min.timeutil import parse_iso

_INTEGER = re.compile(r"-?[0-9]{1,12}")  # ASCII: isdigit() also takes '²', which int() refuses


def time_param(query: Mapping[str, str], name: str) -> float | None:
    """An ISO-8601 time parameter as epoch seconds (None when absent); 400 when malformed."""
    raw = query.get(name)
    if not raw:
        return None
    try:
        return parse_iso(raw)
    except ValueError as exc:
        raise BadRequest(f"{name}: {exc}") from None


def int_param(query: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = (query.get(name) or "").strip()
    if raw == "":
        return default
    if not _INTEGER.fullmatch(raw) or not low <= int(raw) <= high:
        raise BadRequest(f"{name} must be an integer from {low} to {high}")
    return int(raw)


def page_param(query: Mapping[str, str]) -> int:
    return int_param(query, "page", 1, 1, 1_000_000)


def time_range(query: Mapping[str, str], column: str, where: list[str],
               params: list[object]) -> None:
    """Add `from` / `to` bounds on a column to a WHERE clause under construction."""
    start, end = time_param(query, "from"), time_param(query, "to")
    if start is not None:
        where.append(f"{column} >= ?")
        params.append(start)
    if end is not None:
        where.append(f"{column} <= ?")
        params.append(end)

"""Template references inside a waiting job's spec: `${jobs.<id>.artifact}` and
`${jobs.<id>.metrics.<key>}`.

A reference that is the whole string keeps the value's type; embedded in longer text it is
interpolated as text. Resolution happens once, when the job is promoted to queued.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

REF = re.compile(r"\$\{jobs\.([A-Za-z0-9._:@-]+?)\.(artifact|metrics\.([A-Za-z0-9_.-]+))\}")

Lookup = Callable[[str, str, str | None], Any]  # (job_id, "artifact"|"metrics", key) -> value


class Unresolvable(LookupError):
    """A reference names a value its dependency never produced."""


def references(value: Any) -> list[tuple[str, str, str | None]]:
    """Every reference in a JSON value, as (job_id, kind, metric key or None)."""
    found: list[tuple[str, str, str | None]] = []
    _walk_strings(value, lambda text: found.extend(
        (m.group(1), "artifact" if m.group(2) == "artifact" else "metrics", m.group(3))
        for m in REF.finditer(text)))
    return found


def _walk_strings(value: Any, visit: Callable[[str], None]) -> None:
    if isinstance(value, str):
        visit(value)
    elif isinstance(value, dict):
        for item in value.values():
            _walk_strings(item, visit)
    elif isinstance(value, list):
        for item in value:
            _walk_strings(item, visit)


def rewrite(value: Any, lookup: Lookup) -> Any:
    """A copy of value with every reference replaced; raises Unresolvable for a missing one."""
    if isinstance(value, dict):
        return {key: rewrite(item, lookup) for key, item in value.items()}
    if isinstance(value, list):
        return [rewrite(item, lookup) for item in value]
    if not isinstance(value, str) or "${jobs." not in value:
        return value
    whole = REF.fullmatch(value)
    if whole:
        return _resolve(whole, lookup)
    return REF.sub(lambda m: _as_text(_resolve(m, lookup)), value)


def _resolve(match: re.Match[str], lookup: Lookup) -> Any:
    job_id, kind, key = match.group(1), match.group(2), match.group(3)
    kind = "artifact" if kind == "artifact" else "metrics"
    result = lookup(job_id, kind, key)
    if result is None:
        what = "an artifact" if kind == "artifact" else f"metric {key!r}"
        raise Unresolvable(f"template reference {match.group(0)} cannot be resolved: "
                           f"job {job_id} finished without {what}")
    return result


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))

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

from fleet_min.validate import EMBEDDED_REF, find_template_refs

# The grammar is the validator's (fleet_min.validate), so what is accepted is what is resolved.
REF = EMBEDDED_REF

Lookup = Callable[[str, str, str | None], Any]  # (job_id, "artifact"|"metrics", key) -> value


class Unresolvable(LookupError):
    """A reference names a value its dependency never produced."""


def references(value: Any) -> list[tuple[str, str, str | None]]:
    """Every reference in a JSON value, as (job_id, kind, metric key or None)."""
    return find_template_refs(value)


def rewrite(value: Any, lookup: Lookup) -> Any:
    """A copy of value with every reference replaced; raises Unresolvable for a missing one
    (the first in document order). Walked with a stack of its own, not recursion: a client
    shaped the value."""
    top: list[Any] = [value]
    slots: list[tuple[Any, Any]] = [(top, 0)]  # (container copy, key or index) to rewrite
    while slots:
        holder, key = slots.pop()
        item = holder[key]
        if isinstance(item, dict):
            holder[key] = item = dict(item)
            slots.extend((item, k) for k in reversed(list(item)))
        elif isinstance(item, list):
            holder[key] = item = list(item)
            slots.extend((item, i) for i in range(len(item) - 1, -1, -1))
        elif isinstance(item, str) and "${jobs." in item:
            holder[key] = _rewritten_text(item, lookup)
    return top[0]


def _rewritten_text(text: str, lookup: Lookup) -> Any:
    whole = REF.fullmatch(text)
    if whole:
        return _resolve(whole, lookup)
    return REF.sub(lambda m: _as_text(_resolve(m, lookup)), text)


def _resolve(match: re.Match[str], lookup: Lookup) -> Any:
    job_id, key = match.group("job_id"), match.group("key")
    kind = "metrics" if key else "artifact"
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

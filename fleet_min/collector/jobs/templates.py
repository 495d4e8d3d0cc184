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

from fleet_min import jsonio
from fleet_min.validate import EMBEDDED_REF, find_template_refs

# The grammar is the validator's (fleet_min.validate), so what is accepted is what is resolved.
REF = EMBEDDED_REF

# The default request body limit (FLEET_MAX_JSON_BYTES): a rewritten spec may hold no more than
# a client could have sent. Unbounded, 1,500 references to a 600 kB metric made a 900 MB spec
# (14 s of stalled loop, 3.5 GB), and 1 GB was past SQLite's string limit, so the dependency's
# final row answered 500 and the dependency could never close.
MAX_SPEC_BYTES = 1 << 20
# Bytes the references may add over every spec one promotion (or one request) rewrites: each
# spec held to MAX_SPEC_BYTES would still let one final row grow the 9,999 children of a
# waiting fan-out, or the 800 waiters one request can hold, to a MiB each. A hundred devices
# each handed a 100 kB metric take 10 MB of it.
MAX_REWRITE_BYTES = 16 << 20

Lookup = Callable[[str, str, str | None], Any]  # (job_id, "artifact"|"metrics", key) -> value


class Unresolvable(LookupError):
    """A reference names a value its dependency never produced."""


class TooLarge(Unresolvable):
    """The values referenced would make the spec larger than it may be stored."""


def references(value: Any) -> list[tuple[str, str, str | None]]:
    """Every reference in a JSON value, as (job_id, kind, metric key or None)."""
    return find_template_refs(value)


class Rewrites:
    """The rewrites of one promotion or one request, which share their lookups and a budget.

    Each distinct reference is looked up and measured once for all of them. A spec may not
    pass max_bytes of compact JSON (or its own size as sent, when an operator's larger body
    limit let a larger one in), and together they may add at most `budget` bytes. Sizes are
    added up as the values go in, before any text is joined, and the first reference past a
    bound raises TooLarge: N references to a large value cost about the bound, never N times
    the value."""

    def __init__(self, lookup: Lookup, max_bytes: int | None = MAX_SPEC_BYTES,
                 budget: int | None = MAX_REWRITE_BYTES) -> None:
        self.lookup = lookup
        self.max_bytes = max_bytes
        self.budget = budget
        self.left = budget
        self.resolved: dict[str, _Value] = {}  # by the reference's text

    def rewrite(self, value: Any) -> Any:
        """A copy of value with every reference replaced; raises Unresolvable for a missing
        one (the first in document order) and TooLarge past a bound. Walked with a stack of
        its own, not recursion: a client shaped the value."""
        spec = _Spec(self, value)
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
                holder[key] = spec.text(item)
        if self.left is not None:
            self.left -= max(0, spec.grown)
        return top[0]

    def value(self, match: re.Match[str]) -> _Value:
        found = self.resolved.get(match.group(0))
        if found is None:
            found = self.resolved[match.group(0)] = _Value(_resolve(match, self.lookup))
        return found


class _Spec:
    """One spec's rewrite: the references replaced so far and the bytes they added."""

    def __init__(self, rewrites: Rewrites, value: Any) -> None:
        self.rewrites = rewrites
        self.count = 0
        self.grown = 0
        limit = rewrites.max_bytes
        self.size = 0 if limit is None else len(jsonio.dumps_body(value))
        self.limit = None if limit is None else max(limit, self.size)
        self.bound = ("the most a request body may carry" if self.limit == limit
                      else "its size as sent")

    def text(self, text: str) -> Any:
        whole = REF.fullmatch(text)
        if whole:
            found = self.rewrites.value(whole)
            # The reference (ASCII that JSON never escapes) and its two quotes go out.
            self._grow(found.size() - len(text) - 2, whole.group(0))
            return found.value
        pieces: list[str] = []
        start = 0
        for match in REF.finditer(text):
            found = self.rewrites.value(match)
            self._grow(found.text_size() - len(match.group(0)), match.group(0))
            pieces += (text[start:match.start()], found.text())
            start = match.end()
        pieces.append(text[start:])
        return "".join(pieces)

    def _grow(self, by: int, reference: str) -> None:
        self.count += 1
        self.grown += by
        if self.limit is not None:
            self.size += by
            if self.size > self.limit:
                raise TooLarge(f"template reference {reference} cannot be resolved: with it "
                               f"(reference {self.count} of the spec) the spec would pass "
                               f"{self.limit} bytes, {self.bound}; refer to a smaller value "
                               "(an artifact's hash, say) or to it fewer times")
        left = self.rewrites.left
        if left is not None and self.grown > left:
            raise TooLarge(f"template reference {reference} cannot be resolved: with the jobs "
                           "rewritten before it in the same promotion or request, the "
                           f"references would add more than {self.rewrites.budget} bytes; "
                           "refer to smaller values (an artifact's hash, say) or from fewer "
                           "jobs")


class _Value:
    """A referenced value with its sizes, measured once however often it is referenced."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self._size: int | None = None
        self._text: str | None = None
        self._text_size: int | None = None

    def size(self) -> int:
        """Bytes of the value as compact JSON."""
        if self._size is None:
            self._size = len(jsonio.dumps_body(self.value))
        return self._size

    def text(self) -> str:
        if self._text is None:
            self._text = _as_text(self.value)
        return self._text

    def text_size(self) -> int:
        """Bytes the value adds inside a JSON string: its text escaped, without the quotes."""
        if self._text_size is None:
            self._text_size = len(jsonio.dumps_body(self.text())) - 2
        return self._text_size


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

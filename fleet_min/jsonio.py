"""JSON on the hot paths, through orjson when the `fast` extra installed it, with the standard
library's meaning either way.

orjson is a compiled library, so it stays optional (fleet.pyz and the Termux agent never have
it). It parses and writes a small document five to ten times faster than the json module, and
every job passes three request bodies, three replies and a few stored columns through here.
Wherever the two libraries could disagree, the standard library decides: orjson refusing a
document (a lone surrogate, an integer past 64 bits, a type it does not know) sends it down the
standard path, and so does a body holding a number of 19 or more digits, which orjson would
turn into a float where the json module keeps every digit.

Request bodies are checked here before either parser recurses into them: nested deeper than
MAX_DEPTH levels they are refused (see too_deep).
"""

from __future__ import annotations

import importlib
import json
import math
import operator
import re
from collections.abc import Iterable
from itertools import accumulate, count
from typing import Any

# orjson before 3.9.15 had no recursion limit in loads (CVE-2024-27454: `[` * 200,000 overflows
# the C stack and kills the process), and before 3.11.6 dumps could still crash on deeply nested
# lists of objects (GHSA-hx9q-6w63-j58v, CVE-2025-67221). Bodies are held to MAX_DEPTH levels
# before any parser sees them, but stored documents from before that limit may be deeper, and
# both directions run here: only a release with both fixes is used.
ORJSON_FLOOR = (3, 11, 6)


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:  # the standard library alone: fleet.pyz, a plain install
        return None


def _release(text: str) -> tuple[int, ...]:
    """(3, 11, 6) from "3.11.6" or "3.11.6rc1"; () when it does not read as a release."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(part or 0) for part in found.groups()) if found else ()


def _trusted(module: Any) -> tuple[Any, str | None]:
    """The orjson module when it is recent enough, else None and why it is left unused."""
    if module is None:
        return None, None
    version = str(getattr(module, "__version__", ""))
    if _release(version) >= ORJSON_FLOOR:
        return module, None
    floor = ".".join(map(str, ORJSON_FLOOR))
    return None, (f"orjson {version or '(no version)'} is installed but not used: releases "
                  f"before {floor} can crash on deeply nested JSON; JSON goes through the "
                  f"standard json module (pip install 'orjson>={floor}' to speed it up)")


orjson, REFUSED = _trusted(_optional("orjson"))
FAST = orjson is not None

# One encoder for every call: json.dumps with options builds a new one each time. NaN and the
# infinities are refused rather than written as the bare words the json module would use, which
# are not JSON (see dumps_body).
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)

# Bytes 0-9 to "0" and everything else to a space: a long number is then a run of zeros.
_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_NUMBER = b"0" * 19
_SURROGATE = re.compile("[\ud800-\udfff]")


def dumps_body(value: Any) -> bytes:
    """Compact JSON (no spaces, characters as they are) in UTF-8: a response body.

    A lone surrogate (text stored before the collector refused it) cannot be UTF-8, so it goes
    out as its JSON escape, \\ud800: valid JSON that reads back as the same string. A float
    that is NaN or infinite goes out as null, as orjson writes it: the body stays JSON either
    way."""
    if orjson is not None:
        try:
            return orjson.dumps(value)
        except TypeError:  # a key that is not a string, an int past 64 bits, an unknown type
            pass
    try:
        text = _COMPACT.encode(value)
    except ValueError:  # a NaN or an infinity somewhere (rare: every figure is kept finite)
        text = _COMPACT.encode(_nonfinite_as_null(value))
    try:
        return text.encode()
    except UnicodeEncodeError:  # only inside strings: escaping keeps the JSON valid
        return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text).encode()


def dumps_listing(items: Iterable[Any], key: str | None = None) -> bytes:
    """dumps_body of a list (or of {key: list}) made an item at a time: the items of a listing
    may each be the parse of a stored document, and a list of a thousand of them (nested empty
    lists, the most objects a byte can make) held 1.2 GB at once; this holds one item's."""
    array = b"[" + b",".join(dumps_body(item) for item in items) + b"]"
    return array if key is None else b"{" + dumps_body(key) + b":" + array + b"}"


def _nonfinite_as_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _nonfinite_as_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_nonfinite_as_null(item) for item in value]
    return value


def dumps_stored(value: Any) -> str:
    """JSON text for a database column. Compact through orjson; otherwise exactly what
    json.dumps has always stored here (readers parse it, so either form reads the same)."""
    if orjson is not None:
        try:
            return orjson.dumps(value).decode()
        except TypeError:
            pass
    return json.dumps(value)


def _has_long_number(data: str | bytes | bytearray) -> bool:
    if len(data) < len(_LONG_NUMBER):  # a short column (a device's pools, say) cannot hold one
        return False
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    return _LONG_NUMBER in raw.translate(_DIGITS)


def loads_stored(text: str | bytes) -> Any:
    """Parse JSON this program wrote itself (a database column)."""
    if orjson is not None and not _has_long_number(text):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:  # a lone surrogate's escape, say: the json module's call
            pass
    return json.loads(text)


def loads_quick(raw: bytes | bytearray) -> tuple[bool, Any]:
    """(True, value) when orjson parsed a request body to what the standard library would make
    of it; (False, None) when the standard library must decide, and word any refusal."""
    if orjson is None or _has_long_number(raw):
        return False, None
    try:
        return True, orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False, None


# ---------------------------------------------------------------------------------------------
# Nesting, found before any parser recurses into a body.

MAX_DEPTH = 64  # arrays and objects inside each other in a request body (docs/collector.md)
# An integer of more digits than a float can hold: SQLite's JSON functions (the listings' trims,
# json_each) turn a stored one into Inf, which no JSON reader takes back. Request bodies refuse
# one (fleet_min.http), and so does restore's row check.
MAX_INTEGER_DIGITS = 308

# Brackets to parentheses, the string quote kept, everything else deleted (with _OTHER_BYTES).
_BRACKETS = bytes.maketrans(b"[{]}", b"(())")
_OTHER_BYTES = bytes(b for b in range(256) if b not in b'[]{}"')


class TooDeep(ValueError):
    """JSON nested deeper than MAX_DEPTH: refused before any parser recursed into it."""


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def loads_foreign(raw: bytes | str, *, constants: bool = True) -> Any:
    """JSON that another server answered or someone else's file holds (a peer's health, the
    statuses API's refusal, the coordinator's reply, GitHub's answers, a runner's `.runner`).
    ValueError, never RecursionError, when it is not JSON; TooDeep (a ValueError) when it nests
    deeper than MAX_DEPTH, measured before the parser recurses into it. With constants=False,
    NaN and Infinity are not JSON either: Python's parser takes them and a browser's does not,
    so what is relayed to one as application/json (the peer proxy) must have none; readers
    that clean each value (GitHub's items) take them and drop the value."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if too_deep(data):
        raise TooDeep(f"nested deeper than {MAX_DEPTH} levels")
    return json.loads(raw) if constants else json.loads(raw, parse_constant=_not_json)


def too_deep(raw: bytes | bytearray, limit: int = MAX_DEPTH) -> bool:
    """True when the JSON text nests arrays and objects more than `limit` levels deep (or opens
    more than that and never closes them). Brackets inside strings do not count.

    Linear, in passes of C over the bytes rather than a Python step per byte: every request body
    comes through here. A body with no more than `limit` brackets that open cannot be too deep,
    which two counts show, and that is nearly every body.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    shape = _shape(bytes(raw))
    if shape.count(b"(") <= limit:
        return False
    if b"(" * (limit + 1) in shape:  # the usual attack, [[[[..., needs no more than this
        return True
    # Each pass deletes every innermost "()" pair, one level of the whole document. A bushy
    # document (a batch of specs) is gone in a few passes that each shrink it a lot; a pass
    # that shrinks it little means a narrow, deep shape, which the running depth settles in
    # one more pass, whatever the limit.
    for done in range(limit):
        shorter = shape.replace(b"()", b"")
        if b"(" not in shorter:
            return False
        if len(shorter) * 4 > len(shape) * 3:
            return _peak(shorter) > limit - done - 1
        shape = shorter
    return True


def _shape(text: bytes) -> bytes:
    """Only the structure of a JSON text: [ and { as "(", ] and } as ")", strings gone."""
    if b"\\" in text:  # an escaped quote does not end a string: drop escaped backslashes first
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    shape = text.translate(_BRACKETS, _OTHER_BYTES)
    if b'"' in shape:  # strings' insides are the odd pieces between quotes
        shape = b"".join(shape.split(b'"')[::2])
    return shape


_TWO_ZERO = bytes.maketrans(b"()", b"\x02\x00")


def _peak(shape: bytes) -> int:
    """The deepest point of a shape: after i brackets, 2 x (openers so far) - i, taken with
    C-level iterators (60 ns a bracket), never a Python loop."""
    return max(map(operator.sub, accumulate(shape.translate(_TWO_ZERO)), count(1)))


# ---------------------------------------------------------------------------------------------
# Lone surrogates: a \\ud800 escape with no partner parses to a string that is not Unicode
# text. Stored, it breaks every reply and page that includes it, so bodies holding one are
# refused. orjson already refuses them, so only bodies the json module parsed can hold one, and
# only those whose bytes hold such an escape need their strings looked at.

_LONE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_PATH_STEPS = 8  # a longer path is shown with "(...)" in the middle


def may_hold_surrogate(raw: bytes | bytearray) -> bool:
    """Whether the JSON text holds a \\uD800-\\uDFFF escape (a pair's halves too): one C
    search, and nearly every body answers no."""
    return b"\\u" in raw and _LONE_ESCAPE.search(raw) is not None


def lone_surrogate(value: Any) -> str | None:
    """A sentence naming the first string or key under value (document order) that holds a lone
    surrogate, or None. A parsed pair is one character, so any surrogate left is alone. Walked
    with a stack of its own, not recursion."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found:
                return _not_text(_path_text(path) or "the body", found.group())
        elif isinstance(item, dict):
            for key in item:
                found = _SURROGATE.search(key) if isinstance(key, str) else None
                if found:
                    return _not_text(f"a key of {_path_text(path) or 'the body'}", found.group())
            stack.extend(((*path, "." + _step(key)), child)
                         for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend(((*path, f"[{index}]"), child)
                         for index, child in reversed(list(enumerate(item))))
    return None


def _step(key: Any) -> str:
    """A key as a step of a path in one line of text: cut short, control characters escaped."""
    text = key[:60] if isinstance(key, str) else str(key)
    return text if text.isprintable() else json.dumps(text)


def _path_text(path: tuple[str, ...]) -> str:
    if len(path) > _PATH_STEPS:
        path = (*path[:4], ".(...)", *path[-3:])
    return "".join(path).removeprefix(".")


def _not_text(where: str, char: str) -> str:
    return f"{where} is not valid Unicode text (a lone surrogate \\u{ord(char):04x})"

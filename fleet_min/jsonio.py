"""JSON on the hot paths, through orjson when the `fast` extra installed it, with the standard
library's meaning either way.

orjson is a compiled library, so it stays optional (fleet.pyz and the Termux agent never have
it). It parses and writes a small document five to ten times faster than the json module, and
every job passes three request bodies, three replies and a few stored columns through here.
Wherever the two libraries could disagree, the standard library decides: orjson refusing a
document (a lone surrogate, an integer past 64 bits, a type it does not know) sends it down the
standard path, and so does a body holding a number of 19 or more digits, which orjson would
turn into a float where the json module keeps every digit.
"""

from __future__ import annotations

import importlib
import json
from typing import Any


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:  # the standard library alone: fleet.pyz, a plain install
        return None


orjson = _optional("orjson")
FAST = orjson is not None

# One encoder for every call: json.dumps with options builds a new one each time.
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)

# Bytes 0-9 to "0" and everything else to a space: a long number is then a run of zeros.
_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_NUMBER = b"0" * 19


def dumps_body(value: Any) -> bytes:
    """Compact JSON (no spaces, characters as they are) in UTF-8: a response body."""
    if orjson is not None:
        try:
            return orjson.dumps(value)
        except TypeError:  # a key that is not a string, an int past 64 bits, an unknown type
            pass
    return _COMPACT.encode(value).encode()


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

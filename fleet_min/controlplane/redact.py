"""The secret redactor: everything the control plane serves from runner files passes through it.

Patterns are applied most specific first, so a GitHub token inside `token=...` is caught by the
token rule and the key=value rule only sees `<redacted>`. Every pattern is linear (no nested
quantifiers over the same characters) so a hostile log line cannot stall the event loop.
"""

from __future__ import annotations

import math
import re
from collections import Counter

MARK = "<redacted>"

_KEY_WORDS = (r"(?:token|secret|passw(?:or)?d|pwd|passphrase|api[_-]?key|apikey|"
                 r"access[_-]?key|private[_-]?key|client[_-]?secret|credentials?|session[_-]?id|"
                 r"cookie|signature)")

# A whole PEM private key block; a block cut off by a tail (no END line) is redacted to the end.
_PEM = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?"
                  r"(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.DOTALL)
_JWT = re.compile(r"\beyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*")
# Classic tokens (ghp_, gho_, ghu_, ghs_, ghr_), fine-grained PATs and old-style v1 install tokens.
_GITHUB = re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,255}|github_pat_[A-Za-z0-9_]{22,255}|"
                     r"v1\.[0-9a-f]{40})\b")
_OTHER_VENDOR = re.compile(r"\b(?:AKIA[0-9A-Z]{16}|xox[abprs]-[A-Za-z0-9-]{10,}|"
                           r"glpat-[A-Za-z0-9_-]{20,}|sk-[A-Za-z0-9_-]{20,})\b")
_AUTH_HEADER = re.compile(r"(?i)\b(authorization\s*[:=]\s*)(?:\"[^\"]*\"|'[^']*'|[^\r\n]+)")
_SCHEME = re.compile(r"(?i)\b(bearer|basic|token)(\s+)[A-Za-z0-9._~+/=-]{12,}")
_URL_CREDENTIALS = re.compile(r"(?i)(?<![a-z0-9+.-])([a-z][a-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@")
_JSON_FIELD = re.compile(r"(?i)(\"[A-Za-z0-9_.-]*" + _KEY_WORDS + r"[A-Za-z0-9_.-]*\"\s*:\s*)"
                         r"\"(?:[^\"\\\r\n]|\\.)*\"")
# A key starts only where a run of key characters starts (a lookbehind, not \b, which also holds
# after every '.' and '-' inside a run): with \b, "a.a.a.a..." made the engine re-scan the rest
# of the run from every dot, quadratic in its length (16 KB took 52 s). The same for URL schemes.
_KEY_START = r"(?<![A-Za-z0-9_.-])"
_KEY_VALUE = re.compile(r"(?i)" + _KEY_START + r"([A-Za-z0-9_.-]*" + _KEY_WORDS
                        + r"[A-Za-z0-9_.-]*)"
                        r"(\s*[=:]\s*)(?!<redacted>)(\"[^\"\r\n]*\"|'[^'\r\n]*'|[^\s,;&\"']+)")
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_-]{40,}={0,2}")

# Below this many bits per character a long run is a path, a word chain or a hex digest (at most
# 4 bits), not key material; random base64 of 40+ characters sits near 5.
_ENTROPY_FLOOR = 4.2
# Values that look like secrets by key name but carry none ("token: none", "password=***").
_HARMLESS_VALUES = frozenset({"", "none", "null", "true", "false", "***", "<redacted>", "redacted",
                              "unset", "set", "yes", "no", "0", "1", "required", "missing"})


def _entropy(text: str) -> float:
    counts = Counter(text)
    total = len(text)
    return -sum(n / total * math.log2(n / total) for n in counts.values())


def _base64_run(match: re.Match[str]) -> str:
    run = match.group(0)
    core = run.rstrip("=")
    if (_entropy(core) >= _ENTROPY_FLOOR and any(c.isdigit() for c in core)
            and any(c.isupper() for c in core) and any(c.islower() for c in core)):
        return MARK
    return run


def _key_value(match: re.Match[str]) -> str:
    value = match.group(3).strip("\"'")
    if value.lower() in _HARMLESS_VALUES:
        return match.group(0)
    return f"{match.group(1)}{match.group(2)}{MARK}"


def redact(text: str) -> str:
    """`text` with every secret this module knows replaced by `<redacted>`."""
    text = _PEM.sub(MARK, text)
    text = _JWT.sub(MARK, text)
    text = _GITHUB.sub(MARK, text)
    text = _OTHER_VENDOR.sub(MARK, text)
    text = _AUTH_HEADER.sub(lambda m: m.group(1) + MARK, text)
    text = _SCHEME.sub(lambda m: m.group(1) + m.group(2) + MARK, text)
    text = _URL_CREDENTIALS.sub(lambda m: m.group(1) + MARK + "@", text)
    text = _JSON_FIELD.sub(lambda m: m.group(1) + '"' + MARK + '"', text)
    text = _KEY_VALUE.sub(_key_value, text)
    return _BASE64_RUN.sub(_base64_run, text)


def redact_lines(lines: list[str]) -> list[str]:
    """Redact a block of lines as one text, so a PEM block spanning lines is caught whole."""
    return redact("\n".join(lines)).split("\n")

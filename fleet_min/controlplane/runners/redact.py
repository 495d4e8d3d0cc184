"""The secret redactor: everything the control plane serves from runner files passes through it.

Two ways to know a secret, applied one after the other:

- **by its shape**: private key blocks (PEM, OpenSSH, PGP), JWTs, vendor tokens with a known
  prefix (GitHub, AWS, Slack, Stripe, Google, npm, GitLab, SendGrid, Twilio, ...), webhook URLs
  that carry their secret in the path, credentials in URLs, Authorization headers, and long
  random-looking base64 runs;
- **by its name**: the value after a key that names a secret (`*PASS*`, `*SECRET*`, `*TOKEN*`,
  `*AUTH*`, `*KEY*` and their kin) in `KEY=value`, `KEY: value`, `"key": "value"`,
  `--key value`, `--key=value` and `password value` forms. A key is split into words
  (`DB_PASS` is db + pass, `clientSecret` is client + secret), so `keyboard`, `passed`,
  `author` and `tokenizer` name nothing secret, and a key whose last word says what the value
  is about (`TOKEN_FILE`, `token_count`, `AUTH_TYPE`) is left alone.

Every pattern is linear: no two quantifiers compete for the same characters unless an anchor
(a lookbehind at the start of a run) lets each run be tried once, so a hostile log line cannot
stall the event loop (tests/test_redact_bounds.py).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable

MARK = "<redacted>"

# -- by shape --------------------------------------------------------------------------------

# A whole private key block, PEM/OpenSSH ("-----BEGIN ... PRIVATE KEY-----"), PuTTY's SSH2
# ("---- BEGIN SSH2 ENCRYPTED PRIVATE KEY ----") and PGP ("... PRIVATE KEY BLOCK-----"); a block
# cut off by a tail (no END line) is redacted to the end.
_KEY_BLOCK = re.compile(r"-{4,5} ?BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)? ?-{4,5}.*?"
                        r"(?:-{4,5} ?END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)? ?-{4,5}|\Z)",
                        re.DOTALL)
_JWT = re.compile(r"\beyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*")
# Classic tokens (ghp_, gho_, ghu_, ghs_, ghr_), fine-grained PATs and old-style v1 install tokens.
_GITHUB = re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,255}|github_pat_[A-Za-z0-9_]{22,255}|"
                     r"v1\.[0-9a-f]{40})\b")
_VENDOR = re.compile(
    r"\b(?:"
    r"(?:AKIA|ASIA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA|ABIA|ACCA)[0-9A-Z]{16}"  # AWS key ids
    r"|xox[abeoprs]-[A-Za-z0-9-]{10,}|xapp-[A-Za-z0-9-]{10,}"  # Slack
    r"|(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{10,}|whsec_[A-Za-z0-9]{20,}"  # Stripe
    r"|AIza[0-9A-Za-z_-]{35}"  # Google API keys
    r"|npm_[A-Za-z0-9]{36}"  # npm
    r"|gl(?:pat|dt|rt|ptt|ft|soat|cbt)-[A-Za-z0-9_-]{20,}|GR1348941[A-Za-z0-9_-]{20,}"  # GitLab
    r"|SG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}"  # SendGrid
    r"|SK[0-9a-f]{32}"  # Twilio API key sid
    r"|HRKU-[A-Za-z0-9_-]{20,}"  # Heroku
    r"|dckr_pat_[A-Za-z0-9_-]{20,}"  # Docker Hub
    r"|pypi-[A-Za-z0-9_-]{50,}"  # PyPI
    r"|hv[sbr]\.[A-Za-z0-9_-]{24,}"  # HashiCorp Vault
    r"|do[por]_v1_[a-f0-9]{64}"  # DigitalOcean
    r"|shp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}"  # Shopify
    r"|sk-[A-Za-z0-9_-]{20,}"  # OpenAI, Anthropic and the many "sk-" keys
    r")\b")
_WEBHOOK = re.compile(r"(?i)\b((?:hooks\.slack\.com/(?:services|workflows|triggers)|"
                      r"discord(?:app)?\.com/api/webhooks)/)[A-Za-z0-9_/-]+")
_AUTH_HEADER = re.compile(r"(?i)\b((?:proxy-)?authorization\s*[:=]\s*)"
                          r"(?:\"[^\"\r\n]*\"|'[^'\r\n]*'|[^\r\n]+)")
_SCHEME = re.compile(r"(?i)\b(bearer|basic|token)(\s+)[A-Za-z0-9._~+/=-]{12,}")
# user:password@ (the user may be empty: redis://:password@host).
_URL_CREDENTIALS = re.compile(r"(?i)(?<![a-z0-9+.-])([a-z][a-z0-9+.-]*://)[^/\s:@]*:[^/\s@]+@")
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_-]{40,}={0,2}")

# Below this many bits per character a long run is a path, a word chain or a hex digest (at most
# 4 bits), not key material; random base64 of 40+ characters sits near 5.
_ENTROPY_FLOOR = 4.2

# -- by name ---------------------------------------------------------------------------------

# A key starts only where a run of key characters starts (a lookbehind, not \b, which also holds
# after every '.' and '-' inside a run): with \b, "a.a.a.a..." made the engine re-scan the rest
# of the run from every dot, quadratic in its length (16 KB took 52 s). The key is the whole run,
# never "a run with a key word somewhere inside" (two stars around a word backtrack
# quadratically: "token" * 4000 took 6 s); the words are looked at afterwards, in Python.
_KEY_START = r"(?<![A-Za-z0-9_.-])"
# The key may be quoted, also as JSON inside a JSON string (`{\"password\": \"...\"}`), and
# the separator URL-encoded (`%3Faccess_token%3D...`).
_ASSIGN = re.compile(_KEY_START + r"(\\?[\"']|)([A-Za-z0-9_.-]+)\1[ \t]*(=>|:=|[=:]|%3[Dd])"
                     r"[ \t]*")
_FLAG = re.compile(_KEY_START + r"(--[A-Za-z0-9][A-Za-z0-9_.-]*)[ \t]+(?=[^\s-])")
# `password value`, and an environment variable's name then its value (`env` piped through
# `column`, a tab-separated listing: `GITHUB_TOKEN<TAB>value`).
_SPACED = re.compile(_KEY_START + r"((?i:password|passwd|passphrase|secret|token|api[_-]?key)"
                     r"|[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*)[ \t]+(?=[^\s:=])")
# A scalar: quoted (a quote the end of the line cuts off runs to it), quoted inside a JSON
# string (\"...\"), or a run up to a space or a separator; never an object or a list.
_VALUE = re.compile(r"\\\"(?:[^\"\\\r\n]|\\\\)*(?:\\\")?"
                    r"|\"(?:[^\"\\\r\n]|\\.)*(?:\"|(?=[\r\n])|\Z)"
                    r"|'[^'\r\n]*(?:'|(?=[\r\n])|\Z)"
                    r"|(?![{\[])[^\s,;&\"'<>]+")
# A terminal escape (colour, cursor) as the runner wrote it, or as JSON or a shell spells it:
# `\x1b[33mDB_PASSWORD\x1b[0m=...` hides the key from the rules by name unless they look
# through it (see _by_name).
_ESCAPE = re.compile(r"(?:\x1b|\\x1b|\\u001[bB]|\\033|\\e)\[[0-?]*[ -/]*[@-~]")
# The rest of a percent escape before a key in a URL-encoded query (`%3Faccess_token`).
_ENCODED = re.compile(r"[0-9A-Fa-f]{2}")
_THEN_ASSIGN = re.compile(r"[ \t]*(?:=|:(?!//))")
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")

_SECRET_WORDS = frozenset({
    "pass", "passwd", "password", "passphrase", "pwd", "secret", "secrets", "token", "auth",
    "key", "apikey", "accesskey", "secretkey", "privatekey", "credential", "credentials",
    "creds", "cookie", "signature", "sig"})
# One-word keys that end in a secret word: PGPASSWORD, clientsecret, accesstoken, sessionid.
_SECRET_ENDINGS = ("password", "passwd", "passphrase", "secret", "token", "apikey", "accesskey",
                   "secretkey", "privatekey", "sessionid")
# A last word that says what the value is about: a file, a count, a type, not the secret.
_ABOUT_WORDS = frozenset({
    "file", "files", "path", "dir", "directory", "count", "counts", "length", "len", "size",
    "type", "types", "name", "names", "url", "uri", "endpoint", "format", "method", "mode",
    "scheme", "kind", "provider", "enabled", "required", "status", "state", "policy", "limit",
    "max", "min", "usage", "env", "var", "header", "prefix", "id", "ids", "expiry", "expires",
    "ttl", "age", "at", "time", "label", "hint", "algorithm", "alg", "version"})
# Alone and before a colon these are prose or test tallies ("Cache restored from key: npm-...",
# "pass: 12"), not secrets; with "=" or as a flag they still count.
_WEAK_ALONE = frozenset({"key", "pass"})
# Values that look like secrets by key name but carry none ("token: none", "password=***").
_HARMLESS_VALUES = frozenset({"", "none", "null", "nil", "true", "false", "redacted", "unset",
                              "set", "yes", "no", "ok", "required", "missing", "empty", "masked",
                              "[masked]", "[redacted]", "[filtered]", "undefined"})
# Words that follow "password"/"token"/"secret" in prose rather than a value.
_PROSE = frozenset({
    "is", "was", "were", "are", "be", "been", "has", "had", "have", "will", "would", "can",
    "could", "may", "must", "should", "for", "of", "to", "the", "a", "an", "and", "or", "in",
    "on", "at", "from", "with", "by", "not", "no", "if", "as", "that", "this", "it", "count",
    "counts", "expired", "expires", "expiry", "refresh", "refreshed", "renewed", "required",
    "missing", "invalid", "valid", "length", "limit", "usage", "used", "file", "type", "set",
    "unset", "none", "changed", "updated", "reset", "prompt", "policy", "rotation", "rotated",
    "generated", "created", "accepted", "rejected", "denied", "error", "errors", "failed",
    "succeeded", "ok", "authentication", "auth", "request", "requested", "received", "sent",
    "stored", "saved", "found", "provided", "given", "cache", "cached", "lookup", "exchange",
    "endpoint", "url", "scope", "scopes", "permissions", "does", "did"})


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


def secret_key(key: str, colon: bool = False) -> bool:
    """Whether a key (a variable, field or flag name) names a secret. `colon`: it came before
    a ':' (prose and YAML), where a bare `key` or `pass` is not taken for one."""
    words = [word.lower() for word in _WORD.findall(key)]
    if not words:
        return False
    joined = "".join(words)
    if "sessionid" in joined:
        return True
    if words[-1] in _ABOUT_WORDS:
        return False
    if len(words) == 1 and (words[0] == "pwd" or (colon and words[0] in _WEAK_ALONE)):
        return False  # PWD is the shell's working directory
    return (any(word in _SECRET_WORDS for word in words)
            or joined.endswith(_SECRET_ENDINGS)) and joined != "oldpwd"


def _harmless(value: str) -> bool:
    """A placeholder, not a secret. Long values never are: a value left alone is scanned again
    from the next key inside it, so only short ones may be (keeps the scan linear)."""
    # `{"pass": 12}`: the run after a key takes the closing brace or bracket with it.
    bare = value.strip("\"'").rstrip("}]").strip()
    return len(bare) <= 64 and (bare.lower() in _HARMLESS_VALUES or not bare.strip("*")
                                or bare.startswith("${") or (bare.isdigit() and len(bare) <= 6))


KeyCheck = Callable[[re.Match[str]], bool]
ValueCheck = Callable[[re.Match[str], str], bool]


def _by_name(text: str, finder: re.Pattern[str], key_ok: KeyCheck,
             value_ok: ValueCheck = lambda _match, value: not _harmless(value)) -> str:
    """Replace the value after every key `finder` finds when `key_ok` names a secret and
    `value_ok` takes the value for one. The finder matches the key and its separator only and
    the key is judged before its value is read, so a value that is not replaced is neither
    consumed (`url=https://x/?token=abc` still has its token looked at) nor read again and
    again (`a=b=c=...` stays linear)."""
    # Keys and values are found in a copy of the text whose terminal escapes are blanks of
    # the same length, so a coloured key is still a key; what is kept comes from `text`, so
    # the escapes are still there for printable() to show.
    view = _ESCAPE.sub(lambda m: " " * len(m.group(0)), text)
    pieces: list[str] = []
    done = 0
    for match in finder.finditer(view):
        start = match.end()
        if match.start() < done or not key_ok(match):
            continue  # inside a value already replaced, or not a secret's name
        value = _VALUE.match(view, start)
        if value is None or not value_ok(match, value.group(0)):
            continue
        pieces += [text[done:start], _marked(value.group(0))]
        done = value.end()
    if not pieces:
        return text
    pieces.append(text[done:])
    return "".join(pieces)


def _marked(value: str) -> str:
    if value.startswith('\\"'):
        return f'\\"{MARK}\\"'
    quote = value[0] if value[:1] in ("'", '"') else ""
    return f"{quote}{MARK}{quote}"


def _assigned(match: re.Match[str]) -> bool:
    quote, key, separator = match.group(1), match.group(2), match.group(3)
    if separator in ("%3D", "%3d") and match.string[match.start(2) - 1:match.start(2)] == "%":
        # The run began inside the percent escape before the key (`%3Faccess_token`): its
        # first two characters are the escape's, not the key's.
        key = key[2:] if _ENCODED.match(key) else key
    # A bare `pass` or `key` before a colon is prose or a tally ("pass: 12"); a quoted one is
    # a JSON or YAML key.
    return secret_key(key, colon=separator == ":" and not quote)


def _spaced(match: re.Match[str]) -> bool:
    # As before a colon: a bare `KEY` or `PASS` then a word is prose ("PRIMARY KEY constraint").
    return secret_key(match.group(1), colon=True)


def _flagged(match: re.Match[str]) -> bool:
    return secret_key(match.group(1))


def _spaced_value(match: re.Match[str], value: str) -> bool:
    if value.lower() in _PROSE or _harmless(value):
        return False
    # "token count: 512": the next word is a key of its own, not this one's value.
    after = match.end() + len(value)
    return value[-1:] not in (":", "=") and _THEN_ASSIGN.match(match.string, after) is None


def redact(text: str) -> str:
    """`text` with every secret this module knows replaced by `<redacted>`."""
    text = _KEY_BLOCK.sub(MARK, text)
    text = _JWT.sub(MARK, text)
    text = _GITHUB.sub(MARK, text)
    text = _VENDOR.sub(MARK, text)
    text = _WEBHOOK.sub(lambda m: m.group(1) + MARK, text)
    text = _AUTH_HEADER.sub(lambda m: m.group(1) + MARK, text)
    text = _SCHEME.sub(lambda m: m.group(1) + m.group(2) + MARK, text)
    text = _URL_CREDENTIALS.sub(lambda m: m.group(1) + MARK + "@", text)
    text = _by_name(text, _ASSIGN, _assigned)
    text = _by_name(text, _FLAG, _flagged)
    text = _by_name(text, _SPACED, _spaced, _spaced_value)
    return _BASE64_RUN.sub(_base64_run, text)


def redact_lines(lines: list[str]) -> list[str]:
    """Redact a block of lines as one text, so a PEM block spanning lines is caught whole."""
    return redact("\n".join(lines)).split("\n")

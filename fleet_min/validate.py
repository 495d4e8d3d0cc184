"""Hand-written validators for the wire documents; twins of fleet_min/schemas/*.json.

The JSON Schema files are the authoritative definitions. These functions follow them rule for
rule with the standard library only (no jsonschema at run time); tests/test_validate.py runs both
over the same hand-written and generated corpus and fails when they disagree on valid/invalid.

Each validator returns a list of sentences naming the field ("lease.ttl_s must be an integer
from 1 to 86400"); an empty list means valid. Values are never echoed back, so a huge number or a
secret in a document never ends up in an error message.

Types follow JSON Schema 2020-12 as the jsonschema library applies them: a boolean is never an
integer or a number, and a float without a fractional part (3.0) is an integer. An object field
declared an integer that arrives as such a float is stored back as an int when the document is
checked (`priority: 1e2` becomes 100), so what the collector stores and hands on (to agents, to
listings, to SQLite) is the integer the schema promised, not a float a strict reader refuses.

Every rule answers twice: `rule.ok(value)` says whether the value holds, with no strings and
no lists built (it changes nothing but the whole floats above), and `rule(value, path)` lists
the sentences. A document is first asked
`ok`; only a refused one pays for the sentences. Nearly every document an agent posts is valid,
and naming each field's path on the way cost more than the checks themselves (tests hold the
two answers to agree on the whole corpus).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from itertools import pairwise
from typing import Any, TypeGuard

__all__ = [
    "EMBEDDED_REF",
    "MAX_ERRORS",
    "SCHEMA_NAMES",
    "TEMPLATE_REF",
    "find_secret_keys",
    "find_template_refs",
    "is_job_id",
    "load_schema",
    "param_warnings",
    "validate_beacon",
    "validate_job",
    "validate_post_results",
    "validate_register",
    "validate_result",
]

SCHEMA_NAMES = ("job", "result", "beacon", "register")

# At most this many sentences come back (plus one saying that more were left out).
MAX_ERRORS = 20


# ---------------------------------------------------------------------------------------------
# Patterns. Every check uses fullmatch, the whole-string meaning of the schema's ^...$(?!\n).

# Not "." or "..": an id is a segment of URLs (the API's and the dashboard's), where those two
# are steps up the path that no encoding escapes (a browser reads %2e as a dot).
_ID = r"(?!\.\.?\Z)[A-Za-z0-9._:@][A-Za-z0-9._:@-]{0,199}"
_JOB_ID = re.compile(_ID)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CI_STATUS = re.compile(r"[A-Za-z0-9_.-]{1,100}/[A-Za-z0-9_.-]{1,100}@[0-9a-f]{7,40}")
# The job id is matched lazily: in ${jobs.a.b.metrics.c} the id is "a.b" and the key "c"; in the
# ambiguous ${jobs.a.metrics.artifact} the shorter id wins (metric "artifact" of job "a").
_REF_BODY = (r"\$\{jobs\.(?P<job_id>[A-Za-z0-9._:@][A-Za-z0-9._:@-]{0,199}?)"
             r"\.(?:artifact|metrics\.(?P<key>[A-Za-z0-9_.-]{1,200}))\}")
TEMPLATE_REF = re.compile(r"\A" + _REF_BODY + r"\Z")
EMBEDDED_REF = re.compile(_REF_BODY)


def is_job_id(value: object) -> bool:
    """Does value follow the schemas' jobId definition?"""
    return isinstance(value, str) and _JOB_ID.fullmatch(value) is not None


def load_schema(name: str) -> dict[str, Any]:
    """One of the packaged JSON Schemas (`job`, `result`, `beacon`, `register`) as a dict."""
    if name not in SCHEMA_NAMES:
        raise ValueError(f"no schema named {name!r}; known: {', '.join(SCHEMA_NAMES)}")
    text = (resources.files("fleet_min") / "schemas" / f"{name}.json").read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


# ---------------------------------------------------------------------------------------------
# JSON Schema's primitive types, exactly as jsonschema's Draft 2020-12 type checker sees them.

def _is_int(v: object) -> TypeGuard[int | float]:
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (isinstance(v, float) and v.is_integer())


_INT64 = 2**63


def _as_int(v: float) -> int | float:
    """A whole float as the int it equals, within SQLite's 64-bit integers. A larger one stays a
    float: as an int it could not be bound to a column, and 1e308 would become 309 digits, more
    than SQLite's JSON functions and restore's row check take (jsonio.MAX_INTEGER_DIGITS)."""
    return int(v) if -_INT64 <= v < _INT64 else v


def integer_within(v: object, lo: int, hi: int) -> int | None:
    """v as an int when the schema takes it for an integer from lo to hi (3.0 included, as in
    a document); None when it does not (a fraction, a boolean, a string, out of range)."""
    return int(v) if _is_int(v) and lo <= v <= hi else None


def _is_number(v: object) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _within(v: float, lo: float | None, hi: float | None) -> bool:
    # The comparisons jsonschema makes for minimum/maximum (so NaN, which strict JSON cannot
    # carry but Python's json module accepts, passes both).
    return not (lo is not None and v < lo) and not (hi is not None and v > hi)


def _is_ref(v: object) -> bool:
    return isinstance(v, str) and TEMPLATE_REF.match(v) is not None


def _show(key: object) -> str:
    """A key fit for a sentence: quoted and cut short, whatever it contains."""
    text = key if isinstance(key, str) else type(key).__name__
    return json.dumps(text[:60] + ("..." if len(text) > 60 else ""))


def _join(path: str, key: object) -> str:
    name = key if isinstance(key, str) else type(key).__name__
    if len(name) > 80:
        name = name[:80] + "..."
    return f"{path}.{name}" if path else name


# ---------------------------------------------------------------------------------------------
# Checks: a scalar test with the words that describe what it accepts.

@dataclass(frozen=True)
class _Check:
    ok: Callable[[object], bool]
    desc: str
    whole: bool = False  # accepts integers: a whole float found valid is stored back as an int

    def __call__(self, value: object, path: str) -> list[str]:
        return [] if self.ok(value) else [f"{path} must be {self.desc}"]


@dataclass(frozen=True)
class _Rule:
    """A container rule: `errors` names every problem under a path, `ok` only answers."""

    errors: Callable[[object, str], list[str]]
    ok: Callable[[object], bool]
    whole: bool = False  # a container is never an integer (see _Check.whole)

    def __call__(self, value: object, path: str) -> list[str]:
        return self.errors(value, path)


Rule = _Check | _Rule


def _checked(rule: Rule, doc: object) -> list[str]:
    """A whole document's problems; the quick answer first."""
    return [] if rule.ok(doc) else _finish(rule(doc, ""))


def _integer(lo: int | None = None, hi: int | None = None) -> _Check:
    if lo is not None and hi is not None:
        desc = f"an integer from {lo} to {hi}"
    elif lo is not None:
        desc = f"an integer of at least {lo}"
    else:
        desc = "an integer"
    return _Check(lambda v: _is_int(v) and _within(v, lo, hi), desc, whole=True)


def _number(lo: float | None = None, above: float | None = None) -> _Check:
    if above is not None:
        floor = above
        return _Check(lambda v: _is_number(v) and not v <= floor, f"a number greater than {floor}")
    desc = "a number" if lo is None else f"a number of at least {lo}"
    return _Check(lambda v: _is_number(v) and _within(v, lo, None), desc)


def _string(min_len: int = 0, max_len: int | None = None) -> _Check:
    if max_len is None:
        return _Check(lambda v: isinstance(v, str), "a string")
    desc = (f"a string of {min_len} to {max_len} characters" if min_len
            else f"a string of at most {max_len} characters")
    return _Check(lambda v: isinstance(v, str) and min_len <= len(v) <= max_len, desc)


# Characters that reorder the text shown after them (bidirectional embeddings, overrides and
# isolates): a name holding one shows as another (`fleet-1.4-<U+202E>kpa.exe` reads as
# `fleet-1.4-exe.apk`), and the reordering spills into the text beside it on a page. Marks
# (U+200E, U+200F) and joiners stay allowed: right-to-left scripts and emoji need them.
_REORDERING = re.compile("[\u202a-\u202e\u2066-\u2069]")


def written_out(text: str) -> str:
    """Text as a page shows it: each reordering character as [U+202E], so stored free text that
    no label rule covers (a result's error, a metric) cannot reorder what a person reads around
    it. The dashboards do the same in fleet_min/web/common/shown.js."""
    if not _REORDERING.search(text):
        return text
    return _REORDERING.sub(lambda found: f"[U+{ord(found.group()):04X}]", text)

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
LABEL_WORDS = "no control characters and none that reorder the text after them"


def is_label(text: str) -> bool:
    """A one-line name a page shows (a device's name, a pool, a workload, an artifact's name):
    no control characters, none that reorder the text after it."""
    return not _CONTROL.search(text) and not _REORDERING.search(text)


def is_note(text: str) -> bool:
    """Free text a page shows (a device's notes): lines and tabs allowed, otherwise as a label."""
    return not _CONTROL_BUT_LINES.search(text) and not _REORDERING.search(text)


def _label(min_len: int, max_len: int) -> _Check:
    return _Check(lambda v: isinstance(v, str) and min_len <= len(v) <= max_len
                  and is_label(v),
                  f"a string of {min_len} to {max_len} characters ({LABEL_WORDS})")


def keeps_order(text: str) -> bool:
    """Text that reorders nothing shown after it, control characters allowed: what a device
    reports of itself (its model, its OS), which agents in the field send as they read it."""
    return not _REORDERING.search(text)


_LABEL_TEXT = _Check(lambda v: isinstance(v, str) and is_label(v), f"a string ({LABEL_WORDS})")
_IN_ORDER_TEXT = _Check(lambda v: isinstance(v, str) and keeps_order(v),
                        "a string (none of its characters may reorder the text after them)")


def _one_of(*choices: str) -> _Check:
    words = [json.dumps(c) for c in choices]
    desc = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
    return _Check(lambda v: isinstance(v, str) and v in choices, desc)


def _either(first: _Check, second: _Check) -> _Check:
    return _Check(lambda v: first.ok(v) or second.ok(v), f"{first.desc} or {second.desc}",
                  whole=first.whole or second.whole)


_BOOL = _Check(lambda v: isinstance(v, bool), "true or false")
_STRING = _string()
_NULL = _Check(lambda v: v is None, "null")
_ID_CHECK = _Check(lambda v: isinstance(v, str) and _JOB_ID.fullmatch(v) is not None,
                   "1 to 200 letters, digits or . _ : @ - (not starting with -, not . or ..)")
_SHA = _Check(lambda v: isinstance(v, str) and _SHA256.fullmatch(v) is not None,
              "a sha256 of 64 lowercase hex digits")
_REF = _Check(_is_ref,
              "a template reference (${jobs.<id>.artifact} or ${jobs.<id>.metrics.<key>})")
_SCHEMA_1 = _Check(lambda v: _is_number(v) and v == 1, "1", whole=True)


def _or_ref(check: _Check) -> _Check:
    return _either(check, _REF)


def _or_null(check: _Check) -> _Check:
    return _either(check, _NULL)


# ---------------------------------------------------------------------------------------------
# Containers.

def _array(item: Rule | None, what: str, max_items: int | None = None,
           unique: bool = False, or_ref: bool = False) -> Rule:
    def ok(value: object) -> bool:
        if or_ref and _is_ref(value):
            return True
        if not isinstance(value, list) or (max_items is not None and len(value) > max_items):
            return False
        if item is not None and not all(item.ok(entry) for entry in value):
            return False
        strings = [e for e in value if isinstance(e, str)] if unique else []
        return len(set(strings)) == len(strings)

    def errors(value: object, path: str) -> list[str]:
        if or_ref and _is_ref(value):
            return []
        if not isinstance(value, list):
            return [f"{path} must be {what}"]
        errors = []
        if max_items is not None and len(value) > max_items:
            errors.append(f"{path} must have at most {max_items} entries")
        for i, entry in enumerate(value):
            if item is None or len(errors) > MAX_ERRORS:
                break
            errors += item(entry, f"{path}[{i}]")
        strings = [e for e in value if isinstance(e, str)] if unique else []
        if len(set(strings)) < len(strings):
            errors.append(f"{path} must not name the same entry twice")
        return errors
    return _Rule(errors, ok)


def _object(fields: dict[str, Rule], required: tuple[str, ...] = (), closed: bool = False,
            what: str = "an object") -> Rule:
    def ok(value: object) -> bool:
        if not isinstance(value, dict):
            return False
        for key in required:
            if key not in value:
                return False
        for key, item in value.items():  # the document's few keys, not every field known
            check = fields.get(key)
            if check is None:
                if closed:
                    return False
            elif not check.ok(item):
                return False
            elif item.__class__ is float and check.whole:
                # Valid, so whole: the int the schema promised (assigning to a key that is
                # there already leaves the dict's size, and so this iteration, alone).
                value[key] = _as_int(item)
        return True

    def errors(value: object, path: str) -> list[str]:
        if not isinstance(value, dict):
            return [f"{path} must be {what}"]
        errors = [f"{_join(path, k)} is required" for k in required if k not in value]
        for key, check in fields.items():
            if key in value:
                errors += check(value[key], _join(path, key))
        if closed:
            unknown = [k for k in value if k not in fields]
            errors += [_unknown_field(path, k, fields) for k in unknown[:3]]
        return errors
    return _Rule(errors, ok)


def _unknown_field(path: str, key: object, fields: dict[str, Rule]) -> str:
    """The sentence for a key a closed object does not know, naming the close match (a typo)
    when there is one, else every field allowed there."""
    import difflib  # only a refusal needs it; idle collectors never import it

    where = path or "the job spec"
    close = difflib.get_close_matches(key[:100], list(fields), n=1) if isinstance(key, str) else []
    hint = f"; did you mean {_show(close[0])}?" if close else f"; allowed: {', '.join(fields)}"
    return f"{where} has an unknown field {_show(key)}{hint}"


def _finish(errors: list[str]) -> list[str]:
    if len(errors) > MAX_ERRORS:
        return [*errors[:MAX_ERRORS], "further problems are not listed"]
    return errors


# ---------------------------------------------------------------------------------------------
# Job spec (schemas/job.json).

_COUNT = _or_ref(_integer(1))
_STRING_LIST = _array(_STRING, "an array of strings or a template reference", or_ref=True)
_NON_NEGATIVE = _or_ref(_number(lo=0))
_POSITIVE = _or_ref(_number(above=0))
_SHA_OR_REF = _or_ref(_SHA)


_STRINGS = _array(_STRING, "a string or an array of strings")


_STRING_OR_STRINGS = _Rule(
    lambda value, path: [] if isinstance(value, str) else _STRINGS(value, path),
    lambda value: isinstance(value, str) or _STRINGS.ok(value))


_EVAL_PARAMS: dict[str, Rule] = {"input_sha256": _SHA_OR_REF, "max_items": _COUNT}
_SOAK_PARAMS: dict[str, Rule] = {
    "flow": _STRING, "duration_s": _NON_NEGATIVE, "interval_s": _POSITIVE,
}
# Known params per workload (the spec's parameter table); unknown keys stay allowed.
_WORKLOAD_PARAMS: dict[str, dict[str, Rule]] = {
    "benchmark": {"prompt_tokens": _COUNT, "gen_tokens": _COUNT,
                  "warmup_iters": _or_ref(_integer(0)), "measure_iters": _COUNT},
    "thermal": {"prompt_tokens": _COUNT, "gen_tokens": _COUNT, "duration_s": _NON_NEGATIVE},
    "batch": {"input_sha256": _SHA_OR_REF, "max_items": _COUNT, "max_tokens": _COUNT},
    "pipeline": {"topic": _STRING, "max_tokens": _COUNT},
    "vision-eval": _EVAL_PARAMS,
    "speech-eval": _EVAL_PARAMS,
    "embed-eval": _EVAL_PARAMS,
    "vantage": {"urls": _STRING_LIST, "repeats": _COUNT},
    "model-convert": {"input_sha256": _SHA_OR_REF, "formats": _STRING_LIST, "quant": _STRING},
    "dataset-prep": {"source": _STRING, "max_items": _COUNT, "split": _STRING},
    "serve": {"port": _or_ref(_integer(1, 65535)), "bind": _STRING},
    "shell": {"script_sha256": _SHA_OR_REF, "args": _STRING_LIST},
    "build": {k: _STRING for k in ("repo", "ref", "kind", "task", "app")},
    "cold-start": {
        "app_id": _STRING, "launches": _COUNT,
        "states": _array(_or_ref(_one_of("cold", "warm", "hot")),
                         "an array of cold, warm or hot, or a template reference", or_ref=True),
    },
    "app-soak": _SOAK_PARAMS,
    "soak": _SOAK_PARAMS,
    "a11y-audit": {"variants": _STRING_LIST, "min_target_pt": _NON_NEGATIVE,
                   "font_scale": _POSITIVE},
    "locale-shots": {"flow": _STRING, "locales": _STRING_LIST},
    "web-test": {"browser": _STRING_OR_STRINGS},
    "web-shots": {"browser": _STRING_LIST},
    "drain": {"duration_s": _NON_NEGATIVE, "track": _STRING},
    "archive": {"source": _STRING, "app": _STRING, "account": _STRING},
    "digest": {"app": _STRING, "days": _COUNT},
}
_PARAMS_COMMON: dict[str, Rule] = {"resume_from": _SHA_OR_REF}
_PARAMS_DEFAULT = _object(_PARAMS_COMMON)
_PARAMS_BY_WORKLOAD = {w: _object({**_PARAMS_COMMON, **f}) for w, f in _WORKLOAD_PARAMS.items()}

# The params the spec's table names for each workload (resume_from is the collector's own).
# Params stay open: a job naming another is stored, with a warning (a typo is the usual cause).
# soak is left out: its params beyond app-soak's are "not shown" by the spec.
_NAMED_PARAMS: dict[str, frozenset[str]] = {
    **{w: frozenset(f) for w, f in _WORKLOAD_PARAMS.items() if w != "soak"},
    "a11y-audit": frozenset({*_WORKLOAD_PARAMS["a11y-audit"], "steps"}),  # untyped in the spec
    **dict.fromkeys(("self-check", "install", "ui-test", "web-audit", "web-unfurl"),
                    frozenset()),
}
MAX_WARNINGS = 20


def param_warnings(spec: Mapping[str, Any]) -> list[str]:
    """Sentences for params a table workload does not name ("unknown param 'measure_itters'
    for benchmark; did you mean 'measure_iters'?"), at most MAX_WARNINGS; [] for the usual spec
    and for workloads outside the table."""
    params, workload = spec.get("params"), spec.get("workload")
    named = _NAMED_PARAMS.get(workload) if isinstance(workload, str) else None
    if named is None or not isinstance(params, dict):
        return []
    import difflib  # only a warning needs it, as in _unknown_field

    found: list[str] = []
    for key in params:
        if key in named or key == "resume_from" or not isinstance(key, str):
            continue
        close = difflib.get_close_matches(key[:100], sorted(named), n=1)
        hint = (f"; did you mean {close[0]!r}?" if close
                else f"; it names {', '.join(sorted(named))}" if named else "; it names none")
        found.append(f"unknown param {key[:60]!r} for {workload}{hint}")
        if len(found) == MAX_WARNINGS:
            break
    return found


_FANOUT_OBJECT = _object({"distinct": _string(1, 100)}, required=("distinct",), closed=True)


def _fanout_errors(value: object, path: str) -> list[str]:
    if isinstance(value, bool):
        return []
    if isinstance(value, dict):
        return _FANOUT_OBJECT(value, path)
    return [f'{path} must be true, false or an object {{"distinct": "<descriptor field>"}}']


_FANOUT = _Rule(_fanout_errors,
                lambda value: isinstance(value, bool) or _FANOUT_OBJECT.ok(value))


_NAME = _label(1, 100)
SUITE_KINDS = ("flow_runner", "native_bundle", "browser_runner")
SUITE_KIND_ALIASES = {"maestro": "flow_runner", "xcuitest": "native_bundle",
                      "playwright": "browser_runner"}
_CI_TARGET = _Check(lambda v: isinstance(v, str) and _CI_STATUS.fullmatch(v) is not None,
                    "of the form owner/repo@<commit sha, 7 to 40 lowercase hex digits>")
_JOB_FIELDS: dict[str, Rule] = {
    "schema": _SCHEMA_1,
    "job_id": _ID_CHECK,
    "workload": _NAME,
    "executor": _one_of("device", "host"),
    "backend": _NAME,
    "model": _object({"name": _STRING, "format": _STRING, "quant": _STRING,
                      "sha256": _SHA_OR_REF}),
    "params": _PARAMS_DEFAULT,
    "targets": _object({
        "match": _string(0, 1000), "device_id": _ID_CHECK, "executor": _STRING,
        "pool": _LABEL_TEXT, "exclusive": _BOOL, "url": _STRING, "device_kind": _LABEL_TEXT,
    }, closed=True),
    "constraints": _object({
        "require_charging": _BOOL,
        "min_battery_pct": _integer(0, 100),
        "require_ac": _BOOL,
        "require_idle_s": _integer(0, 604800),
        "max_load": _number(lo=0),
        "window": _object({"from": _integer(0, 23), "to": _integer(0, 23)},
                          required=("from", "to"), closed=True),
    }, closed=True),
    "lease": _object({"ttl_s": _integer(1, 86400), "max_attempts": _integer(1, 100)},
                     closed=True),
    "depends_on": _array(_ID_CHECK, "an array of job ids", max_items=100, unique=True),
    "fanout": _FANOUT,
    "preemptible": _BOOL,
    "app": _object({
        "name": _STRING, "build": _STRING, "platform": _STRING,
        "sha256": _either(_SHA, _or_ref(_one_of("latest"))),
    }),
    # maestro and xcuitest, and report_to.github_status: the names the clients already in the
    # field send (decisions.md); stored in the neutral form (fleet_min/collector/jobs/compat.py).
    "suite": _object({"kind": _or_ref(_one_of(*SUITE_KINDS, *SUITE_KIND_ALIASES)),
                      "flows": _STRING}),
    "report_to": _object({"ci_status": _CI_TARGET, "github_status": _CI_TARGET}, closed=True),
    "priority": _integer(-1000, 1000),
}
_JOB_REQUIRED = ("schema", "job_id", "workload", "executor")


# The params a job may carry depend on its workload: one job rule per workload, built once.
# Closed at the top level: a misspelt field (`parms`, `prioriy`) is refused, not ignored.
_JOB_DEFAULT = _object(_JOB_FIELDS, required=_JOB_REQUIRED, closed=True)
_JOB_BY_WORKLOAD = {workload: _object({**_JOB_FIELDS, "params": params}, required=_JOB_REQUIRED,
                                      closed=True)
                    for workload, params in _PARAMS_BY_WORKLOAD.items()}


def _job_rule(doc: dict[str, Any]) -> Rule:
    workload = doc.get("workload")
    return _JOB_BY_WORKLOAD.get(workload, _JOB_DEFAULT) if isinstance(
        workload, str) else _JOB_DEFAULT


def validate_job(doc: object) -> list[str]:
    """Problems with a job spec (body of POST /jobs); [] when it follows schemas/job.json."""
    if not isinstance(doc, dict):
        return ["the job spec must be a JSON object"]
    return _checked(_job_rule(doc), doc)


# ---------------------------------------------------------------------------------------------
# Result row (schemas/result.json).

_NUMBER = _number()
_METRIC_SUFFIXES = ("_ms", "_tok_s", "_pct", "_mb")
_NAMED_METRIC_FIELDS: dict[str, Rule] = {
    "images_per_s": _NUMBER,
    "drain_pct_per_h": _NUMBER,
    "synthetic_digest": _SHA,
    "synthetic_rounds": _integer(0),
    "mem_method": _STRING,
    "thermal": _array(None, "an array of samples"),
}
_NAMED_METRICS = _object(_NAMED_METRIC_FIELDS)


def _metrics_errors(value: object, path: str) -> list[str]:
    errors = _NAMED_METRICS(value, path)
    if isinstance(value, dict):
        for key, metric in value.items():
            if isinstance(key, str) and key.endswith(_METRIC_SUFFIXES):
                errors += _NUMBER(metric, _join(path, key))
            if len(errors) > MAX_ERRORS:
                break
    return errors


def _metrics_ok(value: object) -> bool:
    """The answer of _metrics_errors in one walk of the metrics (every result row has them):
    a named metric meets its own rule, a suffixed one is a number."""
    if not isinstance(value, dict):
        return False
    named = _NAMED_METRIC_FIELDS
    for key, metric in value.items():
        rule = named.get(key)
        if rule is not None:
            if not rule.ok(metric):
                return False
            if metric.__class__ is float and rule.whole:  # as _object does (see the top)
                value[key] = _as_int(metric)
        if isinstance(key, str) and key.endswith(_METRIC_SUFFIXES) and not _is_number(metric):
            return False
    return True


_METRICS = _Rule(_metrics_errors, _metrics_ok)


_NULLABLE_STRING = _or_null(_STRING)
_ATTEMPT = _integer(1, 1000000)  # the attempt number the claimed job carried
_RESULT = _object({
    "schema": _SCHEMA_1,
    "kind": _one_of("result"),
    "device_id": _ID_CHECK,
    "job_id": _ID_CHECK,
    "iter": _integer(0, 1000000),
    "attempt": _ATTEMPT,
    "metrics": _METRICS,
    "final": _BOOL,
    "ok": _BOOL,
    "preempted": _BOOL,
    "error": _or_null(_string(0, 4000)),
    "device": _object({k: _NULLABLE_STRING for k in ("model", "soc", "os")}),
    "artifacts": _array(_SHA, "an array of sha256 strings", max_items=100),
    "executor": _string(1, 200),
}, required=("schema", "kind", "device_id", "job_id"))  # no iter: iteration 0 (decisions.md)


def validate_result(doc: object) -> list[str]:
    """Problems with a result row (POST /results, kind "result"); [] when valid."""
    if not isinstance(doc, dict):
        return ["the result must be a JSON object"]
    return _checked(_RESULT, doc)


# ---------------------------------------------------------------------------------------------
# Beacon (schemas/beacon.json).

_BEACON = _object({
    "schema": _SCHEMA_1,
    "kind": _one_of("beacon"),
    "device_id": _ID_CHECK,
    "job_id": _or_null(_ID_CHECK),
    "attempt": _ATTEMPT,
    "beacon": _object({
        "battery_pct": _integer(0, 100),
        "charging": _BOOL,
        "thermal": _STRING,
        "mem_mb": _NUMBER,
        "mem_pressure": _STRING,
        # The constraint fields as the agents in the field name them, and the earlier names
        # ac and load; null: the probe cannot tell (a constraint on it fails closed).
        "on_ac": _or_null(_BOOL),
        "idle_s": _or_null(_number(lo=0)),
        "load_1m": _or_null(_number(lo=0)),
        "disk_free_gb": _or_null(_number(lo=0)),
        "ac": _or_null(_BOOL),
        "load": _or_null(_number(lo=0)),
        "busy": _object({"job_id": _string(0, 200), "collector": _string(0, 2000)},
                        required=("job_id", "collector")),
    }),
}, required=("schema", "kind", "device_id"))


def validate_beacon(doc: object) -> list[str]:
    """Problems with a beacon (POST /results, kind "beacon"); [] when valid."""
    if not isinstance(doc, dict):
        return ["the beacon must be a JSON object"]
    return _checked(_BEACON, doc)


def validate_post_results(doc: object) -> list[str]:
    """Problems with a POST /results body, checked as a result row or a beacon by its kind."""
    if not isinstance(doc, dict):
        return ["the body must be a JSON object"]
    kind = doc.get("kind")
    if isinstance(kind, str) and kind == "result":
        return validate_result(doc)
    if isinstance(kind, str) and kind == "beacon":
        return validate_beacon(doc)
    if "kind" not in doc:
        return ['kind is required: "result" or "beacon"']
    return ['kind must be "result" or "beacon"']


# ---------------------------------------------------------------------------------------------
# Registration body (schemas/register.json).

_DESCRIPTOR_INTEGERS = ("ram_mb", "cpu_cores", "vram_mb")
_DESCRIPTOR_STRINGS = ("model", "soc", "os", "app_ver", "arch", "platform", "kind", "gpu")
_REGISTER = _object({
    "device_id": _ID_CHECK,
    "descriptor": _object({
        **{k: _or_null(_integer(0)) for k in _DESCRIPTOR_INTEGERS},
        **{k: _or_null(_IN_ORDER_TEXT) for k in _DESCRIPTOR_STRINGS},
    }),
    "pools": _array(_label(1, 100), "an array of pool labels", max_items=64),
    "capabilities": _array(_label(1, 200), "an array of capability names", max_items=256),
    "ttl_s": _integer(10, 31536000),
}, required=("device_id",))


def validate_register(doc: object) -> list[str]:
    """Problems with a device registration body (POST /devices/register); [] when valid."""
    if not isinstance(doc, dict):
        return ["the registration body must be a JSON object"]
    return _checked(_REGISTER, doc)


# ---------------------------------------------------------------------------------------------
# Template references and secret-looking keys, found anywhere in a document.

def find_template_refs(value: object) -> list[tuple[str, str, str | None]]:
    """Every ${jobs.<id>.artifact} / ${jobs.<id>.metrics.<key>} in the strings under value.

    Whole-string and embedded references alike, in document order, each once, as
    (job_id, "artifact", None) or (job_id, "metrics", key). Keys of objects are not scanned.
    Iterative and linear in the size of value, however deep it nests.
    """
    found: dict[tuple[str, str, str | None], None] = {}
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            for m in EMBEDDED_REF.finditer(item) if "${" in item else ():
                key = m.group("key")
                found[(m.group("job_id"), "metrics" if key else "artifact", key)] = None
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list):
            stack.extend(reversed(item))
    return list(found)


_SECRET_WORDS = frozenset({
    "token", "secret", "secrets", "password", "passwords", "passwd", "passphrase",
    "apikey", "apikeys", "bearer", "privatekey", "accesskey",
})
_SECRET_PAIRS = frozenset({
    ("api", "key"), ("api", "keys"), ("access", "key"), ("private", "key"),
    ("credential", "value"),
})
# A key whose last word is one of these names a credential (the agent resolves it locally).
_NAMING_WORDS = frozenset({"name", "ref", "id", "item"})
_WORD = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")
# A key whose last word is one of these names the environment variable the agent reads the
# credential from (password_var: "APP_TEST_PASSWORD"); its value must look like one, so a secret
# put there by mistake (password_var: "hunter2") is still refused.
_VARIABLE_WORDS = frozenset({"var", "env"})
_VARIABLE_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")


@lru_cache(maxsize=4096)
def _names_a_secret(key: str) -> bool:
    words = [w.lower() for w in _WORD.findall(key)]
    if not words or words[-1] in _NAMING_WORDS:
        return False
    if any(w in _SECRET_WORDS for w in words):
        return True
    return any(pair in _SECRET_PAIRS for pair in pairwise(words))


def _names_a_variable(key: str, value: object) -> bool:
    """Is this secret-like key one that names an environment variable, holding a name?"""
    return (isinstance(value, str) and _VARIABLE_NAME.fullmatch(value) is not None
            and _WORD.findall(key)[-1].lower() in _VARIABLE_WORDS)


# Where a value sits, in constant space: (first steps, last steps, depth). A path deeper than
# 2 * _PATH_ENDS steps is shown with "(...)" in the middle, so that a deeply nested document
# costs linear time, not the square of its depth.
_Where = tuple[tuple[str, ...], tuple[str, ...], int]
_PATH_ENDS = 8


def _step(where: _Where, token: str) -> _Where:
    head, tail, depth = where
    if len(head) < _PATH_ENDS:
        head = (*head, token)
    return head, (*tail[1 - _PATH_ENDS:], token), depth + 1


def _where_text(where: _Where) -> str:
    head, tail, depth = where
    missing = depth - len(head)
    if missing <= 0:
        tokens = head
    elif missing <= len(tail):
        tokens = (*head, *tail[len(tail) - missing:])
    else:
        tokens = (*head, ".(...)", *tail)
    return "".join(tokens).removeprefix(".")


def scan_keys_and_strings(doc: object) -> tuple[bool, bool]:
    """In one walk: does a key under doc name a secret, and may a string under doc hold a
    template reference ("${")? The usual job spec has neither, and then neither of the finer
    searches (find_secret_keys, find_template_refs) need walk it again. When a secret-like key
    turns up the walk stops there and the second answer is a cautious True."""
    # Plain loops, no generators: every job spec passes through here.
    templated = isinstance(doc, str) and "${" in doc
    stack = [doc]
    while stack:
        value = stack.pop()
        items: Iterable[object]
        if isinstance(value, dict):
            for key in value:
                if (isinstance(key, str) and _names_a_secret(key)
                        and not _names_a_variable(key, value[key])):
                    return True, True
            items = value.values()
        elif isinstance(value, list):
            items = value
        else:
            continue
        for item in items:
            if isinstance(item, (dict, list)):
                stack.append(item)
            elif not templated and isinstance(item, str) and "${" in item:
                templated = True
    return False, templated


def find_secret_keys(doc: object) -> list[str]:
    """Paths of keys named like secrets (password, api_key, authToken ...) anywhere under doc.

    A key is split on _ - . and camelCase into words; it is secret-like when a word is token,
    secret, password, passwd, apikey, bearer (and a few plurals and spellings) or two neighbouring
    words are api+key, access+key, private+key or credential+value. Keys ending in a naming word
    (_name, _ref, _id, _item) are exempt: they name a credential. Plurals such as max_tokens are
    not secrets. A key ending in _var or _env (password_var) names the environment variable the
    agent reads a credential from and is not a secret while its value is such a name (capitals,
    digits and _). Paths come in document order, like "params.env[1].GITHUB_TOKEN".
    """
    if not scan_keys_and_strings(doc)[0]:
        return []  # the usual case, found without keeping track of paths
    found: list[str] = []
    # Entries: (where, value, is_secret_key). Scalars are pushed only under a secret key.
    stack: list[tuple[_Where, object, bool]] = [(((), (), 0), doc, False)]
    while stack:
        where, value, secret = stack.pop()
        if secret:
            found.append(_where_text(where))
        children: list[tuple[_Where, object, bool]] = []
        if isinstance(value, dict):
            for key, item in value.items():
                secret = (isinstance(key, str) and _names_a_secret(key)
                          and not _names_a_variable(key, item))
                if secret or isinstance(item, dict | list):
                    children.append((_step(where, "." + _join("", key)), item, secret))
        elif isinstance(value, list):
            children = [(_step(where, f"[{i}]"), item, False)
                        for i, item in enumerate(value) if isinstance(item, dict | list)]
        stack.extend(reversed(children))
    return found

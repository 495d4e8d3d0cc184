"""What a restored backup's rows may hold: only values of the kinds the collector itself writes.

A backup's schema is never installed (backup_check.rebuild makes a fresh one), but its rows are,
and SQLite stores whatever it is given in any column: text in a REAL column, invalid UTF-8 in a
TEXT one, `not json` where a job's spec is kept. A collector that restored such a row answered
500 on every listing that met it (one bad job hid the whole job list), and one schedule whose
template lacked a workload stopped every schedule's tick, because the readers trust what the
collector wrote itself. So before a rebuilt database is installed every row is checked here:

- each column holds its declared kind: an INTEGER column an integer, a REAL column a finite
  number, a TEXT column text that is valid UTF-8 (NULL only where the schema allows it);
- the columns in `COLUMNS` hold what their writers write: a time `timeutil.iso` can word
  (years 1 to 9999), 0 or 1 for a flag, one of the states the code knows, a SHA-256 in
  lowercase hex, a schedule's minute, a match expression that compiles, and JSON of the shape
  the readers take (an object, an array, an array of strings, a job spec whose workload,
  executor and nested objects are there), nested at most STORED_DEPTH levels, with no number
  past a float's range (which would be read back as infinity);
- a column missing here (an older schema version has fewer) is held to its declared type.

SQLite checks most of this itself in one pass a table; Python then decodes each row's text
once (UTF-8, depth, numbers) and parses the few columns no SQL function can judge. The first row
that breaks a rule is named (its rowid), with the column and why. About 3.5 s for a million
results rows on the machine of docs/performance.md.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from fleet_min import jsonio
from fleet_min.db import quote_identifier

# The times timeutil.iso words with a four-digit year: 0001-01-01 to 9999-12-31 (UTC).
EARLIEST_TIME = -62_135_596_800.0
LATEST_TIME = 253_402_300_799.0

# Deeper than any document a collector stored: request bodies are held to jsonio.MAX_DEPTH now,
# and older versions parsed each body with the json module inside a request's stack, which
# stops short of 1,000 levels. A deeper one could only have been written by hand, and a reader
# falling back to the json module would meet a RecursionError in it.
STORED_DEPTH = 1000

# Kept in step with the enums they come from by tests/collector/test_row_check.py.
JOB_STATUSES = ("queued", "waiting", "claimed", "done", "failed", "cancelled")
EXECUTORS = ("device", "host")
ATTEMPT_OUTCOMES = ("done", "failed", "cancelled", "released", "preempted", "expired",
                    "undelivered")
ALERT_RULES = ("device-offline", "job-failed", "job-stuck", "thermal-critical", "low-battery",
               "schedule-missed", "disk-size", "benchmark-regressed")
ALERT_STATES = ("open", "resolved")
WEBHOOK_STATES = ("pending", "delivered", "failed", "folded")
RUN_OUTCOMES = ("enqueued", "skipped", "failed")
CI_STATES = ("pending", "success", "failure", "error")


def _enum(values: tuple[str, ...]) -> str:
    return "enum:" + ",".join(values)


# table -> column -> rule (see _RULE_SQL and _WANTED). Columns not named: their declared type.
COLUMNS: dict[str, dict[str, str]] = {
    "meta": {"value": "meta-value"},
    "devices": {"descriptor": "json:object", "pools": "json:strings",
                "pools_override": "json:strings", "capabilities": "json:strings",
                "last_beacon": "json:object", "first_seen": "time", "last_seen": "time",
                "registered_at": "time", "last_beacon_at": "time", "busy_at": "time"},
    "jobs": {"status": _enum(JOB_STATUSES), "executor": _enum(EXECUTORS), "match": "match",
             "spec": "json:spec", "warnings": "json:strings", "exclusive": "bool",
             "preemptible": "bool", "is_group": "bool", "has_dependents": "bool",
             "lease_deadline": "time", "created_at": "time", "updated_at": "time",
             "claimed_at": "time", "finished_at": "time"},
    "job_attempts": {"outcome": _enum(ATTEMPT_OUTCOMES), "claimed_at": "time",
                     "ended_at": "time"},
    "device_locks": {"locked_at": "time"},
    "results": {"metrics": "json:object", "artifacts": "json:strings", "device": "json:object",
                "extra": "json:object", "ok": "bool", "final": "bool", "preempted": "bool",
                "created_at": "time"},
    "beacons": {"body": "json:object", "at": "time"},
    "artifacts": {"sha256": "sha256", "baseline": "bool", "created_at": "time"},
    "schedules": {"template": "json:spec", "enabled": "bool", "last_slot": "slot",
                  "last_run": "time", "next_run": "time", "created_at": "time",
                  "updated_at": "time"},
    "schedule_runs": {"slot": "run-slot", "outcome": _enum(RUN_OUTCOMES), "at": "time"},
    "alerts": {"rule": _enum(ALERT_RULES), "state": _enum(ALERT_STATES),
               "webhook_state": _enum(WEBHOOK_STATES), "webhook_summary": "json:summary",
               "first_seen": "time", "last_seen": "time", "resolved_at": "time",
               "acked_at": "time", "snoozed_until": "time"},
    "topic_events": {"payload": "json:any", "at": "time"},
    "ci_statuses": {"state": _enum(CI_STATES), "dry_run": "bool", "at": "time"},
    "executor_nodes": {"bound_at": "time", "seen_at": "time"},
    "executors": {"capabilities": "json:strings", "first_seen": "time", "last_poll": "time",
                  "registered_at": "time"},
    "job_templates": {"spec": "json:spec", "created_at": "time", "updated_at": "time"},
    "visual_baselines": {"sha256": "sha256", "accepted_at": "time"},
    "visual_diffs": {"baseline": "sha256", "capture": "sha256", "computed_at": "time"},
}

# A job spec's members that its readers take as objects when they are there and truthy.
_SPEC_OBJECTS = ("$.targets", "$.lease", "$.constraints", "$.params", "$.report_to",
                 "$.constraints.window")


def _optional_object(q: str, path: str) -> str:
    """SQL: the member at `path` is absent, an object, or a value Python reads as false."""
    kind = f"json_type({q}, '{path}')"
    return (f"({kind} IS NULL OR {kind} IN ('object', 'null', 'false') OR "
            f"({kind} IN ('integer', 'real') AND json_extract({q}, '{path}') = 0) OR "
            f"({kind} = 'text' AND json_extract({q}, '{path}') = '') OR "
            f"({kind} = 'array' AND json_array_length({q}, '{path}') = 0))")


def _strings(q: str, path: str = "$") -> str:
    return f"NOT EXISTS (SELECT 1 FROM json_each({q}, '{path}') WHERE type != 'text')"


def _spec_sql(q: str) -> str:
    depends = f"json_type({q}, '$.depends_on')"
    return " AND ".join([
        f"json_type({q}) = 'object'", f"json_type({q}, '$.workload') = 'text'",
        f"json_extract({q}, '$.executor') IN ({', '.join(repr(e) for e in EXECUTORS)})",
        *(_optional_object(q, path) for path in _SPEC_OBJECTS),
        f"({depends} IS NULL OR {depends} = 'null' OR ({depends} = 'array' AND "
        f"{_strings(q, '$.depends_on')}))"])


def _if_json(q: str, shape: str) -> str:
    """SQL: the value is valid JSON and `shape` holds. A CASE, because SQLite may evaluate the
    operands of AND in any order, and a JSON function on text that is not JSON is an error."""
    return f"CASE WHEN json_valid({q}) THEN {shape} ELSE 0 END"


_DIGITS = "[0-9]" * 12
# rule -> SQL true for a good non-NULL TEXT value ({q} is the quoted column); the value is
# known to be text when this runs. Rules of other declared types are in _typed.
_RULE_SQL: dict[str, Callable[[str], str]] = {
    "sha256": lambda q: f"(length({q}) = 64 AND {q} NOT GLOB '*[^0-9a-f]*')",
    "json:any": lambda q: f"json_valid({q})",
    "json:object": lambda q: _if_json(q, f"json_type({q}) = 'object'"),
    "json:strings": lambda q: _if_json(q, f"json_type({q}) = 'array' AND {_strings(q)}"),
    "json:spec": lambda q: _if_json(q, _spec_sql(q)),
    "json:summary": lambda q: _if_json(q, (
        f"json_type({q}) = 'object' AND json_type({q}, '$.alerts') = 'integer' AND "
        f"json_type({q}, '$.last_id') = 'integer' AND json_type({q}, '$.rules') = 'object' "
        f"AND NOT EXISTS (SELECT 1 FROM json_each({q}, '$.rules') WHERE type != 'integer')")),
    "slot": lambda q: f"{q} GLOB '{_DIGITS}'",
    "run-slot": lambda q: f"({q} GLOB '{_DIGITS}' OR {q} GLOB 'manual-{'[0-9]' * 14}')",
    # meta.value is JSON only for the scheduler's clock mark: {"at": seconds, "tz": name}.
    "meta-value": lambda q: (
        "CASE WHEN \"key\" != 'scheduler_clock' THEN 1 ELSE " + _if_json(q, (
            f"json_type({q}) = 'object' AND json_type({q}, '$.at') IN ('integer', 'real') AND "
            f"abs(json_extract({q}, '$.at')) <= 1e300 AND json_type({q}, '$.tz') = 'text'"))
        + " END"),
}

_WANTED = {
    "time": "a time (epoch seconds, years 1 to 9999)",
    "bool": "0 or 1",
    "sha256": "a SHA-256 in 64 lowercase hex digits",
    "json:any": "a JSON document",
    "json:object": "a JSON object",
    "json:strings": "a JSON array of strings",
    "json:spec": "a job spec (a JSON object with a workload, an executor of device or host, "
                 "objects where it keeps objects and depends_on a list of job ids)",
    "json:summary": "a webhook summary (a JSON object of counts)",
    "slot": "a schedule's minute, YYYYMMDDHHMM",
    "run-slot": "a schedule's minute, YYYYMMDDHHMM, or manual- and a time",
    "match": "a match expression",
    "meta-value": "the scheduler's clock mark (a JSON object with at and tz)",
}


@dataclass
class BadRow(ValueError):
    """A row the collector's readers cannot take, named by `where` (its rowid or key)."""
    table: str
    column: str
    where: str
    why: str
    key: Any = None  # as read: the rowid, or the key's bytes in SQL's X'..' form

    def __str__(self) -> str:
        return f"table {self.table!r}, {self.where}, column {self.column!r}: {self.why}"


# Tables of records that no other row refers to: a result row, a beacon, a topic's event, a CI
# status posted, a schedule's run, an alert, a visual diff. A restore may leave such a row out
# (restore --leave-out-bad-rows) and lose only that record. A job, a device, a schedule or any
# other row that others name is never left out: its absence would leave them dangling.
LEAVE_OUT_TABLES = frozenset({"results", "beacons", "topic_events", "ci_statuses",
                              "schedule_runs", "alerts", "visual_diffs"})
EXAMPLES = 20  # rows named of those left out from one table; the rest are counted


@dataclass
class LeftOut:
    """The rows of one table a restore left out."""
    table: str
    count: int = 0
    examples: list[BadRow] = field(default_factory=list)

    def add(self, bad: BadRow) -> None:
        self.count += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(bad)


@dataclass(frozen=True)
class _Column:
    name: str
    declared: str  # INTEGER, REAL or TEXT (upper case)
    nullable: bool
    rule: str  # "" when the declared type is the whole rule



def _columns(conn: sqlite3.Connection, table: str) -> list[_Column]:
    rules = COLUMNS.get(table, {})
    return [_Column(name, (kind or "").upper(), not notnull and not pk, rules.get(name, ""))
            for _, name, kind, notnull, _, pk in conn.execute(
                f"PRAGMA main.table_info({quote_identifier(table)})")]


def _typed(column: _Column) -> str:
    """SQL true when the column's value is of its kind (checked by SQLite, in one pass)."""
    q = quote_identifier(column.name)
    if column.declared == "INTEGER":
        ok = f"typeof({q}) = 'integer'"
        if column.rule == "bool":
            ok = f"({ok} AND {q} IN (0, 1))"
    elif column.declared == "REAL":
        low, top = (EARLIEST_TIME, LATEST_TIME) if column.rule == "time" else (-1e308, 1e308)
        ok = f"(typeof({q}) IN ('integer', 'real') AND {q} BETWEEN {low!r} AND {top!r})"
    elif column.declared == "TEXT":
        ok = f"typeof({q}) = 'text'"
        if column.rule.startswith("enum:"):
            states = ", ".join(f"'{state}'" for state in column.rule[5:].split(","))
            ok = f"({ok} AND {q} IN ({states}))"
        elif column.rule in _RULE_SQL:  # CASE: the rule's functions read text only
            ok = f"CASE WHEN {ok} THEN {_RULE_SQL[column.rule](q)} ELSE 0 END"
    else:
        return ""
    return f"({q} IS NULL OR {ok})" if column.nullable else ok


def _wanted(column: _Column) -> str:
    if column.rule.startswith("enum:"):
        return "one of " + ", ".join(column.rule[5:].split(","))
    return _WANTED.get(column.rule) or {"INTEGER": "an integer", "REAL": "a finite number",
                                        "TEXT": "text"}.get(column.declared, "a value")


def _shown(kind: str, value: Any) -> str:
    """A stored value as a sentence shows it: short, never the raw bytes of a blob."""
    if kind == "text":
        text = value.decode("utf-8", "replace")
        return repr(text if len(text) <= 40 else text[:40] + "...")
    if kind in ("integer", "real"):
        return repr(value)
    return {"null": "NULL", "blob": "a blob"}.get(kind, kind)


# -- what only Python can judge ---------------------------------------------------------------

# A number token a float cannot hold (SQLite's JSON functions turn an integer of 309 digits or
# more into Inf): a cheap search first, the parse only when it finds one.
_LARGE_NUMBER = re.compile(rb"[eE][+-]?[0-9]{3}|[0-9]{%d}" % (jsonio.MAX_INTEGER_DIGITS + 1))


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]} is past a float's range")
    return value


def _bounded(text: str) -> int:
    if len(text.lstrip("-")) > jsonio.MAX_INTEGER_DIGITS:
        raise ValueError(f"the integer {text[:20]}... is past a float's range")
    return int(text)


def _json_problem(raw: bytes) -> str | None:
    if jsonio.too_deep(raw, STORED_DEPTH):
        return f"holds JSON nested deeper than {STORED_DEPTH} levels"
    if _LARGE_NUMBER.search(raw):
        try:
            json.loads(raw, parse_float=_finite, parse_int=_bounded)
        except ValueError as exc:
            return f"holds JSON a reader cannot take ({str(exc)[:80]})"
    return None


def _slot_problem(raw: bytes) -> str | None:
    text = raw.decode("utf-8")
    if text.startswith("manual-"):
        return None
    try:
        datetime.strptime(text, "%Y%m%d%H%M")
    except ValueError:
        return f"holds {text!r}, which is no minute of the calendar"
    return None


def _match_problem(raw: bytes) -> str | None:
    from fleet_min.collector.jobs.match import MatchError, compile_match

    try:
        compile_match(raw.decode("utf-8"))
    except MatchError as exc:
        return f"holds a match expression that does not compile ({str(exc)[:80]})"
    return None


_PYTHON_RULES: dict[str, Callable[[bytes], str | None]] = {
    "slot": _slot_problem, "run-slot": _slot_problem, "match": _match_problem}


def _text_problems(table: str, texts: list[_Column], key_word: str,
                   rows: Iterator[tuple[Any, ...]]) -> Iterator[BadRow]:
    """A BadRow for each row whose text is not UTF-8, or breaks a rule no SQL function can
    judge, in the order read. One decode a row for all its text columns together (a NUL between
    values, so that no two values' bytes can make one character); a row that fails is then
    looked at column by column to say which and why."""
    documents = [n for n, column in enumerate(texts) if column.rule.startswith("json:")]
    parsed = [(n, _PYTHON_RULES[column.rule]) for n, column in enumerate(texts)
              if column.rule in _PYTHON_RULES]
    for key, *values in rows:
        found = _text_problem(texts, documents, parsed, values)
        if found is not None:
            yield BadRow(table, found[0], f"{key_word} {key}", found[1], key)


def _text_problem(texts: list[_Column], documents: list[int],
                  parsed: list[tuple[int, Callable[[bytes], str | None]]], values: list[Any]
                  ) -> tuple[str, str] | None:
    """(the column, why) for a row's first broken text, or None."""
    try:
        b"\0".join([value for value in values if value is not None]).decode("utf-8")
    except UnicodeDecodeError:
        for column, raw in zip(texts, values, strict=True):
            try:
                raw is None or raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return column.name, f"holds bytes that are not UTF-8 text (at byte {exc.start})"
    for n in documents:
        why = values[n] is not None and _json_problem(values[n])
        if why:
            return texts[n].name, why
    for n, problem in parsed:
        why = values[n] is not None and problem(values[n])
        if why:
            return texts[n].name, why
    return None


# -- tables -----------------------------------------------------------------------------------


def _key(conn: sqlite3.Connection, table: str) -> tuple[str, str]:
    """The SQL that names a row of `table` and how to word it: its rowid (`SELECT * FROM t
    WHERE rowid = N` finds it), or for a table without one, its key's bytes in SQL's X'..'
    form (the key may itself be the broken value, so it is never read as text)."""
    sql = conn.execute("SELECT sql FROM main.sqlite_master WHERE name = ?", (table,)).fetchone()
    if not (sql and "WITHOUT ROWID" in " ".join(str(sql[0]).upper().split())):
        return "rowid", "rowid"
    info = conn.execute(f"PRAGMA main.table_info({quote_identifier(table)})")
    keys = [name for _, name, _, _, _, pk in sorted(info, key=lambda row: row[5]) if pk]
    return (" || ',' || ".join(f"substr(quote(CAST({quote_identifier(k)} AS BLOB)), 1, 64)"
                               for k in keys), "the row keyed")


def _rows(conn: sqlite3.Connection, sql: str) -> Iterator[tuple[Any, ...]]:
    cursor = conn.execute(sql)
    while batch := cursor.fetchmany(1000):
        yield from batch


def check_table(conn: sqlite3.Connection, table: str) -> None:
    """BadRow for the first row of main.`table` that the collector's readers cannot take."""
    for found in _passes(conn, table, every=False):
        for bad in found:
            raise bad


def leave_out(conn: sqlite3.Connection, table: str) -> LeftOut:
    """Delete every row of main.`table` (one of LEAVE_OUT_TABLES) that the collector's readers
    cannot take; how many, with the first few named."""
    if table not in LEAVE_OUT_TABLES or _key(conn, table)[1] != "rowid":
        raise ValueError(f"rows of {table!r} are never left out")
    left = LeftOut(table)
    name = quote_identifier(table)
    # The keys wait in a table of SQLite's, not in a list: a hostile backup may hold millions.
    conn.execute("CREATE TEMP TABLE left_out_keys (key INTEGER PRIMARY KEY)")
    try:
        for found in _passes(conn, table, every=True):
            for bad in found:  # read whole before any delete: a scan under deletes is undefined
                conn.execute("INSERT OR IGNORE INTO temp.left_out_keys VALUES (?)", (bad.key,))
                left.add(bad)
            conn.execute(f"DELETE FROM main.{name} WHERE rowid IN "
                         "(SELECT key FROM temp.left_out_keys)")
            conn.execute("DELETE FROM temp.left_out_keys")
    finally:
        conn.execute("DROP TABLE temp.left_out_keys")
    return left


def _passes(conn: sqlite3.Connection, table: str, *, every: bool
            ) -> Iterator[Iterator[BadRow]]:
    """The two passes over main.`table`, each naming the rows it finds bad: the text pass, then
    SQLite's own checks, which read text as text and so need the first pass's rows gone (a
    caller either stops at the first row named, or deletes them before asking for the next
    pass). `every`: all the rows the SQL pass finds, not only its first."""
    columns = _columns(conn, table)
    key_sql, key_word = _key(conn, table)
    name = quote_identifier(table)
    texts = [column for column in columns if column.declared == "TEXT"]
    if texts:
        listed = ", ".join(f"CAST({quote_identifier(column.name)} AS BLOB)" for column in texts)
        yield _text_problems(table, texts, key_word,
                             _rows(conn, f"SELECT {key_sql}, {listed} FROM main.{name}"))
    # coalesce: a check that meets a missing JSON member is NULL, and NOT NULL passes nothing.
    typed = [(column, f"coalesce({sql}, 0)") for column in columns if (sql := _typed(column))]
    if not typed:
        return
    which = " ".join(f"WHEN NOT {sql} THEN {n}" for n, (_, sql) in enumerate(typed))
    failing = (f"SELECT {key_sql}, CASE {which} END FROM main.{name} WHERE NOT "
               f"({' AND '.join(sql for _, sql in typed)})" + ("" if every else " LIMIT 1"))
    yield (_typed_problem(conn, table, typed[n][0], key_sql, key_word, key, count < EXAMPLES)
           for count, (key, n) in enumerate(_rows(conn, failing)))


def _typed_problem(conn: sqlite3.Connection, table: str, column: _Column, key_sql: str,
                   key_word: str, key: Any, shown: bool) -> BadRow:
    """The row's problem; the value it holds is read to be shown only when `shown` (the first
    few a caller names: the others of millions cost no read each)."""
    if not shown:
        return BadRow(table, column.name, f"{key_word} {key}",
                      f"does not hold {_wanted(column)}", key)
    q, name = quote_identifier(column.name), quote_identifier(table)
    kind, value = conn.execute(
        f"SELECT typeof({q}), CASE WHEN typeof({q}) = 'text' THEN CAST({q} AS BLOB) "
        f"WHEN typeof({q}) != 'blob' THEN {q} END FROM main.{name} WHERE {key_sql} = ?",
        (key,)).fetchone()
    return BadRow(table, column.name, f"{key_word} {key}",
                  f"holds {_shown(kind, value)} where {_wanted(column)} is kept", key)


def check_rows(conn: sqlite3.Connection, *, leave_out_records: bool = False) -> list[LeftOut]:
    """BadRow for the first row, in any table of main, the collector's readers cannot take.
    With `leave_out_records`, such rows of LEAVE_OUT_TABLES are deleted instead (see leave_out:
    its two passes delete every row they would refuse, so those tables are not read a third
    time): the tables that had some, with what was left out."""
    left_out = []
    for (table,) in conn.execute("SELECT name FROM main.sqlite_master WHERE type = 'table' AND "
                                 "name NOT LIKE 'sqlite^_%' ESCAPE '^' ORDER BY name"
                                 ).fetchall():
        if not (leave_out_records and table in LEAVE_OUT_TABLES):
            check_table(conn, table)
        elif (left := leave_out(conn, table)).count:
            left_out.append(left)
    return left_out

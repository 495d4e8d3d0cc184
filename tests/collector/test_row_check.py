"""The rules a restored backup's rows are held to (storage/row_check.py), on real SQLite files
made by the collector's own migrations. What a real collector writes passes them: the backup and
restore tests in tests/faults/test_backup.py restore real collectors' databases through them."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from fleet_min.collector.automation import alerts
from fleet_min.collector.jobs import kinds
from fleet_min.collector.storage import row_check
from fleet_min.collector.storage.schema import MIGRATIONS
from fleet_min.db import migrate

SPEC = {"schema": 1, "job_id": "j1", "workload": "benchmark", "executor": "device",
        "targets": {"pool": "lab"}, "depends_on": ["j0"], "params": {"iterations": 3}}


@pytest.fixture
def db(tmp_path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(tmp_path / "fleet.sqlite3", isolation_level=None)
    migrate(conn, MIGRATIONS)
    conn.execute(
        "INSERT INTO jobs (job_id, workload, executor, status, max_attempts, ttl_s, spec, "
        "match, warnings, created_at, updated_at) VALUES ('j1', 'benchmark', 'device', "
        "'waiting', 3, 600, ?, 'platform == \"android\"', '[\"a warning\"]', 1764000000.5, "
        "1764000001)", (json.dumps(SPEC),))
    conn.execute("INSERT INTO results (job_id, device_id, iter, attempt, metrics, artifacts, "
                 "extra, ok, final, created_at) VALUES ('j1', 'pixel', 0, 1, "
                 "'{\"fps\": 59.9, \"big\": 123456789012345678901234567890}', '[\"a\"]', NULL, "
                 "1, 1, 1764000002)")
    conn.execute("INSERT INTO schedule_runs (schedule_id, slot, at, outcome) VALUES "
                 "('nightly', '202611270300', 1764212400, 'enqueued'), "
                 "('nightly', 'manual-20261127101500', 1764238500, 'skipped')")
    conn.execute("INSERT INTO meta (key, value) VALUES ('scheduler_clock', "
                 "'{\"at\": 1764238500.25, \"tz\": \"Europe/Berlin\"}')")
    conn.execute("INSERT INTO topic_events (topic, payload, at) VALUES ('lab.door', '42', 1)")
    return conn


def refused(conn: sqlite3.Connection, sql: str, params: tuple[object, ...] = ()
            ) -> row_check.BadRow:
    conn.execute(sql, params)
    with pytest.raises(row_check.BadRow) as caught:
        row_check.check_rows(conn)
    return caught.value


def test_rows_as_the_collector_writes_them_pass(db: sqlite3.Connection) -> None:
    row_check.check_rows(db)
    db.execute("UPDATE jobs SET spec = json_set(spec, '$.targets', json('{}'), '$.lease', 0, "
               "'$.depends_on', NULL), match = NULL, warnings = NULL")
    row_check.check_rows(db)  # empty or false members are read as absent


@pytest.mark.parametrize("change, column, words", [
    ("UPDATE jobs SET spec = 'not json'", "spec", "'not json' where a job spec"),
    ("UPDATE jobs SET spec = '[1]'", "spec", "where a job spec"),
    ("UPDATE jobs SET spec = json_remove(spec, '$.workload')", "spec", "where a job spec"),
    ("UPDATE jobs SET spec = json_set(spec, '$.executor', 'cloud')", "spec", "a job spec"),
    ("UPDATE jobs SET spec = json_set(spec, '$.targets', json('[1]'))", "spec", "a job spec"),
    ("UPDATE jobs SET spec = json_set(spec, '$.depends_on', json('[1]'))", "spec", "a job spec"),
    ("UPDATE jobs SET spec = '{\"workload\": \"w\", \"executor\": \"host\", \"x\": 1e999}'",
     "spec", "past a float's range"),
    ("UPDATE jobs SET spec = '{\"a\": NaN}'", "spec", "where a job spec"),
    ("UPDATE jobs SET spec = '{\"workload\": \"w\", \"executor\": \"host\", \"x\": "
     + "[" * 1200 + "]" * 1200 + "}'", "spec", "nested deeper than 1000 levels"),
    ("UPDATE jobs SET spec = CAST(X'7B2261223A22FF227D' AS TEXT)", "spec",
     "not UTF-8 text (at byte 6)"),
    ("UPDATE jobs SET created_at = 'yesterday'", "created_at", "'yesterday' where a time"),
    ("UPDATE jobs SET created_at = 9e999", "created_at", "inf where a time"),
    ("UPDATE jobs SET finished_at = 1e15", "finished_at", "where a time"),
    ("UPDATE jobs SET status = 'weird'", "status", "one of queued, waiting, claimed"),
    ("UPDATE jobs SET executor = 'cloud'", "executor", "one of device, host"),
    ("UPDATE jobs SET match = '(((('", "match", "does not compile"),
    ("UPDATE jobs SET priority = 1.5", "priority", "1.5 where an integer is kept"),
    ("UPDATE jobs SET exclusive = 2", "exclusive", "2 where 0 or 1 is kept"),
    ("UPDATE jobs SET job_id = X'00'", "job_id", "a blob where text is kept"),
    ("UPDATE jobs SET warnings = '[1]'", "warnings", "a JSON array of strings"),
    ("UPDATE results SET metrics = '[]'", "metrics", "where a JSON object is kept"),
    ("UPDATE results SET metrics = '{\"n\": 1" + "0" * 400 + "}'", "metrics",
     "the integer 10000000000000000000... is past a float's range"),
    ("UPDATE results SET extra = '5'", "extra", "where a JSON object is kept"),
    ("UPDATE results SET artifacts = '[{\"sha256\": 1}]'", "artifacts", "array of strings"),
    ("UPDATE schedule_runs SET slot = '202613010000' WHERE outcome = 'enqueued'", "slot",
     "no minute of the calendar"),
    ("UPDATE schedule_runs SET slot = 'tomorrow' WHERE outcome = 'enqueued'", "slot",
     "'tomorrow', which is no minute of the calendar"),
    ("UPDATE schedule_runs SET slot = 5 WHERE outcome = 'enqueued'", "slot",
     "'5', which is no minute of the calendar"),
    ("UPDATE results SET metrics = 5", "metrics", "'5' where a JSON object is kept"),
    ("UPDATE results SET metrics = X'7B7D'", "metrics", "a blob where a JSON object is kept"),
    ("UPDATE meta SET value = '{\"at\": 5}'", "value", "the scheduler's clock mark"),
    ("INSERT INTO artifacts (sha256, size, created_at) VALUES ('../../etc/passwd', 1, 1)",
     "sha256", "a SHA-256 in 64 lowercase hex digits"),
])
def test_a_row_the_collector_could_not_have_written_is_named(
        db: sqlite3.Connection, change: str, column: str, words: str) -> None:
    bad = refused(db, change)
    assert bad.column == column and words in str(bad), str(bad)
    assert bad.where.startswith("rowid "), bad.where


def test_a_table_without_rowids_names_the_row_by_its_key_bytes(db: sqlite3.Connection) -> None:
    bad = refused(db, "INSERT INTO job_deps VALUES (CAST(X'FF' AS TEXT), 'j0')")
    assert bad.table == "job_deps" and bad.where == "the row keyed X'FF',X'6A30'", bad.where


def test_a_sentence_never_carries_the_raw_bytes(db: sqlite3.Connection) -> None:
    bad = refused(db, "UPDATE jobs SET status = ?", ("\x1b[2J" + "x" * 100,))
    assert "\x1b" not in str(bad) and "..." in str(bad), str(bad)


def test_each_table_is_read_twice_whatever_its_columns(db: sqlite3.Connection) -> None:
    """Each table is read twice whatever its number of columns, so a million rows cost two
    passes: the SQL checks in one query and the text once more (counted with SQLite's
    statement trace)."""
    statements: list[str] = []
    db.set_trace_callback(statements.append)
    row_check.check_table(db, "results")
    scans = [s for s in statements if "FROM main.\"results\"" in s]
    assert len(scans) == 2, scans


def test_the_state_lists_are_the_codes_own() -> None:
    assert row_check.JOB_STATUSES == kinds.JOB_STATUSES
    assert set(row_check.EXECUTORS) == {e.value for e in kinds.Executor}
    assert set(row_check.ATTEMPT_OUTCOMES) == {o.value for o in kinds.AttemptOutcome}
    assert set(row_check.ALERT_RULES) == set(alerts.RULES)
    assert set(row_check.ALERT_STATES) == {s.value for s in alerts.AlertState}


def _add_results(conn: sqlite3.Connection, rows: list[tuple[str, object]]) -> None:
    """Result rows of job j1 whose metrics and created_at are as given (iter numbers them)."""
    for n, (metrics, created_at) in enumerate(rows, start=1):
        conn.execute("INSERT INTO results (job_id, device_id, iter, attempt, metrics, "
                     "created_at) VALUES ('j1', 'pixel', ?, 1, CAST(? AS TEXT), ?)",
                     (n, metrics, created_at))


def test_leaving_out_deletes_every_bad_record_of_both_passes_and_keeps_the_rest(
        db: sqlite3.Connection) -> None:
    """Bad rows found by the text pass (bytes that are not UTF-8, a number past a float's
    range) and by SQLite's own checks (text where a time is kept) are all left out, each
    named up to EXAMPLES and the rest counted; every good row stays, and the table then
    passes the check it failed."""
    good = [('{"fps": 60}', 1764000003)] * 3
    bad = ([(b'{"t": "\xff"}', 1764000004)] * 15 + [('{"n": 1' + "0" * 400 + "}", 1764000005)] * 5
           + [('{"fps": 1}', "yesterday")] * 10)
    _add_results(db, good + bad + good)
    with pytest.raises(row_check.BadRow):
        row_check.check_table(db, "results")
    db.execute("BEGIN")
    left = row_check.leave_out(db, "results")
    db.execute("COMMIT")
    assert left.table == "results" and left.count == 30
    assert len(left.examples) == row_check.EXAMPLES
    reasons = {bad.column for bad in left.examples}
    assert reasons == {"metrics"}, reasons  # the first twenty are the text pass's
    assert "not UTF-8" in str(left.examples[0]) and "past a float's range" in str(
        left.examples[-1]), [str(b) for b in left.examples]
    kept = db.execute("SELECT iter FROM results WHERE job_id = 'j1' ORDER BY iter").fetchall()
    assert [row[0] for row in kept] == [0, 1, 2, 3, 34, 35, 36]
    row_check.check_rows(db)


def test_check_rows_leaves_out_records_only_when_asked(db: sqlite3.Connection) -> None:
    _add_results(db, [('{"fps": 1}', "yesterday")])
    db.execute("INSERT INTO beacons (device_id, body, at) VALUES ('pixel', 'not json', 1)")
    with pytest.raises(row_check.BadRow):
        row_check.check_rows(db)
    left = row_check.check_rows(db, leave_out_records=True)
    assert {entry.table: entry.count for entry in left} == {"beacons": 1, "results": 1}
    assert "holds 'yesterday' where" in str(left[1].examples[0]), str(left[1].examples[0])


def test_rows_other_rows_name_are_never_left_out(db: sqlite3.Connection) -> None:
    """A job, a device, a schedule: other rows refer to them, so a bad one still refuses the
    whole check, even when records are being left out, and nothing of it is deleted."""
    db.execute("UPDATE jobs SET created_at = 'soon'")
    with pytest.raises(row_check.BadRow) as caught:
        row_check.check_rows(db, leave_out_records=True)
    assert caught.value.table == "jobs", caught.value
    assert db.execute("SELECT count(*) FROM jobs").fetchone()[0] == 1
    with pytest.raises(ValueError, match="never left out"):
        row_check.leave_out(db, "jobs")
    assert {"results", "beacons"} <= row_check.LEAVE_OUT_TABLES
    assert not {"jobs", "devices", "schedules", "job_deps", "job_attempts", "artifacts",
                "meta"} & row_check.LEAVE_OUT_TABLES

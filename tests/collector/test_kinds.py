"""The closed sets of names (fleet_min.collector.jobs.kinds) are the only names in use: the final
statuses are a part of the statuses, and every status, executor kind, attempt outcome or alert
state the collector's SQL names literally (partial indexes need the literal) is a member."""

from __future__ import annotations

import re
from pathlib import Path

from fleet_min.collector.automation.alerts import AlertState
from fleet_min.collector.jobs.kinds import (
    FINAL,
    JOB_STATUSES,
    OPEN,
    UNSUCCESSFUL,
    AttemptOutcome,
    Executor,
    JobStatus,
)

SRC = Path(__file__).resolve().parents[2] / "fleet_min" / "collector"
# `status = 'queued'`, `j.status != 'done'`, `status IN ('queued', 'waiting')`, and the same
# for executor, state and outcome (an alias before the column is allowed).
# The SQL may go on in the next string literal: `status IN "` then `"('queued', ...)`.
LITERAL = re.compile(r"\b(?:\w+\.)?(status|executor|state|outcome)\s*(?:=|!=|<>|IN)\s*"
                     r"(?:\"\s*\")?(\('[^)]*'\)|'[^']*')", re.IGNORECASE)
ALLOWED = {"status": set(JobStatus), "executor": set(Executor), "state": set(AlertState),
           "outcome": set(AttemptOutcome)}


def sql_literals() -> list[tuple[str, str, str]]:
    """(file, column, name) of each name written literally after a column in the source."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for match in LITERAL.finditer(path.read_text(encoding="utf-8")):
            column = match.group(1).lower()
            for name in re.findall(r"'([^']*)'", match.group(2)):
                found.append((str(path.relative_to(SRC)), column, name))
    return found


def test_the_final_and_open_statuses_divide_the_statuses():
    assert set(JobStatus) == FINAL | OPEN
    assert not FINAL & OPEN
    assert UNSUCCESSFUL < FINAL
    assert tuple(JobStatus) == JOB_STATUSES
    assert all(type(name) is str for name in JOB_STATUSES)  # plain text for JSON keys


def test_every_name_the_sql_spells_out_is_a_member_of_its_set():
    found = sql_literals()
    assert len({(column, name) for _, column, name in found}) >= 8  # the scan reads the SQL
    strays = [entry for entry in found if entry[2] not in ALLOWED[entry[1]]]
    assert strays == []


def test_the_scan_would_catch_a_misspelt_status():
    text = "SELECT 1 FROM jobs WHERE j.status IN ('queued', 'canceled') AND executor = 'hots'"
    names = [(m.group(1), n) for m in LITERAL.finditer(text)
             for n in re.findall(r"'([^']*)'", m.group(2))]
    assert names == [("status", "queued"), ("status", "canceled"), ("executor", "hots")]
    assert [n for c, n in names if n not in ALLOWED[c]] == ["canceled", "hots"]

"""Visual review: screenshots as a matrix of suite x page x profile, judged against baselines.

Where screenshots come from: the result rows (iteration 1 and on) of the screenshot workloads,
`web-shots`, `locale-shots` and `a11y-audit`, each row carrying its PNG as its first artifact.
A row's slot (suite, page, profile) is read from the row itself (docs/collector-artifacts.md,
"Visual review", has the table):

- a `shot` object on the row (`{"suite", "page", "profile", "sha256"}`, what the original's
  executors stamp) names all of it;
- otherwise the suite is the job's: `params.suite`, else `suite.flows`, else `app.name`, else
  `params.app_id`, else the host of `targets.url`, else the schedule that made the job, else the
  workload; and the page and profile come from the workload's own row fields: web-shots
  `params.page` or the URL's path x `browser` (`@serial` for a phone), locale-shots `locale` x
  the device, a11y-audit `step` x `variant@device`.

A baseline is a pointer from a slot to an artifact; accepting a capture moves the pointer and
marks the artifact `baseline` (garbage collection spares it while any slot points at it). The
comparison of a capture with its baseline is computed on first view and kept in visual_diffs.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, urlsplit

from fleet_min import numbers
from fleet_min.collector.artifacts import pixels
from fleet_min.collector.artifacts.store import ArtifactStore, check_sha256, is_sha256
from fleet_min.collector.jobs.effects import Effects
from fleet_min.db import Database
from fleet_min.errors import BadRequest, NotFound
from fleet_min.timeutil import iso

WORKLOADS = ("web-shots", "locale-shots", "a11y-audit")
MAX_NAME_CHARS = 200
RECENT_JOBS = 200  # the newest screenshot jobs a matrix or the suite list reads
ROWS_PER_JOB = 5_000  # result rows read of one job
ROWS_PER_REQUEST = 50_000  # of all the jobs one matrix or suite list reads; `truncated` past it
DEFAULT_RUNS, MAX_RUNS = 10, 25
DEFAULT_THRESHOLD_PCT = 0.1  # the share of pixels that may differ and still match
COMPUTE_BUDGET_S = 15.0  # comparisons one matrix request may run; the rest show "pending"


@dataclass(frozen=True)
class Cell:
    """One screenshot of a run: its slot, its row's verdict and its capture."""

    page: str
    profile: str
    sha256: str | None
    ok: bool | None
    note: str | None
    reported_pct: float | None  # diff_pct the row itself reports (an executor that compared)
    diff_sha256: str | None = None


@dataclass
class Run:
    job_id: str
    status: str
    created_at: str | None
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)


# -- names --------------------------------------------------------------------------------------


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise BadRequest(f"{what} is required: a name of 1 to {MAX_NAME_CHARS} characters")
    if len(value) > MAX_NAME_CHARS or any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise BadRequest(f"{what} must be 1 to {MAX_NAME_CHARS} characters without control "
                         "characters")
    return value.strip()


def check_accept(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body of POST /api/visual/baselines/accept, checked."""
    unknown = sorted(set(body) - {"suite", "page", "profile", "sha256", "job_id"})
    if unknown:
        raise BadRequest(f"{unknown[0]} is not a field of an accept; send suite, page, profile, "
                         "sha256 and optionally job_id")
    sha = body.get("sha256")
    if not isinstance(sha, str):
        raise BadRequest("sha256 is required: the capture's SHA-256, 64 lowercase hex digits")
    job_id = body.get("job_id")
    if job_id is not None:
        job_id = _name(job_id, "job_id")
    return {"suite": _name(body.get("suite"), "suite"), "page": _name(body.get("page"), "page"),
            "profile": _name(body.get("profile"), "profile"), "sha256": check_sha256(sha),
            "job_id": job_id}


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: Any) -> str | None:
    return value.strip()[:MAX_NAME_CHARS] if isinstance(value, str) and value.strip() else None


def _split_url(url: Any) -> SplitResult:
    """targets.url in parts; empty parts for one that is not text or not a URL (`http://[x/`
    is any string to the spec's check, and urlsplit raises on it)."""
    try:
        return urlsplit(url if isinstance(url, str) else "")
    except ValueError:
        return urlsplit("")


def job_suite(workload: str, spec: Mapping[str, Any], template_id: str | None) -> str:
    """The suite a screenshot job's rows belong to unless a row says otherwise."""
    params = _dict(spec.get("params"))
    suite = _dict(spec.get("suite"))
    app = _dict(spec.get("app"))
    targets = _dict(spec.get("targets"))
    url_host = _split_url(targets.get("url")).hostname
    for candidate in (params.get("suite"), suite.get("flows"), app.get("name"),
                      params.get("app_id"), url_host, template_id):
        if _text(candidate):
            return str(_text(candidate))
    return workload


def _page_of_url(spec: Mapping[str, Any]) -> str:
    params = _dict(spec.get("params"))
    if _text(params.get("page")):
        return str(_text(params.get("page")))
    targets = _dict(spec.get("targets"))
    parts = _split_url(targets.get("url"))
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def row_slot(workload: str, spec: Mapping[str, Any], suite: str, row: Mapping[str, Any]
             ) -> tuple[str, str, str] | None:
    """(suite, page, profile) of one screenshot row, or None when the row is not one."""
    shot = row.get("shot")
    if isinstance(shot, dict) and all(_text(shot.get(k)) for k in ("suite", "page", "profile")):
        return str(_text(shot["suite"])), str(_text(shot["page"])), str(_text(shot["profile"]))
    device = _text(row.get("device_id")) or "?"
    if workload == "web-shots" and _text(row.get("browser")):
        serial = _text(row.get("serial"))
        profile = str(_text(row.get("browser"))) + (f"@{serial}" if serial else "")
        return suite, _page_of_url(spec), profile
    if workload == "locale-shots" and _text(row.get("locale")):
        return suite, str(_text(row.get("locale"))), device
    if workload == "a11y-audit" and _text(row.get("step")):
        variant = _text(row.get("variant")) or "default"
        return suite, str(_text(row.get("step"))), f"{variant}@{device}"
    return None


def _cell(page: str, profile: str, row: Mapping[str, Any]) -> Cell:
    # A row's fields are its executor's word: a screenshot named by anything but a hash is no
    # screenshot (it would make every read of the store refuse the whole matrix).
    shot = _dict(row.get("shot"))
    artifacts = row.get("artifacts")
    artifacts = artifacts if isinstance(artifacts, list) else []
    named = shot.get("sha256")
    sha = named if is_sha256(named) else next((a for a in artifacts if is_sha256(a)), None)
    note = row.get("error")
    if sha is None and named is not None and not note:
        note = "the row's shot.sha256 is not a SHA-256 (64 lowercase hex digits)"
    metrics = _dict(row.get("metrics"))
    reported = metrics.get("diff_pct")
    diff = shot.get("diff_sha256")
    return Cell(page, profile, sha, row.get("ok"), note, numbers.finite(reported),
                diff if is_sha256(diff) else None)


# -- reading the runs ---------------------------------------------------------------------------

# A row and a spec may each be near a megabyte (the body limit), and the views need a dozen short
# fields of them: SQLite picks those out, so a whole row never reaches Python (1,000 rows of
# 900 KB, each parsed three times on the loop, took a suite list 5.7 s and 936 MB). A text field
# comes back cut to FIELD_CHARS (a name is cut to MAX_NAME_CHARS once stripped anyway), anything
# but text as NULL, as _text would read it.
FIELD_CHARS = 1024
URL_CHARS = 4096  # a page named by a longer URL could never be accepted (names are <= 200)
SHA_CHARS = 65  # one past a hash: a longer text is still seen to be no hash


def _text_at(column: str, path: str, chars: int = FIELD_CHARS) -> str:
    return (f"CASE json_type({column}, '{path}') WHEN 'text' "
            f"THEN substr(json_extract({column}, '{path}'), 1, {chars}) END")


def _number_at(column: str, path: str) -> str:
    return (f"CASE WHEN json_type({column}, '{path}') IN ('integer', 'real') "
            f"THEN json_extract({column}, '{path}') END")


_SPEC_FIELDS = {"params_suite": "$.params.suite", "suite_flows": "$.suite.flows",
                "app_name": "$.app.name", "params_app_id": "$.params.app_id",
                "params_page": "$.params.page"}
_RECENT_JOBS = (
    "SELECT job_id, workload, status, created_at, template_id, "
    + "".join(f"{_text_at('spec', path)} AS {name}, " for name, path in _SPEC_FIELDS.items())
    + f"{_text_at('spec', '$.targets.url', URL_CHARS)} AS targets_url "
    f"FROM jobs WHERE workload IN ({','.join('?' * len(WORKLOADS))}) AND is_group = 0 "
    f"ORDER BY seq DESC LIMIT {RECENT_JOBS}")

# The row's own fields a slot or a cell reads (they are the extra fields an executor adds: the
# columns hold only the fields every row has). A `shot` that holds anything but a hash or null
# as its sha256 comes back as the JSON type's name: not a hash, so the cell says so.
_ROW_TEXTS = ("browser", "serial", "locale", "step", "variant")
_SHOT_NAMES = ("suite", "page", "profile")
_SLOTTED_ROWS = (
    "SELECT id, device_id, ok, error, "
    "CASE json_type(artifacts) WHEN 'array' THEN (SELECT value FROM json_each(artifacts) "
    "WHERE type = 'text' AND length(value) = 64 AND value NOT GLOB '*[^0-9a-f]*' LIMIT 1) "
    "END AS capture, "
    "json_type(extra, '$.shot') = 'object' AS has_shot, "
    + "".join(f"{_text_at('extra', f'$.shot.{name}')} AS shot_{name}, " for name in _SHOT_NAMES)
    + "CASE json_type(extra, '$.shot.sha256') WHEN 'text' "
    f"THEN substr(json_extract(extra, '$.shot.sha256'), 1, {SHA_CHARS}) WHEN 'null' THEN NULL "
    "ELSE json_type(extra, '$.shot.sha256') END AS shot_sha256, "
    f"{_text_at('extra', '$.shot.diff_sha256', SHA_CHARS)} AS shot_diff_sha256, "
    + ", ".join(f"{_text_at('extra', f'$.{name}')} AS {name}" for name in _ROW_TEXTS)
    + " FROM results WHERE job_id = ? AND iter > 0 ORDER BY attempt, iter, id LIMIT ?")


# The difference an executor reports (metrics.diff_pct) is read only for the rows that became
# the cells of the suite asked for: metrics is where an executor puts its bulk, and reading
# 1,000 rows' 900 KB of it to find no key took SQLite a second. instr first: metrics without
# the key is not parsed.
_REPORTED_DIFFERENCES = (
    "SELECT id, CASE WHEN instr(metrics, '\"diff_pct\"') THEN "
    f"{_number_at('metrics', '$.diff_pct')} END AS diff_pct FROM results "
    "WHERE id IN (SELECT value FROM json_each(?))")


async def _recent_jobs(db: Database) -> list[sqlite3.Row]:
    return await db.read(_RECENT_JOBS, WORKLOADS)


def spec_fields(job: Any) -> dict[str, Any]:
    """The parts of a job's spec job_suite and row_slot read, from the fields SQLite picked."""
    return {"params": {"suite": job["params_suite"], "app_id": job["params_app_id"],
                       "page": job["params_page"]},
            "suite": {"flows": job["suite_flows"]}, "app": {"name": job["app_name"]},
            "targets": {"url": job["targets_url"]}}


def row_fields(row: Any) -> dict[str, Any]:
    """The parts of a result row row_slot and _cell read, shaped as the row was posted, with
    its id (its metrics are read for the cells shown: _reported_differences)."""
    fields: dict[str, Any] = {name: row[name]
                              for name in ("id", "device_id", "error", *_ROW_TEXTS)}
    fields["ok"] = None if row["ok"] is None else bool(row["ok"])
    fields["artifacts"] = [row["capture"]] if row["capture"] is not None else []
    if row["has_shot"]:
        fields["shot"] = {name: row[f"shot_{name}"]
                          for name in (*_SHOT_NAMES, "sha256", "diff_sha256")}
    return fields


@dataclass
class _Reading:
    """Rows one request may still read (200 jobs of 5,000 rows, each read whole and parsed on
    the loop, took a suite list some 25 s; the fields picked out are small, but a bound keeps
    the read's length known) and whether a job's rows were left unread."""

    left: int = field(default_factory=lambda: ROWS_PER_REQUEST)
    truncated: bool = False


async def _slotted_rows(db: Database, job: sqlite3.Row, reading: _Reading
                        ) -> list[tuple[tuple[str, str, str], dict[str, Any]]]:
    """A job's screenshot rows with their slots, the newest attempt's row winning a slot."""
    spec = spec_fields(job)
    suite = job_suite(job["workload"], spec, job["template_id"])
    take = min(ROWS_PER_JOB, reading.left)
    rows = await db.read(_SLOTTED_ROWS, (job["job_id"], take + 1))
    if len(rows) > take:
        reading.truncated, rows = True, rows[:take]
    reading.left -= len(rows)
    slotted: dict[tuple[str, str, str], dict[str, Any]] = {}
    for row in rows:
        fields = row_fields(row)
        slot = row_slot(job["workload"], spec, suite, fields)
        if slot is not None:
            slotted.pop(slot, None)  # re-inserted: order follows the newest attempt's row
            slotted[slot] = fields
    return list(slotted.items())


async def suites(db: Database) -> dict[str, Any]:
    """Every suite with a baseline or a recent capture (a new suite has runs but no
    baselines; a retired one baselines but no runs)."""
    names = {r[0] for r in await db.read("SELECT DISTINCT suite FROM visual_baselines")}
    reading = _Reading()
    for job in await _recent_jobs(db):
        names |= {slot[0] for slot, _row in await _slotted_rows(db, job, reading)}
    return {"suites": sorted(names), "truncated": reading.truncated}


async def baselines(db: Database, suite: str | None) -> dict[str, Any]:
    where, params = ("WHERE suite = ?", (suite,)) if suite else ("", ())
    rows = await db.read(f"SELECT * FROM visual_baselines {where} "
                         "ORDER BY suite, page, profile LIMIT 1000", params)
    return {"baselines": [baseline_record(r) for r in rows]}


def baseline_record(row: Any) -> dict[str, Any]:
    return {"suite": row["suite"], "page": row["page"], "profile": row["profile"],
            "sha256": row["sha256"], "accepted_at": iso(row["accepted_at"]),
            "accepted_from_job": row["accepted_from_job"]}


async def _reported_differences(db: Database, ids: list[int]) -> dict[int, Any]:
    if not ids:
        return {}
    rows = await db.read(_REPORTED_DIFFERENCES, (json.dumps(ids),))
    return {row["id"]: row["diff_pct"] for row in rows}


async def _runs(db: Database, suite: str, wanted: int) -> tuple[list[Run], bool]:
    runs: list[Run] = []
    reading = _Reading()
    for job in await _recent_jobs(db):
        if len(runs) >= wanted:
            break
        run = Run(job["job_id"], job["status"], iso(job["created_at"]))
        cells = [(page, profile, row) for (row_suite, page, profile), row
                 in await _slotted_rows(db, job, reading) if row_suite == suite]
        reported = await _reported_differences(db, [row["id"] for _, _, row in cells])
        for page, profile, row in cells:
            row["metrics"] = {"diff_pct": reported.get(row["id"])}
            run.cells[(page, profile)] = _cell(page, profile, row)
        if run.cells:
            runs.append(run)
    return runs, reading.truncated


# -- baselines ----------------------------------------------------------------------------------


def accept(conn: sqlite3.Connection, slot: dict[str, Any], now: float, effects: Effects
           ) -> dict[str, Any]:
    """Point a slot at a stored artifact (re-accepting replaces the pointer). The artifact is
    marked a baseline; the one it replaces stops being one unless another slot points at it."""
    sha = slot["sha256"]
    if conn.execute("SELECT 1 FROM artifacts WHERE sha256 = ?", (sha,)).fetchone() is None:
        raise NotFound(f"no artifact {sha} is stored here; upload the capture before accepting "
                       "it")
    key = (slot["suite"], slot["page"], slot["profile"])
    old = conn.execute("SELECT sha256 FROM visual_baselines WHERE suite = ? AND page = ? "
                       "AND profile = ?", key).fetchone()
    conn.execute("INSERT INTO visual_baselines (suite, page, profile, sha256, accepted_at, "
                 "accepted_from_job) VALUES (?, ?, ?, ?, ?, ?) "
                 "ON CONFLICT (suite, page, profile) DO UPDATE SET sha256 = excluded.sha256, "
                 "accepted_at = excluded.accepted_at, "
                 "accepted_from_job = excluded.accepted_from_job",
                 (*key, sha, now, slot["job_id"]))
    conn.execute("UPDATE artifacts SET baseline = 1 WHERE sha256 = ?", (sha,))
    if old is not None and old[0] != sha:
        conn.execute("UPDATE artifacts SET baseline = 0 WHERE sha256 = ? AND NOT EXISTS "
                     "(SELECT 1 FROM visual_baselines WHERE sha256 = ?)", (old[0], old[0]))
    effects.emit("artifact", action="baseline", sha256=sha, accepted=True, suite=key[0],
                 page=key[1], profile=key[2])
    row = conn.execute("SELECT * FROM visual_baselines WHERE suite = ? AND page = ? "
                       "AND profile = ?", key).fetchone()
    return {"ok": True, **baseline_record(row), "replaced": old[0] if old else None}


def slots_pointing_at(conn: sqlite3.Connection, sha256: str) -> list[str]:
    rows = conn.execute("SELECT suite, page, profile FROM visual_baselines WHERE sha256 = ? "
                        "ORDER BY suite, page, profile LIMIT 5", (sha256,)).fetchall()
    return [f"{r[0]}/{r[1]} ({r[2]})" for r in rows]


# -- comparing ----------------------------------------------------------------------------------


NOT_STORED = "the baseline or the capture is not stored (yet, or any more)"


class Review:
    """The matrix and the comparisons behind it: one comparison at a time (a Pi has few
    cores), each on a worker thread, each result kept."""

    def __init__(self, store: ArtifactStore) -> None:
        self.store = store
        self._one_at_a_time = asyncio.Lock()

    async def _cached(self, baseline: str, capture: str) -> sqlite3.Row | None:
        return await self.store.db.read_one("SELECT * FROM visual_diffs WHERE baseline = ? "
                                            "AND capture = ?", (baseline, capture))

    def _compare(self, baseline: str, capture: str) -> tuple[float | None, int | None,
                                                             int | None, str | None]:
        try:
            with open(self.store.path(baseline), "rb") as base, \
                    open(self.store.path(capture), "rb") as cap:
                found = pixels.compare(base, cap)
        except FileNotFoundError:
            return None, None, None, NOT_STORED
        except pixels.NotComparable as exc:
            return None, None, None, str(exc)
        except OSError as exc:  # the file unreadable: a cell's error, not the matrix's 500
            return None, None, None, f"the baseline or the capture could not be read ({exc})"
        return found.pct, found.width, found.height, None

    async def difference(self, baseline: str, capture: str, now: float, deadline: float
                         ) -> tuple[float | None, str | None] | None:
        """(diff_pct, error) of a capture against a baseline, computed once and kept; None
        when the comparisons before it held the one slot past `deadline` (the cell is then
        pending, and the request answers rather than waits behind another suite's files)."""
        try:
            await asyncio.wait_for(self._one_at_a_time.acquire(),
                                   max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return None
        try:
            row = await self._cached(baseline, capture)
            if row is None:
                found = await asyncio.to_thread(self._compare, baseline, capture)
                if found[3] != NOT_STORED:  # a row may name its upload before it lands
                    await self.store.transact(_keep, baseline, capture, found, now)
                return found[0], found[3]
        finally:
            self._one_at_a_time.release()
        return row["diff_pct"], row["error"]

    async def matrix(self, suite: str, runs: int, threshold: float, now: float
                     ) -> dict[str, Any]:
        found, truncated = await _runs(self.store.db, suite, runs)
        if not found:
            return {"suite": suite, "threshold_pct": threshold, "latest": None, "runs": [],
                    "pages": [], "profiles": [], "cells": [], "truncated": truncated}
        pointers = {(r["page"], r["profile"]): r["sha256"] for r in await self.store.db.read(
            "SELECT page, profile, sha256 FROM visual_baselines WHERE suite = ?", (suite,))}
        latest = found[0]
        deadline = time.monotonic() + COMPUTE_BUDGET_S
        cells = []
        for key, cell in latest.cells.items():
            judged = await self._judge(cell, pointers.get(key), threshold, deadline, now)
            history = [_past(run, key) for run in found[1:]]
            cells.append({**judged, "history": history})
        return {
            "suite": suite, "threshold_pct": threshold,
            "latest": {"job_id": latest.job_id, "status": latest.status,
                       "created_at": latest.created_at},
            "runs": [{"job_id": r.job_id, "status": r.status, "created_at": r.created_at}
                     for r in found],
            "pages": list(dict.fromkeys(page for page, _profile in latest.cells)),
            "profiles": list(dict.fromkeys(profile for _page, profile in latest.cells)),
            "cells": cells, "truncated": truncated,
        }

    async def _judge(self, cell: Cell, baseline: str | None, threshold: float, deadline: float,
                     now: float) -> dict[str, Any]:
        pct, error, status = cell.reported_pct, None, None
        if cell.sha256 is None:
            status = "missing"
        elif baseline is None:
            status = "new"
        elif baseline == cell.sha256:
            pct = 0.0
        elif pct is None:
            cached = await self._cached(baseline, cell.sha256)
            if cached is not None:
                pct, error = cached["diff_pct"], cached["error"]
            elif time.monotonic() < deadline and (found := await self.difference(
                    baseline, cell.sha256, now, deadline)) is not None:
                pct, error = found
            else:
                status = "pending"
        if status is None:
            status = "error" if error else ("diverged" if (pct or 0.0) > threshold else "pass")
        return {"page": cell.page, "profile": cell.profile, "status": status, "ok": cell.ok,
                "diff_pct": pct, "note": error or cell.note, "sha256": cell.sha256,
                "diff_sha256": cell.diff_sha256, "baseline_sha256": baseline}


def _past(run: Run, key: tuple[str, str]) -> dict[str, Any]:
    cell = run.cells.get(key)
    return {"job_id": run.job_id, "created_at": run.created_at,
            "sha256": cell.sha256 if cell else None, "ok": cell.ok if cell else None,
            "diff_pct": cell.reported_pct if cell else None}


def _keep(conn: sqlite3.Connection, baseline: str, capture: str,
          found: tuple[float | None, int | None, int | None, str | None], now: float,
          effects: Effects) -> None:
    pct, width, height, error = found
    conn.execute("INSERT OR REPLACE INTO visual_diffs (baseline, capture, diff_pct, width, "
                 "height, error, computed_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                 (baseline, capture, pct, width, height, error, now))


def matrix_query(query: Mapping[str, str]) -> tuple[str, int, float]:
    """suite (required), runs (1 to 25, default 10), threshold (percent, default 0.1)."""
    suite = _name(query.get("suite"), "suite")
    raw_runs = query.get("runs") or str(DEFAULT_RUNS)
    if not (raw_runs.isascii() and raw_runs.isdigit() and len(raw_runs) <= 3
            and 1 <= int(raw_runs) <= MAX_RUNS):
        raise BadRequest(f"runs must be a whole number from 1 to {MAX_RUNS}")
    raw = (query.get("threshold") or str(DEFAULT_THRESHOLD_PCT))[:20]
    try:
        threshold = float(raw)
    except ValueError:
        threshold = -1.0
    if not 0.0 <= threshold <= 100.0:
        raise BadRequest("threshold must be a percentage from 0 to 100")
    return suite, int(raw_runs), threshold

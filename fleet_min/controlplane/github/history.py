"""Job history: every finished workflow job of the watched repositories, kept in SQLite.

A round lists the completed runs created since a point in time and fetches the jobs (every
attempt, with steps) of each run not fetched before. The first round of a repository looks back
`backfill_days` (30); later rounds look back from the last time the repository was caught up,
less an overlap that covers runs completing long after they were created (GitHub cancels a job
queued for 24 h). A fetched run is marked (repo, run id, attempt) in the same transaction as its
jobs, so a restart, a repeated listing or an overlap never stores a job twice, and a re-run
(a new attempt) is fetched again. GitHub's run listing answers at most 1,000 runs per query, so
the look-back is listed in day windows, halved while a window holds more.

The listing is cheap (conditional requests; unchanged pages are 304s that cost no rate limit);
the per-run job requests are not, so each round fetches at most `runs_per_round` runs and none
while less than a tenth of the rate limit is left. The rest waits for the next round, which may
be hours away for a long backfill: what waits is each run's id, attempt, creation time, event
and branch (a Listed), not the run as listed, so a year of runs with long names is not held.
"""

from __future__ import annotations

import logging
import math
import sqlite3
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fleet_min.controlplane import store
from fleet_min.controlplane.github.client import GitHub, GitHubError
from fleet_min.db import Database
from fleet_min.timeutil import iso, parse_iso

log = logging.getLogger(__name__)

OVERLAP_S = 2 * 86400
WINDOW_S = 86400
MIN_WINDOW_S = 3600
LISTING_CAP = 1000  # GitHub's most results for one filtered run query
RUNS_PER_ROUND = 200


def ts(text: Any) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return parse_iso(text)
    except ValueError:
        return None


class Listed(NamedTuple):
    """A listed run as the history keeps it until its jobs are fetched: only what fetching
    them and storing their rows reads."""
    run_id: int
    run_attempt: int
    created_at: float | None
    event: str | None
    branch: str | None

    def context(self) -> dict[str, Any]:
        """The run's fields job_row reads."""
        return {"event": self.event, "branch": self.branch}


def listed(run: dict[str, Any], shared: dict[str, str]) -> Listed:
    """`run` (as GitHub.completed_runs lists it) as a Listed. Equal events and branches share
    one string through `shared`: JSON gives each run its own copy of "push" and "main"."""
    def one(text: Any) -> str | None:
        return shared.setdefault(text, text) if isinstance(text, str) else None
    return Listed(run["id"], run["run_attempt"], ts(run.get("created_at")), one(run.get("event")),
                  one(run.get("branch")))


def job_row(job: dict[str, Any], run: dict[str, Any] | None = None) -> dict[str, Any]:
    """A job as GitHub.jobs() returns it -> a row of the jobs table."""
    return {"job_id": job["id"], "run_id": job["run_id"], "repo": job["repo"],
            "name": job.get("name") or "", "workflow": job.get("workflow"),
            "runner": job.get("runner"), "status": job.get("status") or "unknown",
            "conclusion": job.get("conclusion"), "created_at": ts(job.get("created_at")),
            "started_at": ts(job.get("started_at")), "completed_at": ts(job.get("completed_at")),
            "labels": job.get("labels") or [], "run_attempt": job.get("run_attempt") or 1,
            "head_branch": job.get("head_branch") or (run or {}).get("branch"),
            "event": (run or {}).get("event"),
            "steps": [[s["name"], s.get("conclusion"), ts(s.get("started_at")),
                       ts(s.get("completed_at"))] for s in job.get("steps") or []]}


def created_range(start: float, end: float) -> str:
    """GitHub's inclusive search range for [start, end)."""
    def fmt(t: float) -> str:
        return (iso(t) or "")[:19] + "Z"
    return f"{fmt(start)}..{fmt(end - 1)}"


def day_windows(since: float, until: float, step: float = WINDOW_S) -> list[tuple[float, float]]:
    """[since, until) cut at UTC midnights, newest first (recent history comes first). Whole
    days keep the same query from round to round, so their pages come back as cheap 304s."""
    out = []
    end = until
    while end > since:
        start = max(since, (math.ceil(end / step) - 1) * step)
        out.append((start, end))
        end = start
    return out


# --- the database side (transactions for Database.write, and reads) -----------------------

def record_run(conn: sqlite3.Connection, repo: str, run: Listed, rows: list[dict[str, Any]],
               at: float) -> None:
    """Store a run's jobs and mark the run (this attempt) fetched, in one transaction."""
    store.upsert_jobs(conn, rows)
    conn.execute("INSERT OR REPLACE INTO history_runs (repo, run_id, run_attempt, created_at, "
                 "fetched_at, jobs) VALUES (?, ?, ?, ?, ?, ?)",
                 (repo, run.run_id, run.run_attempt, run.created_at, at, len(rows)))


def save_state(conn: sqlite3.Connection, repo: str, backfill_since: float,
               caught_up_at: float | None, last_round_at: float, error: str | None,
               pending: int) -> None:
    conn.execute(
        "INSERT INTO history_state (repo, backfill_since, caught_up_at, last_round_at, "
        "last_error, pending) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (repo) DO UPDATE SET "
        "caught_up_at = coalesce(excluded.caught_up_at, history_state.caught_up_at), "
        "last_round_at = excluded.last_round_at, last_error = excluded.last_error, "
        "pending = excluded.pending",
        (repo, backfill_since, caught_up_at, last_round_at, error, pending))


async def load_state(db: Database, repo: str) -> sqlite3.Row | None:
    return await db.read_one("SELECT * FROM history_state WHERE repo = ?", (repo,))


async def fetched_runs(db: Database, repo: str, since: float) -> set[tuple[int, int]]:
    rows = await db.read("SELECT run_id, run_attempt FROM history_runs WHERE repo = ? AND "
                         "(created_at IS NULL OR created_at >= ?)", (repo, since - OVERLAP_S))
    return {(row["run_id"], row["run_attempt"]) for row in rows}


async def status(db: Database, repos: list[str]) -> list[dict[str, Any]]:
    """Per repository: how far collection has come (for the pages and the docs' trust notes)."""
    out = []
    for repo in repos:
        state = await load_state(db, repo)
        counts = await db.read_one(
            "SELECT count(*) AS runs, coalesce(sum(jobs), 0) AS jobs, min(created_at) AS oldest "
            "FROM history_runs WHERE repo = ?", (repo,))
        out.append({
            "repo": repo,
            "backfill_since": iso(state["backfill_since"]) if state else None,
            "caught_up_at": iso(state["caught_up_at"]) if state else None,
            "last_round_at": iso(state["last_round_at"]) if state else None,
            "backfill_complete": bool(state and state["caught_up_at"] is not None),
            "pending_runs": state["pending"] if state else None,
            "runs_fetched": counts["runs"] if counts else 0,
            "jobs_fetched": counts["jobs"] if counts else 0,
            "oldest_run_at": iso(counts["oldest"]) if counts else None,
            "error": state["last_error"] if state else None})
    return out


# --- collection -----------------------------------------------------------------------------

@dataclass
class _Pending:
    since: float
    listed_at: float
    runs: deque[Listed] = field(default_factory=deque)  # fetched from the left, one by one


class HistoryCollector:
    def __init__(self, github: GitHub, db: Database, backfill_days: int,
                 clock: Callable[[], float], runs_per_round: int = RUNS_PER_ROUND) -> None:
        self.github = github
        self.db = db
        self.backfill_s = backfill_days * 86400
        self.clock = clock
        self.runs_per_round = runs_per_round
        self._pending: dict[str, _Pending] = {}

    async def round(self, repos: list[str]) -> None:
        for repo in repos:
            try:
                await self.collect(repo)
            except GitHubError as exc:
                log.warning("history of %s: %s", repo, exc)
                await self._save(repo, error=str(exc))
        for repo in set(self._pending) - set(repos):
            del self._pending[repo]
        await self.db.write(store.prune_jobs, self.clock())

    async def _since(self, repo: str) -> tuple[float, float | None]:
        """(backfill_since, look-back start) for this repository."""
        at = self.clock()
        state = await load_state(self.db, repo)
        if state is None:
            return at - self.backfill_s, at - self.backfill_s
        floor = max(state["backfill_since"], at - self.backfill_s)
        caught = state["caught_up_at"]
        return state["backfill_since"], floor if caught is None else max(floor, caught - OVERLAP_S)

    async def collect(self, repo: str) -> None:
        backfill_since, since = await self._since(repo)
        pending = self._pending.get(repo)
        if pending is None or not pending.runs:
            listed_at = self.clock()
            assert since is not None
            known = await fetched_runs(self.db, repo, since)
            runs = await self.list_runs(repo, since, listed_at)
            fresh = [r for r in runs if (r.run_id, r.run_attempt) not in known]
            pending = self._pending[repo] = _Pending(since, listed_at, deque(fresh))
        fetched = 0
        while pending.runs and fetched < self.runs_per_round and self._rate_ok():
            run = pending.runs[0]
            jobs = await self.github.jobs(repo, run.run_id, all_attempts=True)
            context = run.context()
            await self.db.write(record_run, repo, run, [job_row(j, context) for j in jobs],
                                self.clock())
            pending.runs.popleft()
            fetched += 1
        caught_up = pending.listed_at if not pending.runs else None
        await self._save(repo, backfill_since, caught_up, None, len(pending.runs))

    async def _save(self, repo: str, backfill_since: float | None = None,
                    caught_up: float | None = None, error: str | None = None,
                    pending: int | None = None) -> None:
        if backfill_since is None:
            backfill_since, _ = await self._since(repo)
        left = pending if pending is not None else len(getattr(self._pending.get(repo),
                                                               "runs", []))
        await self.db.write(save_state, repo, backfill_since, caught_up, self.clock(), error,
                            left)

    def _rate_ok(self) -> bool:
        rate = self.github.rate
        return not rate.get("limit") or rate["remaining"] >= rate["limit"] * 0.1

    async def list_runs(self, repo: str, since: float, until: float) -> list[Listed]:
        """Every completed run created in [since, until), each run once, newest first. Each is
        cut down to a Listed as its page is read: the listing of a long backfill is hundreds of
        pages, and a page's runs as listed (names and all) are let go with the page."""
        seen: dict[tuple[int, int], Listed] = {}
        shared: dict[str, str] = {}
        windows = day_windows(since, until)
        while windows:
            start, end = windows.pop(0)
            runs, total = await self._list_window(repo, start, end)
            if total > LISTING_CAP and end - start > MIN_WINDOW_S:
                middle = start + (end - start) / 2
                windows[:0] = [(middle, end), (start, middle)]
                continue
            for run in runs:
                if isinstance(run.get("id"), int) and (run["id"], run["run_attempt"]) not in seen:
                    seen[run["id"], run["run_attempt"]] = listed(run, shared)
        # Newest first; a run without a usable creation time last.
        return sorted(seen.values(), key=lambda r: (r.created_at is not None, r.created_at or 0),
                      reverse=True)

    async def _list_window(self, repo: str, start: float, end: float
                           ) -> tuple[list[dict[str, Any]], int]:
        created = created_range(start, end)
        runs, total, more = await self.github.completed_runs(repo, created, 1)
        if total > LISTING_CAP and end - start > MIN_WINDOW_S:
            return [], total  # the caller splits the window; no point reading its pages
        page = 1
        while more and page * 100 < LISTING_CAP:
            page += 1
            extra, _, more = await self.github.completed_runs(repo, created, page)
            runs += extra
        return runs, total

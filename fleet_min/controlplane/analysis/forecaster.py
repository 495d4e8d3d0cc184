"""Forecasts of the next hour's demand per watched repository (GET /api/forecast): made from the
job history and the workflow files' schedules (forecast.py computes them), stored, and scored
once the history has caught up with the hour they were for. Autoscale reads the latest ones.
Domain only: no aiohttp.web here.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from typing import Any

from fleet_min.controlplane.analysis import forecast
from fleet_min.controlplane.analysis.analytics import self_hosted
from fleet_min.controlplane.github import history
from fleet_min.controlplane.github.workflow_files import WorkflowFiles
from fleet_min.controlplane.state import Plane
from fleet_min.timeutil import iso

DAY = 86400.0
KEEP_S = 400 * DAY


# --- transactions for Database.write ---------------------------------------------------------

def _store_predictions(conn: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> None:
    conn.executemany("INSERT OR IGNORE INTO forecasts (repo, hour_start, source, predicted, "
                     "confidence, made_at, detail) VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    conn.execute("DELETE FROM forecasts WHERE hour_start < ?",
                 ((rows[0][5] if rows else 0) - KEEP_S,))


def _score(conn: sqlite3.Connection, scores: list[tuple[float, float, str, float, str]]) -> None:
    conn.executemany("UPDATE forecasts SET actual = ?, scored_at = ? WHERE repo = ? AND "
                     "hour_start = ? AND source = ?", scores)


_INTERVALS = ("SELECT created_at, completed_at, labels FROM jobs WHERE repo = ? AND "
              "completed_at >= ? AND created_at IS NOT NULL AND status = 'completed' AND "
              "coalesce(conclusion, '') != 'skipped'")


def _intervals(conn: sqlite3.Connection, repo: str, since: float) -> list[tuple[float, float]]:
    """In a worker thread: the self-hosted jobs' (created, completed) times since `since`."""
    return [(created, completed) for created, completed, labels
            in conn.execute(_INTERVALS, (repo, since)) if self_hosted(labels)]


def _history_prediction(conn: sqlite3.Connection, repo: str, hour_start: float,
                        covered: float | None) -> dict[str, Any]:
    """In a worker thread: the history's prediction for the hour. Its rows (nine weeks of a
    busy repository: hundreds of thousands) are read, filtered and freed off the event loop's
    thread, which they held for most of a second."""
    since = hour_start - (forecast.WEEKS + 1) * 7 * DAY
    return forecast.history_prediction(_intervals(conn, repo, since), hour_start, covered)


def _slot_peak(conn: sqlite3.Connection, repo: str, start: float, end: float) -> float:
    """In a worker thread: the most jobs running at once in [start, end)."""
    return float(forecast.slot_peak(_intervals(conn, repo, start - 2 * DAY), start, end))


class Forecaster:
    def __init__(self, plane: Plane, files: WorkflowFiles) -> None:
        self.plane = plane
        self.files = files
        self.latest: dict[str, dict[str, Any]] = {}  # each repository's last combined forecast
        self._making: asyncio.Future[dict[str, Any]] | None = None  # see forecast

    async def _covered_since(self, repo: str) -> float | None:
        """Where the history of a repository starts: the backfill's start, or its oldest
        recorded run when that is later (weeks before a repository's first run are unknown,
        not idle)."""
        state = await history.load_state(self.plane.db, repo)
        row = await self.plane.db.read_one(
            "SELECT min(created_at) AS oldest FROM history_runs WHERE repo = ?", (repo,))
        if state is None or row is None or row["oldest"] is None:
            return None
        return max(state["backfill_since"], row["oldest"])

    async def forecast_repo(self, repo: str, hour_start: float) -> dict[str, Any]:
        covered = await self._covered_since(repo)
        flows = await self.files.workflows(repo)
        past = await self.plane.db.read_in_thread(_history_prediction, repo, hour_start,
                                                  covered)
        # In a worker thread, as the history's prediction: every due minute of every schedule
        # of every file is worked out (64 schedules a file, each up to 60 minutes an hour).
        scheduled = await asyncio.to_thread(forecast.schedule_prediction, flows, hour_start)
        combined = forecast.combine(past, scheduled)
        return {"repo": repo, "hour_start": iso(hour_start),
                "hour_end": iso(hour_start + forecast.HOUR), "expected": combined,
                "predictions": [past, scheduled]}

    async def forecast(self) -> dict[str, Any]:
        """The next hour's forecasts of every watched repository, stored; earlier ones scored.

        One is made at a time, and every request that comes while it is made gets it: each
        holds the history of every watched repository for a moment, and twenty requests at
        once, each making its own, took 1.4 GB. A request that goes away does not stop it."""
        making = self._making
        if making is None:
            making = self._making = asyncio.ensure_future(self._forecast())

            def made(done: asyncio.Future[dict[str, Any]]) -> None:
                self._making = None
                if not done.cancelled():
                    done.exception()  # seen here: every request for it may have gone
            making.add_done_callback(made)
        return await asyncio.shield(making)

    async def _forecast(self) -> dict[str, Any]:
        at = self.plane.clock()
        hour = forecast.next_hour(at)
        repos = [await self.forecast_repo(repo, hour) for repo in self.plane.watched_repos()]
        rows = []
        for entry in repos:
            for p in (*entry["predictions"], entry["expected"]):
                if p["value"] is not None:
                    rows.append((entry["repo"], hour, p["source"], float(p["value"]),
                                 p["confidence"], at, json.dumps({"reason": p["reason"]})))
            self.latest[entry["repo"]] = entry["expected"]
        if rows:
            await self.plane.db.write(_store_predictions, rows)
        await self.score(at)
        return {"generated_at": iso(at), "hour_start": iso(hour),
                "hour_end": iso(hour + forecast.HOUR), "repos": repos,
                "scores": await self.scores()}

    async def score(self, at: float) -> None:
        due = await self.plane.db.read(
            "SELECT repo, hour_start, source FROM forecasts WHERE actual IS NULL AND "
            "hour_start <= ?", (at - forecast.HOUR - forecast.SCORE_AFTER_S,))
        scores = []
        for row in due:
            state = await history.load_state(self.plane.db, row["repo"])
            end = row["hour_start"] + forecast.HOUR
            if state is None or (state["caught_up_at"] or 0) < end + forecast.SCORE_AFTER_S:
                continue  # the history has not caught up with that hour yet
            actual = await self.plane.db.read_in_thread(_slot_peak, row["repo"],
                                                        row["hour_start"], end)
            scores.append((actual, at, row["repo"], row["hour_start"], row["source"]))
        if scores:
            await self.plane.db.write(_score, scores)

    async def scores(self) -> list[dict[str, Any]]:
        out = []
        for repo in self.plane.watched_repos():
            rows = [dict(r) for r in await self.plane.db.read(
                "SELECT * FROM forecasts WHERE repo = ? AND actual IS NOT NULL "
                "ORDER BY hour_start DESC LIMIT 500", (repo,))]
            by_source = {source: forecast.score_summary([r for r in rows
                                                          if r["source"] == source])
                         for source in ("history", "schedule", "combined")}
            out.append({"repo": repo, **by_source["combined"], "by_source": by_source,
                        "recent": [{"hour_start": iso(r["hour_start"]), "source": r["source"],
                                    "predicted": r["predicted"], "actual": r["actual"],
                                    "confidence": r["confidence"]} for r in rows[:48]]})
        return out

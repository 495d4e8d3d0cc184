"""The analysis side of the daemon: history collection, analytics, repository detail,
concurrency findings, simulation, forecast, autoscale, admission and billing.

Each public coroutine gathers what it needs from the database and the engine, hands it to the
pure module that computes the figures (analytics, workflows, simulate, forecast, autoscale) and
returns the JSON the API serves. Heavy computations run in a worker thread so the event loop
keeps serving the stream and the actions meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet_min.controlplane.analysis import analytics, autoscale, forecast, workflows
from fleet_min.controlplane.analysis.admission import AdmissionLog
from fleet_min.controlplane.analysis.billing import Billing
from fleet_min.controlplane.analysis.simulate import MAX_COUNT, MAX_COUNTS, Trace, compare
from fleet_min.controlplane.github import history
from fleet_min.controlplane.github.history import HistoryCollector
from fleet_min.controlplane.github.workflow_files import WorkflowFiles
from fleet_min.controlplane.runners.actions import run_action
from fleet_min.controlplane.runners.discovery import valid_repo
from fleet_min.errors import BadRequest, NotFound, Refused
from fleet_min.timeutil import iso

if TYPE_CHECKING:
    from fleet_min.controlplane.snapshot import ControlPlane

log = logging.getLogger(__name__)

DAY = 86400.0
REPO_DAYS = 30
_STEP_FILTER = " OR ".join(f"steps LIKE '%{word}%'" for word in analytics.STEP_PREFILTER)
_JOB_COLUMNS = ("job_id, repo, name, workflow, runner, conclusion, created_at, started_at, "
                "completed_at, labels")


def check_repo(name: Any, field: str = "name") -> str:
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{field} must be a repository as owner/project")
    if not valid_repo(name) or name.count("/") != 1:
        raise BadRequest(f"{field} must be a repository as owner/project, got {name[:100]!r}")
    return name


@functools.lru_cache(maxsize=4096)  # a repository has a handful of distinct label sets
def _self_hosted(labels_json: str) -> bool:
    try:
        labels = json.loads(labels_json)
    except ValueError:
        return False
    return any(str(label).lower() == "self-hosted" for label in labels)


# --- forecasts and autoscale decisions in the database --------------------------------------

def _store_predictions(conn: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> None:
    conn.executemany("INSERT OR IGNORE INTO forecasts (repo, hour_start, source, predicted, "
                     "confidence, made_at, detail) VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    conn.execute("DELETE FROM forecasts WHERE hour_start < ?",
                 ((rows[0][5] if rows else 0) - 400 * DAY,))


def _score(conn: sqlite3.Connection, scores: list[tuple[float, float, str, float, str]]) -> None:
    conn.executemany("UPDATE forecasts SET actual = ?, scored_at = ? WHERE repo = ? AND "
                     "hour_start = ? AND source = ?", scores)


def _record_decision(conn: sqlite3.Connection, d: autoscale.Decision, mode: str, at: float,
                     result: dict[str, Any] | None) -> None:
    action = d.action["id"] if d.action else None
    args = json.dumps(d.action["args"] if d.action else {}, sort_keys=True)
    last = conn.execute("SELECT id, direction, outcome, action, args FROM autoscale WHERE "
                        "repo = ? ORDER BY id DESC LIMIT 1", (d.repo,)).fetchone()
    if (result is None and last is not None
            and tuple(last[1:]) == (d.direction, d.outcome, action, args)):
        conn.execute("UPDATE autoscale SET last_seen_at = ?, seen = seen + 1, reasons = ?, "
                     "inputs = ? WHERE id = ?",
                     (at, json.dumps(d.reasons), json.dumps(d.inputs), last[0]))
        return
    conn.execute("INSERT INTO autoscale (at, last_seen_at, repo, direction, outcome, mode, "
                 "action, args, reasons, inputs, result) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                 (at, at, d.repo, d.direction, d.outcome, mode, action, args,
                  json.dumps(d.reasons), json.dumps(d.inputs),
                  json.dumps(result) if result is not None else None))
    conn.execute("DELETE FROM autoscale WHERE id <= (SELECT max(id) FROM autoscale) - 5000")


class Analysis:
    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.collector = HistoryCollector(cp.github, cp.db, cp.cfg.backfill_days, cp.clock)
        self.files = WorkflowFiles(cp.github, cp.db, cp.clock)
        self.billing_source = Billing(cp.github, cp.clock)
        state = Path(cp.cfg.state_dir).expanduser()
        self.admission_log = AdmissionLog(
            Path(cp.cfg.admission_log).expanduser() if cp.cfg.admission_log
            else state / "admission.log", cp.db)
        self.forecasts: dict[str, dict[str, Any]] = {}
        self.autoscale_at: float | None = None
        self.rounds = 0
        self._simulating = asyncio.Lock()

    # --- the background round --------------------------------------------------------------

    async def round(self) -> None:
        repos = self.cp.watched_repos()
        if self.cp.github.token:
            await self.collector.round(repos)
            for repo in repos:
                if self.files.due(repo, self.cp.setting("workflows_s")):
                    await self.files.refresh(repo)
        await self.forecast()
        self.rounds += 1

    # --- analytics and repository detail -------------------------------------------------------

    async def job_rows(self, since: float, repo: str | None = None) -> list[dict[str, Any]]:
        where = "completed_at >= ? AND status = 'completed'" + (" AND repo = ?" if repo else "")
        params: tuple[Any, ...] = (since, repo) if repo else (since,)
        rows = await self.cp.db.read(
            f"SELECT {_JOB_COLUMNS}, CASE WHEN {_STEP_FILTER} THEN steps END AS steps "
            f"FROM jobs WHERE {where}", params)
        return [dict(row) for row in rows]

    async def analytics(self, days: int) -> dict[str, Any]:
        until = self.cp.clock()
        since = until - days * DAY
        rows = await self.job_rows(since)

        def compute() -> dict[str, Any]:
            return {"repos": analytics.per_repo(rows), "browser_test": analytics.browser_test(rows)}

        figures = await asyncio.to_thread(compute)
        return {"generated_at": iso(until), "days": days, "since": iso(since), "until": iso(until),
                **figures, "history": await history.status(self.cp.db, self.cp.watched_repos())}

    async def repo(self, name: str) -> dict[str, Any]:
        until = self.cp.clock()
        rows = await self.job_rows(until - REPO_DAYS * DAY, name)
        if not rows and name not in self.cp.watched_repos():
            raise NotFound(f"no job history for {name}: it is not a watched repository "
                           "(no runner here or on an agent serves it; see FLEET_WATCH_REPOS)")
        detail = await asyncio.to_thread(analytics.repo_detail, name, rows)
        data = self.cp.repos.get(name)
        return {"generated_at": iso(until), "days": REPO_DAYS,
                "since": iso(until - REPO_DAYS * DAY), **detail,
                "runners": [{"name": v["name"], "host": v["host"], "state": v["state"],
                             "busy": v["busy"]} for v in self.cp.snapshot.get("runners", [])
                            if v.get("repo") == name],
                "registered": data.runners if data else None,
                "history": (await history.status(self.cp.db, [name]))[0]}

    # --- concurrency findings ----------------------------------------------------------------

    async def concurrency(self) -> dict[str, Any]:
        out, repos = [], []
        for repo in self.cp.watched_repos():
            flows = await self.files.workflows(repo)
            data = self.cp.repos.get(repo)
            out += workflows.findings(repo, flows, data.runners if data else None)
            repos.append({**self.files.status.get(repo, {"repo": repo, "default_branch": None,
                                                        "fetched_at": None, "files": 0,
                                                        "error": None}),
                          "parse_errors": [{"file": f.path, "error": f.error}
                                           for f in flows if f.error]})
        return {"generated_at": iso(self.cp.clock()), "repos": repos, "findings": out}

    # --- simulation ----------------------------------------------------------------------------

    async def simulate(self, body: dict[str, Any]) -> dict[str, Any]:
        repo = check_repo(body.get("repo"), "repo")
        counts = body.get("runnerCounts")
        if (not isinstance(counts, list) or not 1 <= len(counts) <= MAX_COUNTS or any(
                isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= MAX_COUNT
                for c in counts)):
            raise BadRequest(f"runnerCounts must be a list of 1 to {MAX_COUNTS} whole numbers "
                             f"from 0 to {MAX_COUNT}")
        slo = body.get("sloSec")
        if isinstance(slo, bool) or not isinstance(slo, int) or not 0 <= slo <= 7 * 86400:
            raise BadRequest("sloSec must be a whole number of seconds from 0 to 604800")
        days = body.get("days", 30)
        if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= 365:
            raise BadRequest("days must be a whole number from 1 to 365")
        until = self.cp.clock()
        rows = await self.cp.db.read(
            "SELECT job_id, created_at, started_at, completed_at, labels FROM jobs WHERE repo = ? "
            "AND completed_at >= ? AND runner IS NOT NULL AND created_at IS NOT NULL AND "
            "started_at IS NOT NULL AND status = 'completed'", (repo, until - days * DAY))
        hosted = [r for r in rows if _self_hosted(r["labels"])]
        chosen = hosted or rows
        if not chosen:
            raise NotFound(f"no recorded jobs of {repo} in the last {days} days to replay")
        async with self._simulating:  # one replay at a time: CPU is the runners' first
            # The rows' first four columns are (job id, created, started, completed).
            result = await asyncio.to_thread(lambda: compare(Trace.build(chosen), counts, slo))
        return {"generated_at": iso(until), "repo": repo, "days": days,
                "since": iso(until - days * DAY), "self_hosted_only": bool(hosted), **result}

    # --- forecast ------------------------------------------------------------------------------

    async def _intervals(self, repo: str, since: float) -> list[tuple[float, float]]:
        rows = await self.cp.db.read(
            "SELECT created_at, completed_at, labels FROM jobs WHERE repo = ? AND "
            "completed_at >= ? AND created_at IS NOT NULL AND status = 'completed' AND "
            "coalesce(conclusion, '') != 'skipped'", (repo, since))
        return [(r["created_at"], r["completed_at"]) for r in rows if _self_hosted(r["labels"])]

    async def _covered_since(self, repo: str) -> float | None:
        """Where the history of a repository starts: the backfill's start, or its oldest
        recorded run when that is later (weeks before a repository's first run are unknown,
        not idle)."""
        state = await history.load_state(self.cp.db, repo)
        row = await self.cp.db.read_one(
            "SELECT min(created_at) AS oldest FROM history_runs WHERE repo = ?", (repo,))
        if state is None or row is None or row["oldest"] is None:
            return None
        return max(state["backfill_since"], row["oldest"])

    async def forecast_repo(self, repo: str, hour_start: float) -> dict[str, Any]:
        intervals = await self._intervals(repo, hour_start - (forecast.WEEKS + 1) * 7 * DAY)
        covered = await self._covered_since(repo)
        flows = await self.files.workflows(repo)
        past = await asyncio.to_thread(forecast.history_prediction, intervals, hour_start,
                                       covered)
        scheduled = forecast.schedule_prediction(flows, hour_start)
        combined = forecast.combine(past, scheduled)
        return {"repo": repo, "hour_start": iso(hour_start),
                "hour_end": iso(hour_start + forecast.HOUR), "expected": combined,
                "predictions": [past, scheduled]}

    async def forecast(self) -> dict[str, Any]:
        at = self.cp.clock()
        hour = forecast.next_hour(at)
        repos = [await self.forecast_repo(repo, hour) for repo in self.cp.watched_repos()]
        rows = []
        for entry in repos:
            for p in (*entry["predictions"], entry["expected"]):
                if p["value"] is not None:
                    rows.append((entry["repo"], hour, p["source"], float(p["value"]),
                                 p["confidence"], at, json.dumps({"reason": p["reason"]})))
            self.forecasts[entry["repo"]] = entry["expected"]
        if rows:
            await self.cp.db.write(_store_predictions, rows)
        await self.score(at)
        return {"generated_at": iso(at), "hour_start": iso(hour),
                "hour_end": iso(hour + forecast.HOUR), "repos": repos,
                "scores": await self.scores()}

    async def score(self, at: float) -> None:
        due = await self.cp.db.read(
            "SELECT repo, hour_start, source FROM forecasts WHERE actual IS NULL AND "
            "hour_start <= ?", (at - forecast.HOUR - forecast.SCORE_AFTER_S,))
        scores = []
        for row in due:
            state = await history.load_state(self.cp.db, row["repo"])
            end = row["hour_start"] + forecast.HOUR
            if state is None or (state["caught_up_at"] or 0) < end + forecast.SCORE_AFTER_S:
                continue  # the history has not caught up with that hour yet
            intervals = await self._intervals(row["repo"], row["hour_start"] - 2 * DAY)
            actual = forecast.slot_peak(intervals, row["hour_start"], end)
            scores.append((float(actual), at, row["repo"], row["hour_start"], row["source"]))
        if scores:
            await self.cp.db.write(_score, scores)

    async def scores(self) -> list[dict[str, Any]]:
        out = []
        for repo in self.cp.watched_repos():
            rows = [dict(r) for r in await self.cp.db.read(
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

    # --- autoscale -----------------------------------------------------------------------------

    async def _repo_state(self, repo: str) -> autoscale.RepoState:
        snap = self.cp.snapshot
        views = [v for v in self.cp.views if v["repo"] == repo]
        dups = {row["name"]: row["created_at"] for row in await self.cp.db.read(
            "SELECT name, created_at FROM duplicates WHERE repo = ?", (repo,))}
        idle_since = {}
        for name, created in dups.items():
            row = await self.cp.db.read_one(
                "SELECT max(completed_at) AS last FROM jobs WHERE runner = ?", (name,))
            idle_since[name] = max(created, (row["last"] if row else None) or 0)
        last = await self.cp.db.read_one(
            "SELECT max(at) AS at FROM autoscale WHERE repo = ? AND outcome = 'executed'",
            (repo,))
        return autoscale.RepoState(
            repo, views, [c for c in snap.get("queue_causes", []) if c["repo"] == repo],
            self.forecasts.get(repo), idle_since, last["at"] if last else None,
            snap.get("capacity", {}))

    async def autoscale(self) -> None:
        """One evaluation: a decision per local repository, executed when so configured."""
        if self.cp.setting("autoscale") != "on":
            return
        mode = self.cp.setting("autoscale_mode")
        at = self.cp.clock()
        self.autoscale_at = at
        for repo in sorted({v["repo"] for v in self.cp.views if v["repo"]}):
            decision = autoscale.decide(await self._repo_state(repo), at,
                                        self.cp.setting("autoscale_cooldown_s"),
                                        self.cp.setting("autoscale_idle_s"))
            if decision is None:
                continue
            result = None
            if mode == "execute" and decision.outcome == "proposed" and decision.action:
                try:
                    reply = await run_action(self.cp, decision.action["id"],
                                             decision.action["args"], "autoscale")
                    result = {k: reply.get(k) for k in ("ok", "code", "error", "runner")}
                except Refused as exc:
                    result = {"ok": False, "error": exc.message}
                decision.outcome = "executed" if result.get("ok") else "failed"
            await self.cp.db.write(_record_decision, decision, mode, at, result)

    async def autoscale_report(self, limit: int = 100) -> dict[str, Any]:
        rows = await self.cp.db.read("SELECT * FROM autoscale ORDER BY id DESC LIMIT ?", (limit,))
        return {"generated_at": iso(self.cp.clock()),
                "enabled": self.cp.setting("autoscale") == "on",
                "mode": self.cp.setting("autoscale_mode"),
                "cooldown_s": self.cp.setting("autoscale_cooldown_s"),
                "idle_s": self.cp.setting("autoscale_idle_s"),
                "evaluated_at": iso(self.autoscale_at),
                "decisions": [{"id": r["id"], "at": iso(r["at"]),
                               "last_seen_at": iso(r["last_seen_at"]), "seen": r["seen"],
                               "repo": r["repo"], "direction": r["direction"],
                               "outcome": r["outcome"], "mode": r["mode"],
                               "action": {"id": r["action"], "args": json.loads(r["args"])}
                               if r["action"] else None,
                               "reasons": json.loads(r["reasons"]),
                               "inputs": json.loads(r["inputs"]),
                               "result": json.loads(r["result"]) if r["result"] else None}
                              for r in rows]}

    # --- admission and billing -------------------------------------------------------------

    async def admission(self, limit: int) -> dict[str, Any]:
        await self.admission_log.ingest(self.cp.clock())
        return {"generated_at": iso(self.cp.clock()), **await self.admission_log.report(limit)}

    async def billing(self) -> dict[str, Any]:
        owners = [repo.split("/", 1)[0] for repo in self.cp.watched_repos()]
        return {"generated_at": iso(self.cp.clock()),
                **await self.billing_source.snapshot(owners)}

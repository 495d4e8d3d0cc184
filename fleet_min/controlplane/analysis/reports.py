"""The analysis reports the API serves from the stored job history: analytics, one repository's
detail, concurrency findings of the workflow files, a replay of the history with other runner
counts (simulate), billing and the admission log.

Each coroutine gathers what it needs from the database and the plane, hands it to the pure
module that computes the figures (analytics, workflows, simulate) and returns the JSON the API
serves. Heavy computations run in a worker thread so the event loop keeps serving the stream and
the actions meanwhile. Domain only: no aiohttp.web here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fleet_min.controlplane.analysis import analytics, workflows
from fleet_min.controlplane.analysis.admission import AdmissionLog
from fleet_min.controlplane.analysis.analytics import self_hosted
from fleet_min.controlplane.analysis.billing import Billing
from fleet_min.controlplane.analysis.simulate import MAX_COUNT, MAX_COUNTS, Trace, compare
from fleet_min.controlplane.github import history
from fleet_min.controlplane.github.workflow_files import WorkflowFiles
from fleet_min.controlplane.runners.discovery import valid_repo
from fleet_min.controlplane.state import Plane
from fleet_min.errors import BadRequest, NotFound
from fleet_min.timeutil import iso

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


def _counts(counts: Any) -> list[int]:
    if (not isinstance(counts, list) or not 1 <= len(counts) <= MAX_COUNTS or any(
            isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= MAX_COUNT
            for c in counts)):
        raise BadRequest(f"runnerCounts must be a list of 1 to {MAX_COUNTS} whole numbers "
                         f"from 0 to {MAX_COUNT}")
    return counts


def _whole(value: Any, low: int, high: int, message: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(message)
    return value


class Reports:
    def __init__(self, plane: Plane, files: WorkflowFiles, billing: Billing,
                 admission_log: AdmissionLog) -> None:
        self.plane = plane
        self.files = files
        self.billing_source = billing
        self.admission_log = admission_log
        self._simulating = asyncio.Lock()
        # A report over the job history holds every row of its window (hundreds of MB at a
        # year of a busy repository): one is built at a time, and requests for the same one
        # while it is being built share it.
        self._reading = asyncio.Lock()
        self._building: dict[tuple[str, Any], asyncio.Future[dict[str, Any]]] = {}

    # --- analytics and repository detail -------------------------------------------------------

    async def job_rows(self, since: float, repo: str | None = None) -> list[dict[str, Any]]:
        where = "completed_at >= ? AND status = 'completed'" + (" AND repo = ?" if repo else "")
        params: tuple[Any, ...] = (since, repo) if repo else (since,)
        rows = await self.plane.db.read(
            f"SELECT {_JOB_COLUMNS}, CASE WHEN {_STEP_FILTER} THEN steps END AS steps "
            f"FROM jobs WHERE {where}", params)
        return [dict(row) for row in rows]

    async def _shared(self, key: tuple[str, Any],
                      build: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """The report `build` makes, built once for every request that asks for `key` while it
        is being built, and one report at a time. A request that goes away does not stop it
        for the others."""
        building = self._building.get(key)
        if building is None:
            async def in_turn() -> dict[str, Any]:
                async with self._reading:
                    return await build()
            def built(done: asyncio.Future[dict[str, Any]]) -> None:
                self._building.pop(key, None)
                if not done.cancelled():
                    done.exception()  # seen here: every request for it may have gone
            building = asyncio.ensure_future(in_turn())
            self._building[key] = building
            building.add_done_callback(built)
        return await asyncio.shield(building)

    async def analytics(self, days: int) -> dict[str, Any]:
        return await self._shared(("analytics", days), lambda: self._analytics(days))

    async def _analytics(self, days: int) -> dict[str, Any]:
        until = self.plane.clock()
        since = until - days * DAY
        rows = await self.job_rows(since)

        def compute() -> dict[str, Any]:
            return {"repos": analytics.per_repo(rows), "browser_test": analytics.browser_test(rows)}

        figures = await asyncio.to_thread(compute)
        return {"generated_at": iso(until), "days": days, "since": iso(since), "until": iso(until),
                **figures,
                "history": await history.status(self.plane.db, self.plane.watched_repos())}

    async def repo(self, name: str) -> dict[str, Any]:
        return await self._shared(("repo", name), lambda: self._repo(name))

    async def _repo(self, name: str) -> dict[str, Any]:
        until = self.plane.clock()
        rows = await self.job_rows(until - REPO_DAYS * DAY, name)
        if not rows and name not in self.plane.watched_repos():
            raise NotFound(f"no job history for {name}: it is not a watched repository "
                           "(no runner here or on an agent serves it; see FLEET_WATCH_REPOS)")
        detail = await asyncio.to_thread(analytics.repo_detail, name, rows)
        data = self.plane.repos.get(name)
        return {"generated_at": iso(until), "days": REPO_DAYS,
                "since": iso(until - REPO_DAYS * DAY), **detail,
                "runners": [{"name": v["name"], "host": v["host"], "state": v["state"],
                             "busy": v["busy"]} for v in self.plane.snapshot.get("runners", [])
                            if v.get("repo") == name],
                "registered": data.runners if data else None,
                "history": (await history.status(self.plane.db, [name]))[0]}

    # --- concurrency findings ----------------------------------------------------------------

    async def concurrency(self) -> dict[str, Any]:
        out, repos = [], []
        for repo in self.plane.watched_repos():
            flows = await self.files.workflows(repo)
            data = self.plane.repos.get(repo)
            out += workflows.findings(repo, flows, data.runners if data else None)
            repos.append({**self.files.status.get(repo, {"repo": repo, "default_branch": None,
                                                        "fetched_at": None, "files": 0,
                                                        "error": None}),
                          "parse_errors": [{"file": f.path, "error": f.error}
                                           for f in flows if f.error]})
        return {"generated_at": iso(self.plane.clock()), "repos": repos, "findings": out}

    # --- simulation ----------------------------------------------------------------------------

    async def simulate(self, body: dict[str, Any]) -> dict[str, Any]:
        """Replay the repository's recorded jobs with each of `runnerCounts` runners."""
        repo = check_repo(body.get("repo"), "repo")
        counts = _counts(body.get("runnerCounts"))
        slo = _whole(body.get("sloSec"), 0, 7 * 86400,
                     "sloSec must be a whole number of seconds from 0 to 604800")
        days = _whole(body.get("days", 30), 1, 365, "days must be a whole number from 1 to 365")
        until = self.plane.clock()
        rows = await self.plane.db.read(
            "SELECT job_id, created_at, started_at, completed_at, labels FROM jobs WHERE repo = ? "
            "AND completed_at >= ? AND runner IS NOT NULL AND created_at IS NOT NULL AND "
            "started_at IS NOT NULL AND status = 'completed'", (repo, until - days * DAY))
        hosted = [r for r in rows if self_hosted(r["labels"])]
        chosen = hosted or rows
        if not chosen:
            raise NotFound(f"no recorded jobs of {repo} in the last {days} days to replay")
        async with self._simulating:  # one replay at a time: CPU is the runners' first
            # The rows' first four columns are (job id, created, started, completed).
            result = await asyncio.to_thread(lambda: compare(Trace.build(chosen), counts, slo))
        return {"generated_at": iso(until), "repo": repo, "days": days,
                "since": iso(until - days * DAY), "self_hosted_only": bool(hosted), **result}

    # --- admission and billing -------------------------------------------------------------

    async def admission(self, limit: int) -> dict[str, Any]:
        await self.admission_log.ingest(self.plane.clock())
        return {"generated_at": iso(self.plane.clock()), **await self.admission_log.report(limit)}

    async def billing(self) -> dict[str, Any]:
        owners = [repo.split("/", 1)[0] for repo in self.plane.watched_repos()]
        return {"generated_at": iso(self.plane.clock()),
                **await self.billing_source.snapshot(owners)}

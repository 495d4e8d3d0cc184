"""The GitHub refresh: each watched repository's runner registrations, its queued and running
runs with their jobs, and the jobs of newly completed runs into the job history.

A round asks GitHub with conditional requests (an unchanged answer is a 304 that costs no rate
limit), rebuilds the snapshot so the new registrations and runs show at once, and then runs
what waits on fresh GitHub data (autoscale). Rounds are `github_s` apart, or sooner when an
action asks. Domain only: no aiohttp.web here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fleet_min.controlplane import store
from fleet_min.controlplane.github.client import GitHub, GitHubError
from fleet_min.controlplane.github.history import job_row
from fleet_min.controlplane.loops import stop_tasks
from fleet_min.controlplane.snapshot import Snapshots
from fleet_min.controlplane.state import Plane, RepoData
from fleet_min.timeutil import now

log = logging.getLogger(__name__)

COMPLETED_JOBS_PER_REFRESH = 10
RUN_STATUSES = ("queued", "pending", "in_progress")


class GitHubSync:
    def __init__(self, plane: Plane, github: GitHub, snapshots: Snapshots) -> None:
        self.plane = plane
        self.github = github
        self.snapshots = snapshots
        self._after_refresh: list[Callable[[], Awaitable[object]]] = []
        self._seen_completed: set[int] = set()
        self._tasks: list[asyncio.Task[None]] = []

    def after_refresh(self, hook: Callable[[], Awaitable[object]]) -> None:
        """Run `hook` after each round, once the snapshot shows what GitHub said."""
        self._after_refresh.append(hook)

    async def running(self, _app: object) -> AsyncIterator[None]:
        """The refresh loop while the daemon runs (a cleanup context)."""
        self._tasks = [asyncio.create_task(self._loop(), name="controlplane-github")]
        yield
        await stop_tasks(self._tasks)

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
                await self.snapshots.rebuild()
                for hook in self._after_refresh:
                    await hook()
            except Exception:
                log.exception("GitHub refresh failed; the next round tries again")
            await self.plane.github_round.wait(time.monotonic())  # the pause is between rounds

    async def refresh(self) -> None:
        # This host's own repositories first: those agents add wait behind them, never the
        # other way round.
        own = set(self.plane.own_repos())
        repos = sorted(self.plane.watched_repos(), key=lambda repo: repo not in own)
        known = self.plane.repos
        for repo in list(known):
            if repo not in repos:
                del known[repo]
        for repo in repos:
            data = known[repo]
            data.error = None
            try:
                await self._refresh_repo(repo, data)
            except GitHubError as exc:
                data.error = str(exc)
            data.refreshed_at = now()

    async def _refresh_repo(self, repo: str, data: RepoData) -> None:
        try:
            data.runners = await self.github.runners(repo)
        except GitHubError as exc:
            if exc.status not in (403, 404):
                raise
            # Listing runners needs admin rights a token may lack; its runs may still be
            # readable, and their queue causes then say the runner list is unavailable.
            data.runners, data.error = None, str(exc)
        runs = []
        for status in RUN_STATUSES:
            runs += await self.github.runs(repo, status)
        jobs = [job for run in runs for job in await self.github.jobs(repo, run["id"])]
        completed = await self.github.runs(repo, "completed")
        fresh = [run for run in completed if run["id"] not in self._seen_completed]
        if len(self._seen_completed) > 50_000:  # bounded memory; a re-read costs one request
            self._seen_completed.clear()
        for run in fresh[:COMPLETED_JOBS_PER_REFRESH]:
            jobs += await self.github.jobs(repo, run["id"])
            self._seen_completed.add(run["id"])
        current = {r["id"] for r in runs}  # once, not once a job
        data.runs, data.jobs = runs, [j for j in jobs if j["run_id"] in current]
        if jobs:
            await self.plane.db.write(store.upsert_jobs, [job_row(j) for j in jobs])

"""The analysis round, `history_s` apart: the job history of the watched repositories, their
workflow files when due (`workflows_s`), then the next hour's forecasts. Domain only: no
aiohttp.web here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from fleet_min.controlplane.analysis.forecaster import Forecaster
from fleet_min.controlplane.github.client import GitHub
from fleet_min.controlplane.github.history import HistoryCollector
from fleet_min.controlplane.github.workflow_files import WorkflowFiles
from fleet_min.controlplane.loops import stop_tasks
from fleet_min.controlplane.state import Plane

log = logging.getLogger(__name__)


class AnalysisRounds:
    def __init__(self, plane: Plane, github: GitHub, files: WorkflowFiles,
                 forecaster: Forecaster) -> None:
        self.plane = plane
        self.github = github
        self.files = files
        self.forecaster = forecaster
        self.collector = HistoryCollector(github, plane.db, plane.cfg.backfill_days, plane.clock)
        self.rounds = 0
        self._tasks: list[asyncio.Task[None]] = []

    async def running(self, _app: object) -> AsyncIterator[None]:
        """The round loop while the daemon runs (a cleanup context)."""
        self._tasks = [asyncio.create_task(self._loop(), name="controlplane-history")]
        yield
        await stop_tasks(self._tasks)

    async def _loop(self) -> None:
        while True:
            try:
                await self.round()
            except Exception:
                log.exception("analysis round failed; the next round tries again")
            await self.plane.analysis_round.wait(time.monotonic())

    async def round(self) -> None:
        repos = self.plane.watched_repos()
        if self.github.token:
            await self.collector.round(repos)
            for repo in repos:
                if self.files.due(repo, self.plane.setting("workflows_s")):
                    await self.files.refresh(repo)
        await self.forecaster.forecast()
        self.rounds += 1

"""The analysis reports the API serves from the stored job history: analytics, one repository's
detail, concurrency findings of the workflow files, a replay of the history with other runner
counts (simulate), billing and the admission log.

Each coroutine gathers what it needs from the database and the plane, hands it to the pure
module that computes the figures (analytics, workflows, simulate) and returns the JSON the API
serves. A report over the job history reads its rows, and computes its figures, in a worker thread
on a connection of its own (Database.read_in_thread), in Python loops or pieces short enough that
the GIL changes hands (see stats): a year of a busy repository is a million rows, and the event
loop keeps serving the stream and the actions meanwhile. Domain only: no aiohttp.web here.

Analytics windows are a fixed set (WINDOWS): a request for `days` gets the shortest of them that
covers it, and says so in its `days` and `since`. A window's figures are kept and served again
while the jobs in it stay the same (their count, the sum of their completion times, and no job
changed since: store's jobs_changes), so a sweep over every `days` from 1 to 365 builds at most
len(WINDOWS) reports, not 365.
"""

from __future__ import annotations

import asyncio
import sqlite3
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from fleet_min.controlplane.analysis import analytics, workflows
from fleet_min.controlplane.analysis.admission import AdmissionLog
from fleet_min.controlplane.analysis.analytics import self_hosted
from fleet_min.controlplane.analysis.billing import Billing
from fleet_min.controlplane.analysis.simulate import MAX_COUNT, MAX_COUNTS, Trace, compare
from fleet_min.controlplane.analysis.stats import PIECE
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
# The analytics windows in days (the web page offers 7, 30, 90 and 365).
WINDOWS = (1, 2, 3, 4, 5, 6, 7, 10, 14, 21, 30, 45, 60, 90, 120, 180, 270, 365)
_Mark = tuple[Any, ...]


def window_days(days: int) -> int:
    """The analytics window that covers the last `days` days: the shortest of WINDOWS."""
    return WINDOWS[bisect_left(WINDOWS, days)]


# --- in the worker thread (Database.read_in_thread) ----------------------------------------------

def _window_stream(conn: sqlite3.Connection, since: float, repo: str | None = None
                   ) -> Iterator[dict[str, Any]]:
    where = "completed_at >= ? AND status = 'completed'" + (" AND repo = ?" if repo else "")
    params: tuple[Any, ...] = (since, repo) if repo else (since,)
    cursor = conn.execute(
        f"SELECT {_JOB_COLUMNS}, CASE WHEN {_STEP_FILTER} THEN steps END AS steps "
        f"FROM jobs WHERE {where}", params)
    names = [column[0] for column in cursor.description]
    return (dict(zip(names, row, strict=True)) for row in cursor)


def _release(rows: list[Any]) -> None:
    """Free a long list a piece at a time: freeing a million rows at once is one call that
    holds the GIL for a quarter of a second."""
    while rows:
        del rows[-PIECE:]


def _window_mark(conn: sqlite3.Connection, since: float) -> _Mark:
    """What tells one window's jobs from another's: their count and the sum of their completion
    times (from the index on completed_at, without reading the rows), and the count of changes
    to any job (store's jobs_changes): a job's conclusion corrected in place changes neither."""
    return tuple(conn.execute("SELECT count(*), total(completed_at), "
                              "(SELECT n FROM jobs_changes) FROM jobs "
                              "WHERE completed_at >= ?", (since,)).fetchone())


def _analytics_figures(conn: sqlite3.Connection, since: float,
                       kept: tuple[_Mark, dict[str, Any]] | None
                       ) -> tuple[_Mark, dict[str, Any]]:
    mark = _window_mark(conn, since)
    if kept is not None and kept[0] == mark:
        return kept
    # One pass over the window's rows, keeping only those the browser figures may count: no
    # list of every row (one costs the garbage collector a quarter of a second a pass).
    candidates: list[dict[str, Any]] = []

    def rows() -> Iterator[dict[str, Any]]:
        for row in _window_stream(conn, since):
            if analytics.may_be_browser_test(row):
                candidates.append(row)
            yield row

    repos = analytics.per_repo(rows())
    try:
        return mark, {"repos": repos, "browser_test": analytics.browser_test(candidates)}
    finally:
        _release(candidates)


def _repo_detail(conn: sqlite3.Connection, name: str, since: float
                 ) -> tuple[int, dict[str, Any]]:
    rows = list(_window_stream(conn, since, name))  # 30 days of one repository
    try:
        return len(rows), analytics.repo_detail(name, rows)
    finally:
        _release(rows)


_REPLAYED = ("SELECT job_id, created_at, started_at, completed_at FROM jobs WHERE repo = ? AND "
             "completed_at >= ? AND runner IS NOT NULL AND created_at IS NOT NULL AND "
             "started_at IS NOT NULL AND status = 'completed'")


def _replay(conn: sqlite3.Connection, repo: str, since: float, counts: list[int],
            slo: int) -> tuple[bool, dict[str, Any] | None]:
    """(self-hosted jobs only, the replay's figures; None without jobs). The database sorts the
    jobs by arrival and keeps those that asked for a self-hosted runner when there are any."""
    conn.create_function("self_hosted", 1, self_hosted, deterministic=True)
    hosted = conn.execute(f"SELECT EXISTS ({_REPLAYED} AND self_hosted(labels))",
                          (repo, since)).fetchone()[0] == 1
    order = " ORDER BY created_at, job_id"
    cursor = conn.execute(_REPLAYED + (" AND self_hosted(labels)" if hosted else "") + order,
                          (repo, since))
    trace = Trace.from_ordered(cursor)
    return hosted, compare(trace, counts, slo) if trace.arrivals else None


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
        self._kept: dict[int, tuple[_Mark, dict[str, Any]]] = {}  # window -> figures

    # --- analytics and repository detail -------------------------------------------------------

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
        window = window_days(days)
        return await self._shared(("analytics", window), lambda: self._analytics(window))

    async def _analytics(self, days: int) -> dict[str, Any]:
        until = self.plane.clock()
        since = until - days * DAY
        kept = await self.plane.db.read_in_thread(_analytics_figures, since, self._kept.get(days))
        self._kept[days] = kept
        figures = kept[1]
        return {"generated_at": iso(until), "days": days, "since": iso(since), "until": iso(until),
                **figures,
                "history": await history.status(self.plane.db, self.plane.watched_repos())}

    async def repo(self, name: str) -> dict[str, Any]:
        return await self._shared(("repo", name), lambda: self._repo(name))

    async def _repo(self, name: str) -> dict[str, Any]:
        until = self.plane.clock()
        found, detail = await self.plane.db.read_in_thread(_repo_detail, name,
                                                           until - REPO_DAYS * DAY)
        if not found and name not in self.plane.watched_repos():
            raise NotFound(f"no job history for {name}: it is not a watched repository "
                           "(no runner here or on an agent serves it; see FLEET_WATCH_REPOS)")
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
            # In a worker thread: a file of 512 KiB may hold 14,000 jobs to judge.
            out += await asyncio.to_thread(workflows.findings, repo, flows,
                                           data.runners if data else None)
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
        async with self._simulating:  # one replay at a time: CPU is the runners' first
            hosted, result = await self.plane.db.read_in_thread(
                _replay, repo, until - days * DAY, counts, slo)
        if result is None:
            raise NotFound(f"no recorded jobs of {repo} in the last {days} days to replay")
        return {"generated_at": iso(until), "repo": repo, "days": days,
                "since": iso(until - days * DAY), "self_hosted_only": hosted, **result}

    # --- admission and billing -------------------------------------------------------------

    async def admission(self, limit: int) -> dict[str, Any]:
        await self.admission_log.ingest(self.plane.clock())
        return {"generated_at": iso(self.plane.clock()), **await self.admission_log.report(limit)}

    async def billing(self) -> dict[str, Any]:
        owners = [repo.split("/", 1)[0] for repo in self.plane.watched_repos()]
        return {"generated_at": iso(self.plane.clock()),
                **await self.billing_source.snapshot(owners)}

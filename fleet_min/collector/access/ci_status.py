"""Commit statuses for jobs that name `report_to.ci_status` ("owner/repo@sha").

A job event after commit drives it: `claimed` posts `pending`, `done`/`failed`/`cancelled` post
`success`/`failure`/`error`. Posting is armed only when a token is set; otherwise each status is
recorded as a dry run. Every attempt (dry runs included) is a row in ci_statuses. A 5xx, a 429
or a network failure is retried with backoff; anything else is final. The token is sent in the
Authorization header and nowhere else: never logged, never stored, never in an error text.

Statuses go only to the repositories of FLEET_CI_STATUS_REPOS (DESIGN rule 5a: anyone who can
reach POST /jobs could otherwise make the collector post with its token to any repository the
token reaches). With the list set, POST /jobs refuses other targets (check_spec) and the reporter
checks again before posting; with a token and no list nothing is posted, and each status is
recorded with the reason instead. Without a token and without a list, dry runs are recorded as
before.

Host and device jobs report alike (the spec names host jobs; the original collector's clients
send it on device jobs too). A fan-out reports once, under its parent (see _reports_for).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from fleet_min import jsonio
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.jobs.kinds import JobStatus
from fleet_min.config import CollectorConfig
from fleet_min.db import Database
from fleet_min.errors import BadRequest, NotFound
from fleet_min.timeutil import iso, now

log = logging.getLogger("fleet_min.collector.ci_status")

# The commit status each final job status posts.
TERMINAL: dict[str, str] = {JobStatus.DONE: "success", JobStatus.FAILED: "failure",
                            JobStatus.CANCELLED: "error"}
BACKOFF_S = (0.5, 2.0, 8.0)  # waits before the 2nd, 3rd and 4th attempt
TIMEOUT_S = 10.0
MAX_DESCRIPTION = 140  # GitHub's limit

Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None]"]


REPOS_SETTING = "FLEET_CI_STATUS_REPOS"
NO_LIST = (f"{REPOS_SETTING} is not set, so no commit status is posted with this collector's "
           "token; list the repositories (owner/repo) or owners (owner/*) statuses may go to")


@dataclass(frozen=True)
class CiSettings:
    api: str
    token: str | None
    repos: tuple[str, ...] | None = None  # FLEET_CI_STATUS_REPOS; None: unset

    @property
    def armed(self) -> bool:
        return self.token is not None

    @property
    def problem(self) -> str | None:
        """Why nothing is posted although a token is set (None: nothing stands in the way)."""
        return NO_LIST if self.armed and self.repos is None else None

    def allows(self, target: str) -> bool:
        """Is "owner/repo@sha" inside the list (case-insensitively, as GitHub names compare)?
        Always False without a list, and for the path segments `.` and `..`."""
        owner, repo, _sha = parse_target(target.lower())
        if self.repos is None or {owner, repo} & {"", ".", ".."}:
            return False
        return f"{owner}/{repo}" in self.repos or f"{owner}/*" in self.repos

    def refusal(self, target: str) -> str | None:
        """Why a status for this target is not posted (None: it is posted, or recorded as a dry
        run without a token)."""
        if self.repos is not None and not self.allows(target):
            return f"not sent: {_repo(target)} is not in {REPOS_SETTING}"
        return f"not sent: {NO_LIST}" if self.problem else None

    def describe(self) -> dict[str, Any]:
        """The `ci_status` block of GET /api/system."""
        return {"armed": self.armed, "repos": list(self.repos) if self.repos is not None else None,
                "posting": self.armed and self.repos is not None, "problem": self.problem}


def settings(config: CollectorConfig) -> CiSettings:
    """FLEET_GITHUB_API, FLEET_CI_STATUS_TOKEN (falling back to GITHUB_TOKEN) and
    FLEET_CI_STATUS_REPOS (already checked and lower-cased by config.py)."""
    api = str(config.github_api or "https://api.github.com")
    token = str(config.ci_status_token).strip() or str(config.github_token).strip()
    repos = tuple(config.ci_status_repos) or None
    return CiSettings(api.rstrip("/"), token or None, repos)


def check_spec(settings: CiSettings, spec: Mapping[str, Any]) -> None:
    """Refuse (400) a job whose report_to.ci_status names a repository outside the list, when a
    list is set: a status only to an allowed repository (DESIGN rule 5a)."""
    report = spec.get("report_to")
    if settings.repos is None or not isinstance(report, dict):
        return
    # Both spellings: a spec may be checked before its aliases are resolved (compat.py).
    for target in (report.get("ci_status"), report.get("github_status")):
        if isinstance(target, str) and not settings.allows(target):
            raise _outside_list(target)


def _outside_list(target: str) -> BadRequest:
    return BadRequest(f"report_to.ci_status names {_repo(target)}, which is not in this "
                     f"collector's {REPOS_SETTING}; add it there (owner/repo or owner/*) or "
                     "leave report_to out")


def parse_target(target: str) -> tuple[str, str, str]:
    """"owner/repo@sha" -> (owner, repo, sha); the job validator already checked the form."""
    repo_part, _, sha = target.rpartition("@")
    owner, _, repo = repo_part.partition("/")
    return owner, repo, sha


def _repo(target: str) -> str:
    owner, repo, _sha = parse_target(target)
    return f"{owner}/{repo}"


def statuses_url(api: str, target: str) -> str:
    owner, repo, sha = parse_target(target)
    if {owner, repo} & {"", ".", ".."}:
        raise ValueError(f"{target!r} names no repository")  # allows() keeps these out
    repo_path = f"{quote(owner, safe='')}/{quote(repo, safe='')}"
    return f"{api.rstrip('/')}/repos/{repo_path}/statuses/{quote(sha, safe='')}"


def describe(state: str, workload: str, error: str | None = None) -> str:
    """The one short sentence GitHub shows next to the check."""
    text = {
        "pending": f"{workload} is running on the device fleet.",
        "success": f"{workload} passed on the device fleet.",
        "failure": f"{workload} failed: {error}" if error else f"{workload} failed.",
        "error": f"{workload} was cancelled before it finished.",
    }[state]
    return text if len(text) <= MAX_DESCRIPTION else text[:MAX_DESCRIPTION - 1] + "\u2026"


def _record(conn: sqlite3.Connection, job_id: str, target: str, state: str, description: str,
            dry_run: bool, http_status: int | None, error: str | None) -> None:
    conn.execute(
        "INSERT INTO ci_statuses (job_id, target, state, description, at, dry_run, "
        "http_status, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (job_id, target, state, description, now(), int(dry_run), http_status, error))


@dataclass(frozen=True)
class Report:
    job_id: str
    target: str
    state: str
    workload: str
    description: str


# What a job's status report reads of it (and of its parent, for a fan-out's child), for many
# jobs at once. The target is taken out in SQL: most jobs have none, and their specs are never
# parsed in Python.
_REPORTING_JOBS = ("SELECT job_id, workload, parent_job_id, "
                   "json_extract(spec, '$.report_to.ci_status') AS target FROM jobs "
                   "WHERE job_id IN ({marks})")
_IDS_A_READ = 500  # well under SQLite's smallest limit on a statement's parameters

JobEvent = tuple[str, str, str | None]  # job id, status, error


class CiReporter:
    """Listens to job events and posts commit statuses, one job's statuses strictly in order."""

    def __init__(self, db: Database, settings: CiSettings, spawn: Spawn) -> None:
        self.db = db
        self.settings = settings
        self._spawn = spawn
        self._session: aiohttp.ClientSession | None = None
        self._chains: dict[str, asyncio.Task[None]] = {}  # last report task per job
        self._latest: dict[str, str] = {}  # last state asked for per job (dedupes `pending`)
        self._inbox: asyncio.Queue[JobEvent] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        # The jobs of the transaction being applied that post no status (Effects.no_ci_target):
        # set before its events arrive, replaced by the next transaction's.
        self._quiet: frozenset[str] = frozenset()

    def health(self) -> dict[str, Any]:
        return {"ci_status_armed": self.settings.armed}

    def announce(self) -> None:
        """One line at start when a token is set but statuses cannot be posted."""
        if self.settings.problem:
            log.warning("commit statuses: %s", self.settings.problem)

    async def close(self) -> None:
        tasks = [*self._chains.values(), *([self._worker] if self._worker else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def on_applied(self, effects: Effects) -> None:
        """Service hook, run after each commit just before its events reach on_event."""
        self._quiet = frozenset(effects.no_ci_target)

    def on_event(self, event: dict[str, Any]) -> None:
        """Service listener: runs after commit and must not block, so it only queues the event.

        One worker resolves events in the order they happened, so a job's `pending` can never
        be queued behind its terminal status.
        """
        if event.get("type") != "job":
            return
        status = event.get("status")
        if status != JobStatus.CLAIMED and status not in TERMINAL:
            return
        if event["job_id"] in self._quiet:
            return
        error = event.get("last_error")
        self._inbox.put_nowait((str(event["job_id"]), str(status),
                                error if isinstance(error, str) else None))
        if self._worker is None or self._worker.done():
            self._worker = self._spawn(self._work(), "ci-status")

    async def _work(self) -> None:
        while not self._inbox.empty():
            # Every event queued so far is prepared with one read (two for fan-out children):
            # events that arrive together share the reads instead of paying one each.
            batch: list[JobEvent] = []
            while not self._inbox.empty():
                batch.append(self._inbox.get_nowait())
            try:
                reports = await self._reports_for(batch)
            except Exception:
                log.exception("CI statuses for %d job events could not be prepared", len(batch))
                continue
            for report in reports:
                self._queue(report)

    async def _reports_for(self, batch: list[JobEvent]) -> list[Report]:
        """The statuses these events post, in their order. A fan-out reports once, as its
        parent: the first child's claim posts the parent's `pending`, and the parent's own
        close its terminal state; a child's close posts nothing (children share the commit and
        the context, so each would overwrite the others)."""
        rows = await self._reporting_rows({job_id for job_id, _, _ in batch})
        parents = {row["parent_job_id"] for row in rows.values() if row["parent_job_id"]}
        if unread := parents - rows.keys():
            rows.update(await self._reporting_rows(unread))
        reports = []
        for job_id, status, error in batch:
            row = rows.get(job_id)
            if row is not None and row["parent_job_id"]:
                row = rows.get(row["parent_job_id"]) if status == JobStatus.CLAIMED else None
            if row is None or not isinstance(row["target"], str) or not row["target"]:
                continue
            state = "pending" if status == JobStatus.CLAIMED else TERMINAL[status]
            reports.append(Report(row["job_id"], row["target"], state, row["workload"],
                                  describe(state, row["workload"], error)))
        return reports

    async def _reporting_rows(self, job_ids: set[str]) -> dict[str, Any]:
        ids = sorted(job_ids)
        rows: dict[str, Any] = {}
        for start in range(0, len(ids), _IDS_A_READ):
            chunk = ids[start:start + _IDS_A_READ]
            sql = _REPORTING_JOBS.format(marks=",".join("?" * len(chunk)))
            rows.update((row["job_id"], row) for row in await self.db.read(sql, chunk))
        return rows

    def _queue(self, report: Report) -> None:
        if report.state == "pending" and self._latest.get(report.job_id) == "pending":
            return  # a re-claim after a lapsed lease: the commit already shows pending
        self._latest[report.job_id] = report.state
        previous = self._chains.get(report.job_id)
        task = self._spawn(self._deliver(report, previous), f"ci-status-post-{report.job_id}")
        self._chains[report.job_id] = task
        task.add_done_callback(lambda done: self._forget(report, done))

    def _forget(self, report: Report, task: asyncio.Task[None]) -> None:
        if self._chains.get(report.job_id) is task:
            del self._chains[report.job_id]
            if report.state != "pending":
                self._latest.pop(report.job_id, None)

    async def _deliver(self, report: Report, previous: asyncio.Task[None] | None) -> None:
        if previous is not None:
            await asyncio.wait({previous})  # keep one job's statuses in the order they happened
        refusal = self.settings.refusal(report.target)
        if refusal is not None:  # checked here too: jobs enqueued before the list was set
            if self.settings.repos is not None:  # an unset list was said once, at start
                log.warning("CI status %s for %s %s", report.state, report.job_id, refusal)
            await self.db.write(_record, report.job_id, report.target, report.state,
                                report.description, not self.settings.armed, None, refusal)
            return
        if not self.settings.armed:
            log.info("CI status (dry run, no token): %s %s for %s", report.target, report.state,
                     report.job_id)
            await self.db.write(_record, report.job_id, report.target, report.state,
                                report.description, True, None, None)
            return
        for attempt, delay in enumerate((0.0, *BACKOFF_S)):
            if delay:
                await asyncio.sleep(delay)
            if report.state == "pending" and self._latest.get(report.job_id) != "pending":
                return  # the job already closed: its terminal status follows, pending is moot
            http_status, error = await self._post(report)
            await self.db.write(_record, report.job_id, report.target, report.state,
                                report.description, False, http_status, error)
            retry = http_status is None or http_status >= 500 or http_status == 429
            if not retry:
                return
            log.warning("CI status for %s (%s) attempt %d: %s", report.job_id, report.state,
                        attempt + 1, error)

    async def _post(self, report: Report) -> tuple[int | None, str | None]:
        """One POST to the statuses API: (HTTP status or None, error sentence or None)."""
        body = {"state": report.state, "context": f"fleet-min/{report.workload}",
                "description": report.description}
        headers = {"Authorization": f"Bearer {self.settings.token}",
                   "Accept": "application/vnd.github+json",
                   "X-GitHub-Api-Version": "2022-11-28", "User-Agent": "fleet-min-collector"}
        try:
            async with self._client().post(statuses_url(self.settings.api, report.target),
                                           json=body, headers=headers,
                                           allow_redirects=False) as resp:
                if resp.status < 300:
                    return resp.status, None
                text = (await resp.content.read(2048)).decode("utf-8", "replace")
                return resp.status, _api_error(resp.status, text)
        except TimeoutError:
            return None, f"the statuses API did not answer within {TIMEOUT_S:g} s"
        except aiohttp.ClientError as exc:
            return None, f"the statuses API could not be reached ({type(exc).__name__})"

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=TIMEOUT_S), trust_env=True)
        return self._session


def _api_error(status: int, text: str) -> str:
    try:
        message = jsonio.loads_foreign(text).get("message")
    except (ValueError, AttributeError):  # any answer: a proxy's page, a truncation
        message = None
    detail = message if isinstance(message, str) and message else text.strip()[:200]
    # A JSON escape can carry a lone surrogate, which no UTF-8 column can store.
    detail = detail.encode("utf-8", "replace").decode("utf-8")
    return f"the statuses API answered {status}" + (f": {detail}" if detail else "")


async def statuses(db: Database, job_id: str, armed: bool) -> dict[str, Any]:
    """GET /api/jobs/{id}/ci-status: the job's target and every recorded attempt."""
    row = await db.read_one("SELECT spec FROM jobs WHERE job_id = ?", (job_id,))
    if row is None:
        raise NotFound(f"no job {job_id!r}")
    target = (json.loads(row["spec"]).get("report_to") or {}).get("ci_status")
    rows = await db.read("SELECT * FROM ci_statuses WHERE job_id = ? ORDER BY id", (job_id,))
    return {"job_id": job_id, "target": target, "armed": armed,
            "statuses": [{"id": r["id"], "state": r["state"], "description": r["description"],
                          "at": iso(r["at"]), "dry_run": bool(r["dry_run"]),
                          "http_status": r["http_status"], "error": r["error"]}
                         for r in rows]}


REPORTS_LIMIT = 200  # newest rows GET /status-reports answers


async def recent_reports(db: Database) -> list[dict[str, Any]]:
    """GET /status-reports, the original's listing: every job's recorded statuses, newest
    first, a bare array. `posted` is 1 when the statuses API accepted it (0 for a dry run or a
    refusal) and `detail` says which, as the original's dashboard shows them."""
    rows = await db.read("SELECT * FROM ci_statuses ORDER BY id DESC LIMIT ?", (REPORTS_LIMIT,))
    return [_report(r) for r in rows]


def _report(row: Any) -> dict[str, Any]:
    accepted = not row["dry_run"] and row["http_status"] is not None and \
        200 <= row["http_status"] < 300
    if row["dry_run"]:
        detail = "dry run: CI status posting is not armed on this collector"
    elif row["error"]:
        detail = str(row["error"])
    else:
        detail = f"posted (the statuses API answered {row['http_status']})"
    return {"id": row["id"], "job_id": row["job_id"], "target": row["target"],
            "state": row["state"], "description": row["description"], "at": iso(row["at"]),
            "posted": 1 if accepted else 0, "detail": detail, "dry_run": bool(row["dry_run"])}

"""A small GitHub REST client: runners, registration/removal tokens, workflow runs and jobs.

Conditional requests with ETags (a 304 costs no rate limit and no parsing), Link-header
pagination that never follows a link off the API's own origin, retries with back-off on 5xx and
connection errors, and the rate-limit state kept for the snapshot. The token comes from
GH_TOKEN / GITHUB_TOKEN or `gh auth token`; it is only ever sent to the configured API base.

Whatever answers at that base is not trusted to be GitHub: bodies are capped in size, JSON too
deep to parse is an error, a listing of another shape is an error, and each item is reduced to
the fields and types the rest of the control plane expects (ids SQLite can hold, text without
lone surrogates and of bounded length, labels as lists of strings that fit the same rule as an
agent's) before it leaves this module.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
from collections import Counter
from itertools import islice
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp

from fleet_min import jsonio
from fleet_min.controlplane.labels import fit_labels
from fleet_min.controlplane.runners.discovery import valid_repo
from fleet_min.http import link_url, read_within
from fleet_min.timeutil import iso

log = logging.getLogger(__name__)

RETRIES = 3
MAX_PAGES = 10
# GitHub's largest answers (100 workflow runs, a workflow file) are a few MB. Past this the
# answer is refused rather than read on into memory (a hostile or broken server can send an
# endless body; the request deadline alone would let it fill hundreds of MB first).
MAX_BODY_BYTES = 16 * 1024 * 1024
# Answers kept for conditional requests. Each run's jobs are a URL of their own, fetched once
# by the history and then never again: kept forever they would grow the daemon without end.
# Least recently used go first; what is polled every round (listings) stays.
ETAG_ENTRIES = 4096
# ... and at most this much memory as _footprint estimates it: a count alone did not bound it,
# as each answer may be 16 MiB and 16.5 MB of `{}` parse into 350 MB. A page of 50 workflow runs
# comes to about 4 MiB, so this holds the listings of a round over a dozen repositories. One
# answer may take a quarter of it (100 runs, GitHub's largest page, are about 7 MiB); a larger
# one is not kept, and is asked for in full each time.
ETAG_BYTES = 64 * 1024 * 1024
# The most memory one answer may parse into, as _footprint estimates it before parsing. GitHub's
# largest page (100 runs) is about 7 MiB of it; 16 MiB of `{},` would be 540 MB for a moment
# (every object a dict), past any bound applied to the records made afterwards.
MAX_ANSWER_FOOTPRINT = 64 * 1024 * 1024
# How many items of each list become records. GitHub sends at most `per_page` (at most 100) on
# a page, MAX_PAGES pages make a listing, a job has at most about 1,000 steps and a run at most
# 256 matrix jobs per attempt. Past these the answer is not GitHub's, and the rest is dropped:
# a 16 MiB page holds a million bare {"id": n} runs (a jobs request each) or 5.5 million empty
# steps (a five-field record each: 2 GB, and a 451 MB snapshot every tick).
PER_PAGE = 100
RUNS_PER_PAGE = 50  # the runs in flight are listed 50 to a page for each status
MAX_LISTED = MAX_PAGES * PER_PAGE  # runners of a repository, jobs of a run (all attempts)
MAX_STEPS_PER_JOB = 1000
# All of a run's jobs together: a 256-job matrix of 50 steps is 12,800. Without it, ten pages
# of 100 jobs of 1,000 empty steps (3 MB over ten answers) would still make a million records.
MAX_STEPS_PER_RUN = 25_000
# Every string kept from an answer (names, statuses, branches, paths, times) is cut to this many
# characters. GitHub's own are far shorter: run and job names, workflow paths and branch names
# (at most 255 bytes) all fit, and so does a run's html_url. Uncut, 50 runs in flight whose run
# name, job name and one label came to 300 KB each made a 143 MB snapshot (1.3 GB resident,
# stalling the event loop for each stream client); the history held every listed run's name.
MAX_TEXT = 500
MAX_ID = 2**63 - 1  # the largest INTEGER SQLite stores; GitHub's ids are far below it
_LINK_NEXT = re.compile(r'<([^<>]+)>;\s*rel="next"')  # no '<' inside: linear on any header
_OWNER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_SURROGATE = re.compile("[\ud800-\udfff]")  # only lone ones survive json.loads
_CONTROL = re.compile("[\x00-\x1f\x7f]+")


class GitHubError(Exception):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def find_token(environ: dict[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    for name in ("GH_TOKEN", "GITHUB_TOKEN"):
        if env.get(name):
            return env[name].strip()
    try:
        out = subprocess.run(["gh", "auth", "token"], capture_output=True, text=True,
                             timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _repo_path(repo: str) -> str:
    # Repository names reach URL paths only after this check, so input cannot add segments.
    if not valid_repo(repo):
        raise GitHubError(f"{repo!r} is not an owner/repo name")
    owner, _, name = repo.partition("/")
    return f"/repos/{quote(owner)}/{quote(name)}"


class GitHub:
    def __init__(self, base: str, token: str | None, timeout_s: float = 20.0,
                 backoff_s: float = 0.5, etag_entries: int = ETAG_ENTRIES,
                 etag_bytes: int = ETAG_BYTES) -> None:
        self.base = base.rstrip("/")
        self.origin = urlsplit(self.base)._replace(path="", query="", fragment="").geturl()
        self.token = token
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.backoff_s = backoff_s
        self.rate: dict[str, Any] = {}
        self.requests = 0
        self.not_modified = 0
        # Answers by status class ("2xx" ... "5xx"), and "unreachable" for an attempt that got
        # none (a connection error, a timeout): GET /metrics reads them.
        self.answers: Counter[str] = Counter()
        # url -> (ETag, body, next-page URL, footprint), in order of last use
        self._etags: dict[str, tuple[str, Any, str | None, int]] = {}
        self._etag_held = 0  # the footprints of the answers kept
        self.etag_entries = etag_entries
        self.etag_bytes = etag_bytes
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/vnd.github+json", "X-GitHub-Api-Version": "2022-11-28",
                   "User-Agent": "fleet-min-controlplane"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def _note_rate(self, headers: Any) -> None:
        try:
            if "X-RateLimit-Remaining" in headers:
                self.rate = {"limit": int(headers.get("X-RateLimit-Limit", 0)),
                             "remaining": int(headers["X-RateLimit-Remaining"]),
                             "used": int(headers.get("X-RateLimit-Used", 0)),
                             "reset_at": iso(float(headers.get("X-RateLimit-Reset", 0)))}
        # Not a number, or a time no clock can show: gmtime says OverflowError past the C
        # time_t and OSError (EOVERFLOW) past the years the C library can format.
        except (ValueError, OverflowError, OSError):
            pass

    async def request(self, method: str, url: str, *, conditional: bool = False
                      ) -> tuple[Any, str | None]:
        """(JSON body, next-page URL); GET with conditional=True uses and fills the ETag cache."""
        if not url.startswith(self.origin + "/"):
            raise GitHubError(f"refusing to send the token to {urlsplit(url).netloc}")
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        last_error = "no attempt"
        for attempt in range(RETRIES):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            headers = self._headers()
            cached = self._etags.get(url) if conditional else None
            if cached:
                headers["If-None-Match"] = cached[0]
            answered = False
            try:
                async with self._session.request(method, url, headers=headers) as resp:
                    answered = True
                    if not str(resp.url).startswith(self.origin + "/"):
                        # Followed a redirect to another origin: aiohttp drops the token on
                        # the way, but the answer (runners, a registration token handed to
                        # config.sh) came from a host that is not the API.
                        raise GitHubError(f"GitHub's answer was redirected to "
                                          f"{resp.url.host}; only answers from "
                                          f"{self.origin} are taken")
                    self.requests += 1
                    self.answers[f"{resp.status // 100}xx"] += 1
                    self._note_rate(resp.headers)
                    if resp.status == 304 and cached:
                        self.not_modified += 1
                        self._remember(url, cached)
                        return cached[1], cached[2]
                    if resp.status >= 500:
                        last_error = f"GitHub answered {resp.status}"
                        continue
                    raw = await read_within(resp, MAX_BODY_BYTES, GitHubError(
                        f"GitHub's answer is larger than {MAX_BODY_BYTES} bytes"))
                    if resp.status >= 400:
                        # A refusal keeps its status even when its body is not JSON (a proxy's
                        # HTML page): callers decide on 403/404, and retrying will not help.
                        raise GitHubError(self._refusal(resp.status, _error_body(raw)),
                                          resp.status)
                    footprint = _footprint(raw)
                    if footprint > MAX_ANSWER_FOOTPRINT:
                        raise GitHubError(
                            f"GitHub's answer ({len(raw)} bytes) is too dense to parse: about "
                            f"{footprint >> 20} MiB of objects, past the "
                            f"{MAX_ANSWER_FOOTPRINT >> 20} MiB one answer may take")
                    body = _decode(raw)
                    found = _LINK_NEXT.search(resp.headers.get("Link", ""))
                    nxt = found.group(1) if found else None
                    if conditional and resp.headers.get("ETag"):
                        self._remember(url, (resp.headers["ETag"], body, nxt, footprint))
                    return body, nxt
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                last_error = f"GitHub could not be reached ({type(exc).__name__})"
                if not answered:
                    self.answers["unreachable"] += 1
        raise GitHubError(f"{last_error} after {RETRIES} attempts")

    def _remember(self, url: str, entry: tuple[str, Any, str | None, int]) -> None:
        """Keep `entry` as the most recently used answer; the least recently used go past
        `etag_entries` answers or `etag_bytes` of footprint. An answer larger than a quarter of
        that is not kept, and the URL's older answer is let go with it."""
        old = self._etags.pop(url, None)
        if old is not None:
            self._etag_held -= old[3]
        if entry[3] > self.etag_bytes // 4:
            return
        self._etags[url] = entry
        self._etag_held += entry[3]
        while len(self._etags) > self.etag_entries or self._etag_held > self.etag_bytes:
            self._etag_held -= self._etags.pop(next(iter(self._etags)))[3]

    def _refusal(self, status: int, body: Any) -> str:
        # The message ends up in logs, the snapshot and SQLite: one line, encodable, short.
        message = _text(body.get("message")) if isinstance(body, dict) else None
        message = _CONTROL.sub(" ", message)[:300] if message else None
        if status in (403, 429) and self.rate.get("remaining") == 0:
            return f"GitHub's rate limit is used up until {self.rate.get('reset_at')}"
        if status == 401:
            return "GitHub refused the token (set GH_TOKEN to a token with repo admin rights)"
        return f"GitHub answered {status}: {message or 'no message'}"

    async def get_all(self, path: str, key: str, params: str = "") -> list[Any]:
        """Every page of a listing: at most MAX_PAGES pages of PER_PAGE items."""
        url: str | None = f"{self.base}{path}?per_page={PER_PAGE}{params}"
        items: list[Any] = []
        visited: set[str] = set()
        for _ in range(MAX_PAGES):
            if url is None or url in visited:  # a next link back to a page read: the end
                break
            visited.add(url)
            body, url = await self.request("GET", url, conditional=True)
            items.extend(_items(body, key, PER_PAGE))
        return items

    async def runners(self, repo: str) -> list[dict[str, Any]]:
        """At most MAX_LISTED: MAX_PAGES pages of PER_PAGE."""
        raw = await self.get_all(f"{_repo_path(repo)}/actions/runners", "runners")
        out = []
        for r in raw:
            entries = [label for label in _list(r.get("labels")) if isinstance(label, dict)]
            labels = _labels([label.get("name") for label in entries])
            # The custom ones by the same rule, less any past where all of them were cut off
            # (a custom label is never further along its own list than along all of them).
            custom = _labels([label.get("name") for label in entries
                              if label.get("type") == "custom"])
            kept = set(labels)
            out.append({"id": r["id"], "name": _text(r.get("name")),
                        "status": _text(r.get("status")), "busy": r.get("busy") is True,
                        "os": _text(r.get("os")), "labels": labels,
                        "custom_labels": [label for label in custom if label in kept]})
        return out

    async def runs(self, repo: str, status: str, pages: int = 1) -> list[dict[str, Any]]:
        url = (f"{self.base}{_repo_path(repo)}/actions/runs?per_page={RUNS_PER_PAGE}"
               f"&status={quote(status)}")
        body, _ = await self.request("GET", url, conditional=True)
        return [{"id": r["id"], "repo": repo, "name": _text(r.get("name")),
                 "status": _text(r.get("status")), "conclusion": _text(r.get("conclusion")),
                 "event": _text(r.get("event")), "branch": _text(r.get("head_branch")),
                 "created_at": _text(r.get("created_at")),
                 "started_at": _text(r.get("run_started_at")),
                 "url": _url(r.get("html_url"))}
                for r in _items(body, "workflow_runs", RUNS_PER_PAGE)]

    async def jobs(self, repo: str, run_id: int, all_attempts: bool = False
                   ) -> list[dict[str, Any]]:
        """The run's jobs (of every attempt with all_attempts) with their steps: at most
        MAX_LISTED jobs, MAX_STEPS_PER_JOB steps each and MAX_STEPS_PER_RUN in all (the jobs
        past that keep their other fields, with no steps)."""
        raw = await self.get_all(f"{_repo_path(repo)}/actions/runs/{int(run_id)}/jobs", "jobs",
                                 "&filter=all" if all_attempts else "")
        jobs = []
        steps_left = MAX_STEPS_PER_RUN
        for j in raw:
            if _id(j.get("run_id")) is None:  # a job names its run
                continue
            steps = _steps(j.get("steps"), min(MAX_STEPS_PER_JOB, steps_left))
            steps_left -= len(steps)
            jobs.append({"id": j["id"], "run_id": _id(j.get("run_id")), "repo": repo,
                         "name": _text(j.get("name")), "workflow": _text(j.get("workflow_name")),
                         "status": _text(j.get("status")),
                         "conclusion": _text(j.get("conclusion")),
                         "runner": _text(j.get("runner_name")),
                         "labels": _labels(j.get("labels")),
                         "created_at": _text(j.get("created_at")),
                         "started_at": _text(j.get("started_at")),
                         "completed_at": _text(j.get("completed_at")),
                         "run_attempt": _id(j.get("run_attempt")),
                         "head_branch": _text(j.get("head_branch")), "steps": steps})
        return jobs

    async def completed_runs(self, repo: str, created: str, page: int
                             ) -> tuple[list[dict[str, Any]], int, bool]:
        """One page (100) of completed runs created in `created` (GitHub's search range
        syntax, e.g. 2026-01-01T00:00:00Z..2026-01-01T23:59:59Z): (runs, total_count, more)."""
        url = (f"{self.base}{_repo_path(repo)}/actions/runs?per_page=100&status=completed"
               f"&created={quote(created, safe='')}&page={int(page)}")
        body, nxt = await self.request("GET", url, conditional=True)
        # A listing of another shape is an error, not "no runs": the history would take it
        # for a window with nothing in it and never list that window again.
        runs = [{"id": r["id"], "repo": repo, "name": _text(r.get("name")),
                 "path": _text(r.get("path")), "run_attempt": _id(r.get("run_attempt")) or 1,
                 "event": _text(r.get("event")), "branch": _text(r.get("head_branch")),
                 "status": _text(r.get("status")), "conclusion": _text(r.get("conclusion")),
                 "created_at": _text(r.get("created_at")),
                 "updated_at": _text(r.get("updated_at"))}
                for r in _items(body, "workflow_runs", PER_PAGE)]
        total = body.get("total_count")
        counted = isinstance(total, int) and not isinstance(total, bool)
        return runs, total if counted else len(runs), nxt is not None

    async def repository(self, repo: str) -> dict[str, Any]:
        body, _ = await self.request("GET", f"{self.base}{_repo_path(repo)}", conditional=True)
        return body if isinstance(body, dict) else {}

    async def contents(self, repo: str, path: str, ref: str) -> Any:
        """The contents API: a list for a directory, an object (base64 content) for a file."""
        parts = path.split("/")
        if any(p in ("", ".", "..") for p in parts) or "\\" in path:
            raise GitHubError(f"{path!r} is not a plain repository path")
        url = (f"{self.base}{_repo_path(repo)}/contents/{quote(path, safe='/')}"
               f"?ref={quote(ref, safe='')}")
        body, _ = await self.request("GET", url, conditional=True)
        return body

    async def account_type(self, owner: str) -> str | None:
        """"User" or "Organization"."""
        _check_owner(owner)
        body, _ = await self.request("GET", f"{self.base}/users/{quote(owner, safe='')}",
                                     conditional=True)
        kind = body.get("type") if isinstance(body, dict) else None
        return kind if isinstance(kind, str) else None

    async def actions_billing(self, owner: str, organization: bool) -> dict[str, Any]:
        _check_owner(owner)
        scope = "orgs" if organization else "users"
        body, _ = await self.request(
            "GET", f"{self.base}/{scope}/{quote(owner, safe='')}/settings/billing/actions",
            conditional=True)
        return body if isinstance(body, dict) else {}

    async def _token(self, repo: str, kind: str) -> str:
        body, _ = await self.request("POST", f"{self.base}{_repo_path(repo)}/actions/runners/"
                                     f"{kind}-token")
        token = body.get("token") if isinstance(body, dict) else None
        # It reaches config.sh through the environment, which cannot carry a NUL or a lone
        # surrogate: the action would fail halfway, after the service was already stopped.
        if not isinstance(token, str) or not token or not token.isprintable():
            raise GitHubError(f"GitHub returned no usable {kind} token")
        return token

    async def registration_token(self, repo: str) -> str:
        return await self._token(repo, "registration")

    async def removal_token(self, repo: str) -> str:
        return await self._token(repo, "remove")

    def status(self) -> dict[str, Any]:
        return {"api": self.base, "token": bool(self.token), "rate_limit": self.rate or None,
                "requests": self.requests, "not_modified": self.not_modified}


def _check_owner(owner: str) -> None:
    if not _OWNER.fullmatch(owner):
        raise GitHubError(f"{owner!r} is not a GitHub account name")


def _steps(value: Any, limit: int) -> list[dict[str, Any]]:
    """The first `limit` steps of a job (objects only) as records."""
    found = (step for step in _list(value) if isinstance(step, dict))
    return [_step(step) for step in islice(found, max(limit, 0))]


def _step(step: dict[str, Any]) -> dict[str, Any]:
    return {"name": (_text(step.get("name")) or "")[:300], "number": _id(step.get("number")),
            "conclusion": _text(step.get("conclusion")),
            "started_at": _text(step.get("started_at")),
            "completed_at": _text(step.get("completed_at"))}


# --- reading what came back (pure; no trust in its size, depth or shape) ---------------------

def _decode(raw: bytes) -> Any:
    """An answer's JSON (None when empty); ValueError when it is not JSON. The parser recurses
    once per level of nesting, so depth is measured first (GitHub's answers nest a few levels;
    100,000 would be a RecursionError past every handler that expects a GitHubError)."""
    if not raw.strip():
        return None
    try:
        return jsonio.loads_foreign(raw)
    except jsonio.TooDeep as exc:
        raise GitHubError(f"GitHub's answer is {exc}") from None


def _footprint(raw: bytes) -> int:
    """About the memory json.loads builds from `raw`, erring high: its bytes, plus each object,
    array, string and item what an empty one costs. Measured, it is about twice the real size
    for answers shaped like GitHub's (a page of runs, jobs with steps) and 1.1 to 4 times it for
    answers made dense on purpose (a million `{}`, `[]`, short strings or numbers)."""
    return (len(raw) + 64 * (raw.count(b"{") + raw.count(b"["))
            + 32 * (raw.count(b'"') + raw.count(b",")))


def _error_body(raw: bytes) -> Any:
    try:
        return _decode(raw)
    except (ValueError, GitHubError):
        return None


def _items(body: Any, key: str, limit: int) -> list[dict[str, Any]]:
    """The first `limit` objects under `key` of a listing that carry a usable id. An answer of
    another shape is a GitHubError: taken as an empty listing it would read as "no runners" or
    "no runs"."""
    items = body.get(key) if isinstance(body, dict) else None
    if not isinstance(items, list):
        raise GitHubError(f"GitHub's answer has no {key!r} list")
    usable = (item for item in items if isinstance(item, dict) and _id(item.get("id")) is not None)
    return list(islice(usable, limit))


def _id(value: Any) -> int | None:
    """A positive integer SQLite can store (not a bool, a float or a string of digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_ID:
        return value
    return None


def _text(value: Any, limit: int = MAX_TEXT) -> str | None:
    """A string cut to `limit` characters, with any lone surrogate (JSON lets "\\ud800"
    through; UTF-8, so SQLite and log files, refuse it) replaced by U+FFFD; anything else is
    None."""
    return _SURROGATE.sub("\ufffd", value[:limit]) if isinstance(value, str) else None


def _url(value: Any) -> str | None:
    """A link to keep: whole or not at all (one cut short would lead somewhere else)."""
    return link_url(_text(value)) if isinstance(value, str) and len(value) <= MAX_TEXT else None


def _labels(value: Any) -> list[str]:
    """Label names (strings, not empty) as an agent's are kept: fit_labels' count and length
    rule, so a label from GitHub and the same label from an agent compare equal."""
    names = [name for name in _list(value) if isinstance(name, str) and name]
    return [label for label in map(_text, fit_labels(names)) if label is not None]


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []

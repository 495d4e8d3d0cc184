"""A small GitHub REST client: runners, registration/removal tokens, workflow runs and jobs.

Conditional requests with ETags (a 304 costs no rate limit and no parsing), Link-header
pagination that never follows a link off the API's own origin, retries with back-off on 5xx and
connection errors, and the rate-limit state kept for the snapshot. The token comes from
GH_TOKEN / GITHUB_TOKEN or `gh auth token`; it is only ever sent to the configured API base.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
from collections import Counter
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp

from fleet_min.controlplane.runners.discovery import valid_repo
from fleet_min.timeutil import iso

log = logging.getLogger(__name__)

RETRIES = 3
MAX_PAGES = 10
_LINK_NEXT = re.compile(r'<([^>]+)>;\s*rel="next"')
_OWNER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


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
                 backoff_s: float = 0.5) -> None:
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
        self._etags: dict[str, tuple[str, Any, str | None]] = {}
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
        except (ValueError, OverflowError):  # not a number, or a time no clock can show
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
                    self.requests += 1
                    self.answers[f"{resp.status // 100}xx"] += 1
                    self._note_rate(resp.headers)
                    if resp.status == 304 and cached:
                        self.not_modified += 1
                        return cached[1], cached[2]
                    if resp.status >= 500:
                        last_error = f"GitHub answered {resp.status}"
                        continue
                    body = await resp.json(content_type=None) if resp.content_length != 0 else None
                    if resp.status >= 400:
                        raise GitHubError(self._refusal(resp.status, body), resp.status)
                    found = _LINK_NEXT.search(resp.headers.get("Link", ""))
                    nxt = found.group(1) if found else None
                    if conditional and resp.headers.get("ETag"):
                        self._etags[url] = (resp.headers["ETag"], body, nxt)
                    return body, nxt
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                last_error = f"GitHub could not be reached ({type(exc).__name__})"
                if not answered:
                    self.answers["unreachable"] += 1
        raise GitHubError(f"{last_error} after {RETRIES} attempts")

    def _refusal(self, status: int, body: Any) -> str:
        message = body.get("message") if isinstance(body, dict) else None
        if status in (403, 429) and self.rate.get("remaining") == 0:
            return f"GitHub's rate limit is used up until {self.rate.get('reset_at')}"
        if status == 401:
            return "GitHub refused the token (set GH_TOKEN to a token with repo admin rights)"
        return f"GitHub answered {status}: {message or 'no message'}"

    async def get_all(self, path: str, key: str, params: str = "") -> list[Any]:
        url: str | None = f"{self.base}{path}?per_page=100{params}"
        items: list[Any] = []
        for _ in range(MAX_PAGES):
            if url is None:
                break
            body, url = await self.request("GET", url, conditional=True)
            items.extend((body or {}).get(key) or [])
        return items

    async def runners(self, repo: str) -> list[dict[str, Any]]:
        raw = await self.get_all(f"{_repo_path(repo)}/actions/runners", "runners")
        return [{"id": r.get("id"), "name": r.get("name"), "status": r.get("status"),
                 "busy": bool(r.get("busy")), "os": r.get("os"),
                 "labels": [label.get("name") for label in r.get("labels") or []],
                 "custom_labels": [label.get("name") for label in r.get("labels") or []
                                   if label.get("type") == "custom"]} for r in raw]

    async def runs(self, repo: str, status: str, pages: int = 1) -> list[dict[str, Any]]:
        url = f"{self.base}{_repo_path(repo)}/actions/runs?per_page=50&status={quote(status)}"
        body, _ = await self.request("GET", url, conditional=True)
        return [{"id": r.get("id"), "repo": repo, "name": r.get("name"),
                 "status": r.get("status"), "conclusion": r.get("conclusion"),
                 "event": r.get("event"), "branch": r.get("head_branch"),
                 "created_at": r.get("created_at"), "started_at": r.get("run_started_at"),
                 "url": r.get("html_url")} for r in (body or {}).get("workflow_runs") or []]

    async def jobs(self, repo: str, run_id: int, all_attempts: bool = False
                   ) -> list[dict[str, Any]]:
        """The run's jobs (of every attempt with all_attempts) with their steps."""
        raw = await self.get_all(f"{_repo_path(repo)}/actions/runs/{int(run_id)}/jobs", "jobs",
                                 "&filter=all" if all_attempts else "")
        return [{"id": j.get("id"), "run_id": j.get("run_id"), "repo": repo,
                 "name": j.get("name"), "workflow": j.get("workflow_name"),
                 "status": j.get("status"), "conclusion": j.get("conclusion"),
                 "runner": j.get("runner_name"), "labels": j.get("labels") or [],
                 "created_at": j.get("created_at"), "started_at": j.get("started_at"),
                 "completed_at": j.get("completed_at"), "run_attempt": j.get("run_attempt"),
                 "head_branch": j.get("head_branch"),
                 "steps": [_step(step) for step in j.get("steps") or []
                           if isinstance(step, dict)]} for j in raw if isinstance(j, dict)]

    async def completed_runs(self, repo: str, created: str, page: int
                             ) -> tuple[list[dict[str, Any]], int, bool]:
        """One page (100) of completed runs created in `created` (GitHub's search range
        syntax, e.g. 2026-01-01T00:00:00Z..2026-01-01T23:59:59Z): (runs, total_count, more)."""
        url = (f"{self.base}{_repo_path(repo)}/actions/runs?per_page=100&status=completed"
               f"&created={quote(created, safe='')}&page={int(page)}")
        body, nxt = await self.request("GET", url, conditional=True)
        body = body if isinstance(body, dict) else {}
        runs = [{"id": r.get("id"), "repo": repo, "name": r.get("name"), "path": r.get("path"),
                 "run_attempt": r.get("run_attempt") or 1, "event": r.get("event"),
                 "branch": r.get("head_branch"), "status": r.get("status"),
                 "conclusion": r.get("conclusion"), "created_at": r.get("created_at"),
                 "updated_at": r.get("updated_at")}
                for r in body.get("workflow_runs") or [] if isinstance(r, dict)]
        total = body.get("total_count")
        return runs, total if isinstance(total, int) else len(runs), nxt is not None

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
        if not isinstance(token, str) or not token:
            raise GitHubError(f"GitHub returned no {kind} token")
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


def _step(step: dict[str, Any]) -> dict[str, Any]:
    return {"name": str(step.get("name") or "")[:300], "number": step.get("number"),
            "conclusion": step.get("conclusion"), "started_at": step.get("started_at"),
            "completed_at": step.get("completed_at")}

"""A fake GitHub REST API: a real aiohttp server on a free port, in its own thread.

It serves the shapes of the recorded GitHub responses the control plane reads (runners with
label objects, workflow runs, jobs), honours ETag/If-None-Match with 304, paginates with Link
headers, sends rate-limit headers, checks the bearer token, issues registration and removal
tokens, and can be told to fail the next N requests with 502. `/_fake/*` is the back door the
fake config.sh uses to register and remove runners, as the real one talks to GitHub.

For the history and analysis: the run listing filters by status and by GitHub's `created`
search ranges, pages with Link headers and answers at most 1,000 runs per query as GitHub
does; jobs honour `filter=latest|all`; the contents API serves workflow files (base64, blob
sha); `/users/{name}` and the Actions billing routes answer for the accounts a test sets up.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from aiohttp import web

TOKEN = "ghp_FakeTokenForTests0000000000000000000"
DEFAULT_LABELS = ["self-hosted", "Linux", "X64"]


class FakeGitHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, Any]] = {}
        self.issued: dict[str, tuple[str, str]] = {}  # token -> (kind, repo)
        self.fail_next = 0
        self.accounts: dict[str, str] = {}               # login -> "User" / "Organization"
        self.hidden_runners: set[str] = set()            # repos whose runner list answers 403
        self.billing: dict[str, dict[str, Any]] = {}     # login -> Actions billing body
        self.log: list[tuple[str, str, int]] = []
        self.remaining = 5000
        self.reset_header: str | None = None  # X-RateLimit-Reset as sent; None: an hour ahead
        # A test's own answer (a hostile shape, an endless or slow body, a redirect): asked first
        # for every request; the response it returns is served as is, None goes on as usual.
        self.hijack: Callable[[web.Request], Awaitable[web.StreamResponse | None]] | None = None
        self._ids = itertools.count(1000)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    # --- state the tests arrange ----------------------------------------------------------

    def repo(self, name: str) -> dict[str, Any]:
        return self.repos.setdefault(name, {"runners": {}, "runs": [], "jobs": {}, "files": {},
                                            "default_branch": "main"})

    def load_history(self, history: Any) -> None:
        """Serve a generated history (tests/support/history_gen.py) for its repo."""
        repo = self.repo(history.repo)
        repo["runs"] += history.runs
        repo["jobs"].update(history.jobs)

    def add_runner(self, repo: str, name: str, labels: list[str] | None = None,
                   status: str = "online", busy: bool = False) -> int:
        runner_id = next(self._ids)
        self.repo(repo)["runners"][name] = {
            "id": runner_id, "name": name, "os": "Linux", "status": status, "busy": busy,
            "labels": [{"id": i, "name": n, "type": "read-only"}
                       for i, n in enumerate(DEFAULT_LABELS, 1)]
            + [{"id": 10 + i, "name": n, "type": "custom"} for i, n in enumerate(labels or [])]}
        return runner_id

    def add_run(self, repo: str, status: str, created_at: str, labels: list[str],
                runner: str | None = None, name: str = "CI") -> int:
        run_id = next(self._ids)
        self.repo(repo)["runs"].append({
            "id": run_id, "name": name, "status": status, "conclusion": None,
            "event": "push", "head_branch": "main", "created_at": created_at,
            "run_started_at": created_at, "html_url": f"https://github.com/{repo}/actions/runs/{run_id}"})
        job_status = "queued" if status in ("queued", "pending") else "in_progress"
        self.repo(repo)["jobs"][run_id] = [{
            "id": next(self._ids), "run_id": run_id, "name": "build", "workflow_name": name,
            "status": job_status, "conclusion": None, "labels": labels, "created_at": created_at,
            "started_at": created_at if runner else None, "completed_at": None,
            "runner_name": runner}]
        return run_id

    # --- HTTP -------------------------------------------------------------------------------

    def _answer(self, request: web.Request, body: Any, status: int = 200,
                link: str | None = None) -> web.Response:
        text = json.dumps(body)
        etag = '"' + hashlib.sha1(text.encode()).hexdigest() + '"'
        headers = {"ETag": etag, "X-RateLimit-Limit": "5000", "X-RateLimit-Used":
                   str(5000 - self.remaining), "X-RateLimit-Reset":
                   self.reset_header or str(int(time.time()) + 3600)}
        if link:
            headers["Link"] = link
        if request.method == "GET" and request.headers.get("If-None-Match") == etag:
            headers["X-RateLimit-Remaining"] = str(self.remaining)
            self.log.append((request.method, request.path_qs, 304))
            return web.Response(status=304, headers=headers)
        self.remaining -= 1
        headers["X-RateLimit-Remaining"] = str(self.remaining)
        self.log.append((request.method, request.path_qs, status))
        return web.json_response(body, status=status, headers=headers)

    @web.middleware
    async def _gate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.hijack is not None:
            answer = await self.hijack(request)
            if answer is not None:
                self.log.append((request.method, request.path_qs, answer.status))
                return answer
        if self.fail_next > 0:
            self.fail_next -= 1
            self.log.append((request.method, request.path_qs, 502))
            return web.json_response({"message": "Bad gateway"}, status=502)
        if request.path.startswith("/_fake/"):
            return await handler(request)
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.log.append((request.method, request.path_qs, 401))
            return web.json_response({"message": "Bad credentials"}, status=401)
        return await handler(request)

    def _repo_of(self, request: web.Request) -> dict[str, Any]:
        name = f"{request.match_info['owner']}/{request.match_info['repo']}"
        if name not in self.repos:
            raise web.HTTPNotFound(text='{"message": "Not Found"}',
                                   content_type="application/json")
        return self.repos[name]

    async def runners(self, request: web.Request) -> web.Response:
        name = f"{request.match_info['owner']}/{request.match_info['repo']}"
        if name in self.hidden_runners:
            return web.json_response({"message": "Must have admin rights to Repository."},
                                     status=403)
        items = list(self._repo_of(request)["runners"].values())
        per_page = int(request.query.get("per_page", 30))
        page = int(request.query.get("page", 1))
        chunk = items[(page - 1) * per_page: page * per_page]
        link = None
        if page * per_page < len(items):
            nxt = request.url.update_query(page=page + 1)
            link = f'<{nxt}>; rel="next"'
        return self._answer(request, {"total_count": len(items), "runners": chunk}, link=link)

    def _page(self, request: web.Request, items: list[Any], key: str, cap: int | None = None
              ) -> web.Response:
        per_page = min(100, int(request.query.get("per_page", 30)))
        page = int(request.query.get("page", 1))
        reachable = items[:cap] if cap else items
        chunk = reachable[(page - 1) * per_page: page * per_page]
        link = None
        if page * per_page < len(reachable):
            link = f'<{request.url.update_query(page=page + 1)}>; rel="next"'
        return self._answer(request, {"total_count": len(items), key: chunk}, link=link)

    async def runs(self, request: web.Request) -> web.Response:
        status = request.query.get("status")
        created = _created_filter(request.query.get("created"))
        runs = [r for r in self._repo_of(request)["runs"] if status in (None, r["status"])
                and created(r["created_at"])]
        runs.sort(key=lambda r: r["created_at"], reverse=True)
        return self._page(request, runs, "workflow_runs", cap=1000)

    async def jobs(self, request: web.Request) -> web.Response:
        jobs = self._repo_of(request)["jobs"].get(int(request.match_info["run"]), [])
        if request.query.get("filter", "latest") == "latest" and jobs:
            latest = max(j.get("run_attempt", 1) for j in jobs)
            jobs = [j for j in jobs if j.get("run_attempt", 1) == latest]
        return self._page(request, jobs, "jobs")

    async def repository(self, request: web.Request) -> web.Response:
        repo = self._repo_of(request)
        name = f"{request.match_info['owner']}/{request.match_info['repo']}"
        return self._answer(request, {"full_name": name, "default_branch":
                                      repo["default_branch"], "private": True})

    async def contents(self, request: web.Request) -> web.Response:
        repo = self._repo_of(request)
        path = request.match_info["path"].strip("/")
        files: dict[str, str] = repo["files"]
        if path in files:
            data = files[path].encode()
            return self._answer(request, {"type": "file", "path": path, "sha": _blob_sha(data),
                                          "size": len(data), "encoding": "base64",
                                          "content": base64.encodebytes(data).decode()})
        inside = sorted(p for p in files if p.startswith(path + "/"))
        if not inside:
            raise web.HTTPNotFound(text='{"message": "Not Found"}',
                                   content_type="application/json")
        return self._answer(request, [
            {"type": "file", "name": p.rsplit("/", 1)[-1], "path": p,
             "sha": _blob_sha(files[p].encode()), "size": len(files[p].encode())}
            for p in inside])

    async def user(self, request: web.Request) -> web.Response:
        login = request.match_info["login"]
        if login not in self.accounts:
            raise web.HTTPNotFound(text='{"message": "Not Found"}',
                                   content_type="application/json")
        return self._answer(request, {"login": login, "type": self.accounts[login]})

    async def actions_billing(self, request: web.Request) -> web.Response:
        login = request.match_info["login"]
        if login not in self.billing:
            return web.json_response({"message": "Resource not accessible by integration"},
                                     status=403)
        return self._answer(request, self.billing[login])

    async def token(self, request: web.Request) -> web.Response:
        self._repo_of(request)
        kind = request.match_info["kind"]
        token = f"A{kind.upper()[:3]}{next(self._ids)}TOKEN"
        self.issued[token] = (kind, f"{request.match_info['owner']}/{request.match_info['repo']}")
        return self._answer(request, {"token": token, "expires_at": "2099-01-01T00:00:00Z"}, 201)

    async def fake_register(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.issued.pop(body["token"], None) != ("registration", body["repo"]):
            return web.json_response({"message": "invalid registration token"}, status=404)
        runner_id = self.add_runner(body["repo"], body["name"], body["labels"])
        return web.json_response({"id": runner_id})

    async def fake_remove(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.issued.pop(body["token"], None) != ("remove", body["repo"]):
            return web.json_response({"message": "invalid removal token"}, status=404)
        self.repo(body["repo"])["runners"].pop(body["name"], None)
        return web.json_response({"ok": True})

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._gate])
        base = "/repos/{owner}/{repo}/actions"
        app.router.add_get(base + "/runners", self.runners)
        app.router.add_post(base + "/runners/{kind:registration|remove}-token", self.token)
        app.router.add_get(base + "/runs", self.runs)
        app.router.add_get(base + "/runs/{run:[0-9]+}/jobs", self.jobs)
        app.router.add_get("/repos/{owner}/{repo}", self.repository)
        app.router.add_get("/repos/{owner}/{repo}/contents/{path:.+}", self.contents)
        app.router.add_get("/users/{login}", self.user)
        app.router.add_get("/users/{login}/settings/billing/actions", self.actions_billing)
        app.router.add_get("/orgs/{login}/settings/billing/actions", self.actions_billing)
        app.router.add_post("/_fake/register", self.fake_register)
        app.router.add_post("/_fake/remove", self.fake_remove)
        return app

    # --- thread ----------------------------------------------------------------------------

    def start(self) -> str:
        ready = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._runner = web.AppRunner(self.app(), access_log=None)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            port = self._runner.addresses[0][1]
            self.url = f"http://127.0.0.1:{port}"
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, name="fake-github", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self.url

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


def _blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _when(text: str, end: bool) -> float:
    """A search-syntax date or time as epoch seconds (a bare date: its first or last second)."""
    value = text.strip().replace("Z", "+00:00")
    if len(value) == 10:
        value += "T23:59:59+00:00" if end else "T00:00:00+00:00"
    moment = datetime.fromisoformat(value)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.now().astimezone().tzinfo)
    return moment.timestamp()


def _created_filter(query: str | None) -> Any:
    """GitHub's `created` qualifier: A..B, >=A, <=A, >A, <A, or one date (inclusive)."""
    if not query:
        return lambda created: True
    if ".." in query:
        low, high = query.split("..", 1)
        lo = _when(low, False) if low != "*" else float("-inf")
        hi = _when(high, True) if high != "*" else float("inf")
    elif query.startswith(">="):
        lo, hi = _when(query[2:], False), float("inf")
    elif query.startswith("<="):
        lo, hi = float("-inf"), _when(query[2:], True)
    elif query.startswith(">"):
        lo, hi = _when(query[1:], True) + 1, float("inf")
    elif query.startswith("<"):
        lo, hi = float("-inf"), _when(query[1:], False) - 1
    else:
        lo, hi = _when(query, False), _when(query, True)
    return lambda created: lo <= _when(created, False) <= hi

"""GitHub (or a proxy, or a wrong FLEET_GITHUB_API) answering what the control plane does not
expect: bodies of the wrong shape, too large, too deep, endless or trickling; pagination and
redirects that lead elsewhere; absurd rate-limit headers; timestamps nobody can use. Each test
runs the real client (and the sync, history and workflow-file code it feeds) over real HTTP
against the fake GitHub server, which `hijack` makes say the hostile thing."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from aiohttp import web

from fleet_min.controlplane.analysis import analytics
from fleet_min.controlplane.github.client import MAX_BODY_BYTES, MAX_TEXT, GitHub, GitHubError
from fleet_min.controlplane.github.history import HistoryCollector
from fleet_min.controlplane.github.history import status as history_status
from fleet_min.controlplane.github.sync import GitHubSync
from fleet_min.controlplane.github.workflow_files import WorkflowFiles
from fleet_min.controlplane.labels import LABEL_CHARS, MAX_LABEL_CHARS, fit_labels
from fleet_min.controlplane.snapshot import Snapshots
from fleet_min.db import Database
from fleet_min.http import link_url
from tests.support.controlplane import Host, auth, cp_of, open_parts, until
from tests.support.fake_github import DEFAULT_LABELS, TOKEN, FakeGitHub

HANG_GUARD_S = 30  # not a performance bound: only turns a hang into a failure
Hijack = Callable[[web.Request], Awaitable[web.StreamResponse | None]]
Elsewhere = tuple[str, list[str | None]]  # a URL, and the Authorization headers sent to it


@pytest.fixture
def elsewhere() -> Iterator[Elsewhere]:
    """A second server on another origin: its URL, and the Authorization header of each request
    it was sent."""
    fake = FakeGitHub()
    fake.start()
    seen: list[str | None] = []

    async def record(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"runners": [], "workflow_runs": []})

    fake.hijack = record
    yield fake.url, seen
    fake.stop()


def raw(body: bytes | str, status: int = 200, content_type: str = "application/json",
        headers: dict[str, str] | None = None) -> web.Response:
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    return web.Response(body=data, status=status, content_type=content_type, headers=headers)


def on(path_end: str, answer: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Hijack:
    """Answer requests whose path ends with `path_end` with `answer`; the rest as usual."""
    async def hijack(request: web.Request) -> web.StreamResponse | None:
        return await answer(request) if request.path.endswith(path_end) else None
    return hijack


def serve(path_end: str, body: bytes | str, **kwargs: Any) -> Hijack:
    async def answer(_request: web.Request) -> web.StreamResponse:
        return raw(body, **kwargs)
    return on(path_end, answer)


async def stream(request: web.Request, head: bytes, chunk: bytes, pause_s: float = 0.0
                 ) -> web.StreamResponse:
    """A chunked answer that never ends (until the client goes away)."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    try:
        await resp.write(head)
        while True:
            await resp.write(chunk)
            await asyncio.sleep(pause_s)
    except (ConnectionError, RuntimeError):  # the client hung up
        pass
    return resp


def requests_to(github: FakeGitHub, part: str) -> int:
    return sum(1 for _, path, _ in github.log if part in path)


# --- bodies too large, too deep, not JSON, or never finished ------------------------------

async def test_a_body_larger_than_the_cap_is_refused(github: FakeGitHub, gh: GitHub) -> None:
    github.repo("o/r")
    padding = "x" * (MAX_BODY_BYTES + 1)
    github.hijack = serve("/actions/runners", f'{{"runners": [], "pad": "{padding}"}}')
    with pytest.raises(GitHubError, match="larger than"):
        await gh.runners("o/r")
    assert requests_to(github, "/actions/runners") == 1  # not retried: it would say it again


async def test_an_endless_body_is_cut_at_the_cap(github: FakeGitHub, gh: GitHub) -> None:
    async def endless(request: web.Request) -> web.StreamResponse:
        return await stream(request, b'{"runners": [], "pad": "', b"x" * 65536)

    github.hijack = on("/actions/runners", endless)
    async with asyncio.timeout(HANG_GUARD_S):
        with pytest.raises(GitHubError, match="larger than"):
            await gh.runners("o/r")


async def test_a_dense_answer_is_refused_before_it_is_parsed(github: FakeGitHub,
                                                              gh: GitHub) -> None:
    """16 MiB of `{},` is within the body cap, yet would parse into about 540 MB of dicts for
    a moment: it is refused from its bytes, and what parsing would have made is never made."""
    github.repo("o/r")
    dense = '{"runners": [' + "{}," * (MAX_BODY_BYTES // 3 - 10) + "{}]}"
    assert len(dense) <= MAX_BODY_BYTES
    github.hijack = serve("/actions/runners", dense)
    tracemalloc.start()
    try:
        with pytest.raises(GitHubError, match="too dense"):
            await gh.runners("o/r")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # The fake GitHub in this process holds the body as text and bytes, and the client reads and
    # joins it: a few copies of 16 MiB, against the 540 MB parsing it would take.
    assert peak < 6 * MAX_BODY_BYTES, peak
    assert requests_to(github, "/actions/runners") == 1  # not retried: it would say it again


async def trickle(request: web.Request) -> web.StreamResponse:
    return await stream(request, b"{", b" ", pause_s=0.05)


async def test_a_trickling_answer_is_cut_by_the_request_deadline(github: FakeGitHub) -> None:
    github.hijack = on("/actions/runners", trickle)
    client = GitHub(github.url, TOKEN, timeout_s=0.3, backoff_s=0.01)
    try:
        async with asyncio.timeout(HANG_GUARD_S):
            with pytest.raises(GitHubError, match=r"TimeoutError.*after 3 attempts"):
                await client.runners("o/r")
    finally:
        await client.close()


async def test_a_trickling_github_ends_the_round_with_an_error(host: Host) -> None:
    env = {**host.full_env(), "FLEET_WATCH_REPOS": "o/r"}
    host.github.add_run("o/r", "queued", "2026-01-01T00:00:00Z", ["self-hosted"])
    host.github.hijack = on("/actions/runners", trickle)
    async with open_parts(host, env) as parts:
        slow = GitHub(host.github.url, TOKEN, timeout_s=0.3, backoff_s=0.01)
        try:
            snapshots = Snapshots(parts.plane, parts.supervisor, slow, parts.hub)
            async with asyncio.timeout(HANG_GUARD_S):
                await GitHubSync(parts.plane, slow, snapshots).refresh()
        finally:
            await slow.close()
        data = parts.plane.repos["o/r"]
        assert data.refreshed_at is not None and "TimeoutError" in (data.error or "")


async def test_deeply_nested_json_is_a_github_error(github: FakeGitHub, gh: GitHub) -> None:
    github.hijack = serve("/actions/runners", "[" * 100_000 + "]" * 100_000)
    with pytest.raises(GitHubError, match="nested"):
        await gh.runners("o/r")


async def test_an_error_answer_that_is_not_json_keeps_its_status(github: FakeGitHub,
                                                                 gh: GitHub) -> None:
    github.hijack = serve("/contents/.github/workflows", "<html>Not Found</html>", status=404,
                          content_type="text/html")
    with pytest.raises(GitHubError) as caught:
        await gh.contents("o/r", ".github/workflows", "main")
    assert caught.value.status == 404  # so the callers' 403/404 handling still applies
    assert requests_to(github, "/contents/") == 1


async def test_a_success_that_is_not_json_is_still_retried_then_reported(
        github: FakeGitHub, gh: GitHub) -> None:
    github.hijack = serve("/actions/runners", "<html>proxy login</html>", content_type="text/html")
    with pytest.raises(GitHubError, match="after 3 attempts"):
        await gh.runners("o/r")


# --- answers of the wrong shape ----------------------------------------------------------

TOP_LEVEL = ["null", "[]", '"runners"', "5", '{"runners": {"id": 1}}', '{"runners": "abc"}',
             '{"workflow_runs": 7, "jobs": true}', '[{"id": 1}]']


@pytest.mark.parametrize("body", TOP_LEVEL)
async def test_a_listing_of_the_wrong_shape_is_a_github_error(github: FakeGitHub, gh: GitHub,
                                                              body: str) -> None:
    github.hijack = serve("", body)  # every route answers the same
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: gh.runners("o/r"), lambda: gh.runs("o/r", "queued"),
        lambda: gh.jobs("o/r", 1), lambda: gh.completed_runs("o/r", "2026-01-01", 1)]
    for call in calls:  # never read as "none there", never an AttributeError
        with pytest.raises(GitHubError, match="GitHub's answer has no"):
            await call()


HOSTILE_ITEMS = [None, 5, "x", [1], {}, {"id": None}, {"id": "7"}, {"id": 1.5}, {"id": True},
                 {"id": 2**64}, {"id": -3}, {"id": 1e400}]


def _good_runner(n: int) -> dict[str, Any]:
    return {"id": n, "name": f"r{n}", "status": "online", "busy": False, "os": "Linux",
            "labels": [{"name": "self-hosted", "type": "read-only"},
                       {"name": "gpu", "type": "custom"}]}


async def test_runner_items_of_the_wrong_shape_are_dropped_or_cleaned(
        github: FakeGitHub, gh: GitHub) -> None:
    items = [*HOSTILE_ITEMS, _good_runner(1),
             {**_good_runner(2), "name": "bad\ud800name\x07", "status": 5, "busy": "yes",
              "labels": "gpu"},
             {**_good_runner(3), "labels": [None, 5, "bare", {"name": 7}, {"name": "ok",
                                                                           "type": "custom"}]},
             {**_good_runner(4), "labels": {"name": "gpu"}}]
    body = json.dumps({"total_count": 99, "runners": items})
    github.hijack = serve("/actions/runners", body)
    runners = await gh.runners("o/r")
    assert [r["id"] for r in runners] == [1, 2, 3, 4]
    assert runners[0]["labels"] == ["self-hosted", "gpu"] and runners[0]["custom_labels"] == [
        "gpu"]
    two = runners[1]
    assert two["name"] == "bad\ufffdname\x07" and two["status"] is None and two["labels"] == []
    assert runners[2]["labels"] == ["ok"] and runners[2]["custom_labels"] == ["ok"]
    assert runners[3]["labels"] == []
    json.dumps(runners).encode()  # servable as it is


async def test_job_and_run_items_of_the_wrong_shape_are_dropped_or_cleaned(
        github: FakeGitHub, gh: GitHub) -> None:
    good_job = {"id": 10, "run_id": 1, "name": "build", "labels": ["self-hosted", 5, None],
                "status": "completed", "conclusion": "success", "run_attempt": "2",
                "created_at": 12, "started_at": "2026-01-01T00:00:00Z",
                "steps": [None, "x", {"name": "a\ud800", "number": "1"}]}
    jobs = [*HOSTILE_ITEMS, good_job, {**good_job, "id": 11, "run_id": "1"},
            {**good_job, "id": 12, "labels": "self-hosted", "steps": {"name": "x"}}]
    github.hijack = serve("/jobs", json.dumps({"jobs": jobs}))
    got = await gh.jobs("o/r", 1)
    assert [j["id"] for j in got] == [10, 12]  # a job must name its run by number
    assert got[0]["labels"] == ["self-hosted"] and got[0]["run_attempt"] is None
    assert got[0]["created_at"] is None and got[0]["started_at"] == "2026-01-01T00:00:00Z"
    assert got[0]["steps"] == [{"name": "a\ufffd", "number": None, "conclusion": None,
                                "started_at": None, "completed_at": None}]
    assert got[1]["labels"] == [] and got[1]["steps"] == []

    runs = [*HOSTILE_ITEMS, {"id": 1, "name": ["CI"], "status": "queued",
                             "created_at": "2026-01-01T00:00:00Z", "run_attempt": 2**70}]
    github.hijack = serve("/actions/runs", json.dumps({"total_count": "many",
                                                      "workflow_runs": runs}))
    [run] = await gh.runs("o/r", "queued")
    assert run["id"] == 1 and run["name"] is None and run["status"] == "queued"
    listed, total, _ = await gh.completed_runs("o/r", "2026-01-01", 1)
    assert [r["id"] for r in listed] == [1] and listed[0]["run_attempt"] == 1 and total == 1


# --- what the rest of the control plane does with hostile answers --------------------------

POISON_JOBS = [{"id": 2**64, "run_id": 1, "name": "huge id", "status": "completed"},
               {"id": 5, "run_id": 1, "name": "lone \ud800 surrogate", "status": "completed",
                "labels": ["self-hosted"], "runner_name": "r\udfff", "workflow_name": 3}]


def poisoned_jobs(repo: str) -> Hijack:
    """Jobs of `repo`'s runs answer ids SQLite cannot hold and names SQLite cannot encode."""
    async def answer(request: web.Request) -> web.StreamResponse | None:
        if request.path.startswith(f"/repos/{repo}/") and request.path.endswith("/jobs"):
            return raw(json.dumps({"total_count": 2, "jobs": POISON_JOBS}))
        return None
    return answer


async def test_a_poisoned_answer_does_not_stop_the_github_round(host: Host) -> None:
    env = {**host.full_env(), "FLEET_WATCH_REPOS": "a/bad,b/good"}
    for repo in ("a/bad", "b/good"):
        host.github.add_run(repo, "queued", "2026-01-01T00:00:00Z", ["self-hosted"])
    host.github.hijack = poisoned_jobs("a/bad")
    async with open_parts(host, env) as parts:
        snapshots = Snapshots(parts.plane, parts.supervisor, parts.github, parts.hub)
        await GitHubSync(parts.plane, parts.github, snapshots).refresh()
        bad, good = parts.plane.repos["a/bad"], parts.plane.repos["b/good"]
        assert good.refreshed_at is not None and good.error is None and len(good.jobs) == 1
        assert bad.refreshed_at is not None
        names = {row["name"] for row in await parts.plane.db.read("SELECT name FROM jobs")}
        assert "lone \ufffd surrogate" in names and "huge id" not in names
        built = await snapshots.rebuild()
        json.dumps(built).encode()


async def test_a_poisoned_run_does_not_wedge_the_history(github: FakeGitHub, gh: GitHub,
                                                         db: Database) -> None:
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3600))
    for repo in ("a/bad", "b/good"):
        github.repo(repo)["runs"].append({"id": 1, "name": "CI", "status": "completed",
                                          "created_at": created, "run_attempt": 1})
        github.repo(repo)["jobs"][1] = [{"id": 7, "run_id": 1, "name": "build",
                                         "status": "completed", "created_at": created}]
    github.hijack = poisoned_jobs("a/bad")
    collector = HistoryCollector(gh, db, 30, time.time)
    await collector.round(["a/bad", "b/good"])
    await collector.round(["a/bad", "b/good"])
    states = {s["repo"]: s for s in await history_status(db, ["a/bad", "b/good"])}
    assert states["b/good"]["backfill_complete"] and states["b/good"]["jobs_fetched"] == 1
    assert states["a/bad"]["backfill_complete"] and states["a/bad"]["pending_runs"] == 0


async def test_a_listing_of_the_wrong_shape_never_marks_history_caught_up(
        github: FakeGitHub, gh: GitHub, db: Database) -> None:
    github.repo("o/r")
    github.hijack = serve("/actions/runs", "[]")
    collector = HistoryCollector(gh, db, 30, time.time)
    await collector.round(["o/r"])
    [state] = await history_status(db, ["o/r"])
    assert not state["backfill_complete"] and state["error"]


async def test_a_refusal_message_that_cannot_be_stored_does_not_stop_the_history(
        github: FakeGitHub, gh: GitHub, db: Database) -> None:
    github.repo("b/good")
    message = "Not \ud800 Found\n2026-01-01 CRITICAL forged log line\x1b[2J" + "x" * 1000
    hostile = serve("/actions/runs", json.dumps({"message": message}), status=404)

    async def only_for_bad(request: web.Request) -> web.StreamResponse | None:
        return await hostile(request) if request.path.startswith("/repos/a/bad/") else None

    github.hijack = only_for_bad
    collector = HistoryCollector(gh, db, 30, time.time)
    await collector.round(["a/bad", "b/good"])
    states = {s["repo"]: s for s in await history_status(db, ["a/bad", "b/good"])}
    assert states["b/good"]["backfill_complete"]
    error = states["a/bad"]["error"]
    assert error.startswith("GitHub answered 404: Not \ufffd Found 2026-01-01 CRITICAL")
    assert "\n" not in error and "\x1b" not in error and len(error) < 400


async def test_impossible_timestamps_are_kept_out_of_the_figures(
        github: FakeGitHub, gh: GitHub, db: Database) -> None:
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3600))
    repo = github.repo("o/r")
    repo["runs"].append({"id": 1, "name": "CI", "status": "completed", "created_at": created,
                         "run_attempt": 1})
    stamps = [("yesterday", "soon"), ("2026-01-01T00:10:00Z", "2026-01-01T00:00:00Z"),
              ("0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"),
              ("2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"), ("\ud800", 5)]
    ids = itertools.count(100)
    repo["jobs"][1] = [{"id": next(ids), "run_id": 1, "name": "build", "status": "completed",
                        "conclusion": "success", "runner_name": "r1", "created_at": created,
                        "started_at": started, "completed_at": completed,
                        "steps": [{"name": "Install Playwright browsers",
                                   "started_at": completed, "completed_at": started}]}
                       for started, completed in stamps]
    collector = HistoryCollector(gh, db, 30, time.time)
    await collector.round(["o/r"])
    rows = [dict(row) for row in await db.read("SELECT * FROM jobs ORDER BY job_id")]
    assert len(rows) == len(stamps)
    figures = analytics.job_figures(rows)
    assert figures["jobs"] == 2  # the five-minute job and the 0001..9999 one; none negative
    assert figures["duration_s"]["p50"] >= 0
    json.dumps(analytics.browser_test(rows)).encode()


# --- workflow files ---------------------------------------------------------------------

async def test_hostile_workflow_listings_skip_the_entries_not_the_round(
        github: FakeGitHub, gh: GitHub, db: Database) -> None:
    folder = ".github/workflows"
    github.repo("o/r")["files"][f"{folder}/ci.yml"] = "on: push\njobs: {}\n"
    files = WorkflowFiles(gh, db, time.time)
    real = await gh.contents("o/r", folder, "main")
    hostile = [{"type": "file", "path": f"{folder}/{n}.yml", "sha": "abc", "size": size}
               for n, size in enumerate(["big", [1], 1e400, "1e3", 10**30, {"n": 1}])]
    hostile += [{"type": "file", "path": f"{folder}/\ud800.yml", "sha": "s", "size": 1},
                {"type": "file", "path": f"{folder}/x\n.yml", "sha": "s", "size": 1},
                {"type": "file", "path": f"{folder}/y.yml", "sha": "\udfff", "size": 1}]
    github.hijack = serve(f"/contents/{folder}", json.dumps(hostile + real))
    await files.refresh("o/r")
    assert files.status["o/r"]["error"] is None and files.status["o/r"]["files"] == 1
    assert [w.path for w in await files.workflows("o/r")] == [f"{folder}/ci.yml"]

    for branch in (["main"], 5, {"x": 1}, "\ud800", "a\nb"):
        github.hijack = serve("/repos/o/r", json.dumps({"default_branch": branch}))
        await files.refresh("o/r")
        assert files.status["o/r"]["default_branch"] == "main"
        assert files.status["o/r"]["error"] is None


# --- pagination, redirects, other origins -------------------------------------------------

async def test_a_next_link_to_itself_is_not_followed_again(github: FakeGitHub,
                                                           gh: GitHub) -> None:
    async def loop(request: web.Request) -> web.StreamResponse:
        return raw(json.dumps({"runners": [_good_runner(1)]}),
                   headers={"Link": f'<{request.url}>; rel="next"'})

    github.hijack = on("/actions/runners", loop)
    assert [r["id"] for r in await gh.runners("o/r")] == [1]
    assert requests_to(github, "/actions/runners") == 1


async def test_a_next_link_off_origin_is_refused_and_never_gets_the_token(
        github: FakeGitHub, gh: GitHub, elsewhere: Elsewhere) -> None:
    github.hijack = serve("/actions/runners", json.dumps({"runners": [_good_runner(1)]}),
                          headers={"Link": f'<{elsewhere[0]}/x>; rel="next"'})
    with pytest.raises(GitHubError, match="refusing"):
        await gh.runners("o/r")
    assert elsewhere[1] == []


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
async def test_a_redirect_to_another_origin_never_carries_the_token_nor_is_believed(
        github: FakeGitHub, gh: GitHub, elsewhere: Elsewhere, code: int) -> None:
    """aiohttp follows the redirect without the token; what that origin answered was taken as
    GitHub's (its runner listing, and a registration token that config.sh was given)."""
    github.hijack = serve("/actions/runners", "", status=code,
                          headers={"Location": f"{elsewhere[0]}/steal"})
    with pytest.raises(GitHubError, match=r"redirected to 127\.0\.0\.1; only answers from "):
        await gh.runners("o/r")
    assert elsewhere[1] == [None]  # followed, without the token


async def test_a_redirect_within_the_api_is_followed(github: FakeGitHub, gh: GitHub) -> None:
    """GitHub redirects a renamed repository's API calls to its new path on the same origin."""
    async def moved(request: web.Request) -> web.StreamResponse | None:
        if request.path == "/repos/old/name/actions/runners":
            raise web.HTTPMovedPermanently(f"{github.url}/repos/o/r/actions/runners")
        return None

    github.repo("o/r")
    github.add_runner("o/r", "r1")
    github.hijack = moved
    assert [r["name"] for r in await gh.runners("old/name")] == ["r1"]


async def test_the_etag_cache_keeps_the_recently_used_answers_only(github: FakeGitHub) -> None:
    runs = [github.add_run("o/r", "completed", "2026-01-01T00:00:00Z", []) for _ in range(6)]
    client = GitHub(github.url, TOKEN, backoff_s=0.01, etag_entries=3)
    try:
        for run in runs:  # the history fetches each run's jobs once: six URLs
            await client.jobs("o/r", run)
        await client.jobs("o/r", runs[-1])
        await client.jobs("o/r", runs[0])
    finally:
        await client.close()
    statuses = [status for _, path, status in github.log if "/jobs" in path]
    assert statuses[-2:] == [304, 200]  # the newest still cached, the oldest let go


def _jobs_url(github: FakeGitHub, run: int) -> list[int]:
    """The statuses of the answers to `run`'s jobs URL, in order."""
    return [status for _, path, status in github.log if f"/runs/{run}/jobs" in path]


async def test_the_etag_cache_is_bounded_by_the_memory_its_answers_take(
        github: FakeGitHub) -> None:
    """A 40 kB budget, so at most 10 kB an answer: one run's jobs of 5,000 steps are never
    kept; small answers (about 2 kB as the cache counts them) are, until the budget is used."""
    big = github.add_run("o/r", "completed", "2026-01-01T00:00:00Z", [])
    github.repo("o/r")["jobs"][big][0]["steps"] = [{}] * 5000
    small = [github.add_run("o/r", "completed", "2026-01-01T00:00:00Z", []) for _ in range(40)]
    client = GitHub(github.url, TOKEN, backoff_s=0.01, etag_bytes=40_000)
    try:
        for run in [big, *small[:10], small[9], big]:
            await client.jobs("o/r", run)
        assert _jobs_url(github, small[9]) == [200, 304]  # a normal answer: a 304
        assert _jobs_url(github, big) == [200, 200]  # not kept: asked for in full again
        for run in [*small[10:], small[-1], small[0]]:
            await client.jobs("o/r", run)
        assert _jobs_url(github, small[-1]) == [200, 304]
        assert _jobs_url(github, small[0]) == [200, 200]  # let go: 40 small ones exceed 40 kB
    finally:
        await client.close()


# --- lists longer than GitHub ever sends ------------------------------------------------

async def test_a_job_keeps_at_most_1000_steps(github: FakeGitHub, gh: GitHub) -> None:
    run = github.add_run("o/r", "in_progress", "2026-01-01T00:00:00Z", ["self-hosted"], "r1")
    github.repo("o/r")["jobs"][run][0]["steps"] = [{"name": f"step {n}", "number": n}
                                                   for n in range(1, 5001)]
    [job] = await gh.jobs("o/r", run)
    assert len(job["steps"]) == 1000
    assert [s["number"] for s in job["steps"][:2]] == [1, 2]  # the first ones, in order


async def test_a_run_keeps_at_most_25000_steps_over_all_its_jobs(github: FakeGitHub,
                                                                 gh: GitHub) -> None:
    run = github.add_run("o/r", "completed", "2026-01-01T00:00:00Z", [])
    [template] = github.repo("o/r")["jobs"][run]
    github.repo("o/r")["jobs"][run] = [{**template, "id": 10_000 + n, "steps": [{}] * 1000}
                                       for n in range(30)]  # two pages of the listing
    jobs = await gh.jobs("o/r", run)
    assert len(jobs) == 30  # every job, only the steps are cut
    assert [len(j["steps"]) for j in jobs] == [1000] * 25 + [0] * 5


async def test_a_page_keeps_at_most_the_items_it_was_asked_for(github: FakeGitHub,
                                                                gh: GitHub) -> None:
    """GitHub sends at most per_page items (100 at most; 50 for the runs in flight): a page of
    more is cut there, not turned into a record (and a jobs request) for each."""
    github.hijack = serve("/actions/runners", json.dumps(
        {"runners": [_good_runner(n) for n in range(1, 151)]}))
    assert [r["id"] for r in await gh.runners("o/r")] == list(range(1, 101))
    github.hijack = serve("/actions/runs", json.dumps(
        {"total_count": 150, "workflow_runs": [{"id": n} for n in range(1, 151)]}))
    assert len(await gh.runs("o/r", "in_progress")) == 50
    listed, _, _ = await gh.completed_runs("o/r", "2026-01-01", 1)
    assert len(listed) == 100
    github.hijack = serve("/jobs", json.dumps(
        {"jobs": [{"id": n, "run_id": 1} for n in range(1, 151)]}))
    assert len(await gh.jobs("o/r", 1)) == 100


async def test_the_snapshot_carries_no_steps(host: Host) -> None:
    """The jobs of a run in flight are in `active_runs` without their steps (nothing reads
    them there, and the snapshot is encoded every tick); the job history keeps them."""
    env = {**host.full_env(), "FLEET_WATCH_REPOS": "o/r"}
    run = host.github.add_run("o/r", "in_progress", "2026-01-01T00:00:00Z", ["self-hosted"],
                              "r1")
    host.github.repo("o/r")["jobs"][run][0]["steps"] = [{"name": "Run tests", "number": n}
                                                        for n in range(1, 5001)]
    async with open_parts(host, env) as parts:
        snapshots = Snapshots(parts.plane, parts.supervisor, parts.github, parts.hub)
        await GitHubSync(parts.plane, parts.github, snapshots).refresh()
        built = await snapshots.rebuild()
        [active] = built["active_runs"]
        [job] = active["jobs"]
        assert job["name"] == "build" and job["runner"] == "r1" and "steps" not in job
        assert len(json.dumps(built)) < 20_000
        [row] = await parts.plane.db.read("SELECT steps FROM jobs")
        assert len(json.loads(row["steps"])) == 1000


LONG = 300_000  # characters: a run name, a job name, a label as a hostile server may send them


async def test_long_text_from_github_is_cut_where_it_is_kept(github: FakeGitHub,
                                                              gh: GitHub) -> None:
    """Every string the client keeps is cut to MAX_TEXT, and labels follow an agent's rule
    (fit_labels): whatever answers at the base chooses the length of neither."""
    long_labels = ["self-hosted", "L" * LONG, *(f"x{n:02d}" + "y" * 97 for n in range(60))]
    run = github.add_run("o/r", "queued", "2026-01-01T00:00:00Z", long_labels, name="R" * LONG)
    listed = github.repo("o/r")["runs"][0]
    listed.update(head_branch="B" * LONG, event="E" * LONG,
                  html_url="https://github.com/o/r/actions/runs/1?" + "q" * LONG)
    [job] = github.repo("o/r")["jobs"][run]
    job.update(name="J" * LONG, runner_name="N" * LONG,
               steps=[{"name": "S" * LONG, "number": 1}])
    github.add_runner("o/r", "r" * LONG, labels=long_labels)

    [got] = await gh.runs("o/r", "queued")
    assert got["name"] == "R" * MAX_TEXT and got["branch"] == "B" * MAX_TEXT
    assert got["event"] == "E" * MAX_TEXT
    assert got["url"] is None  # a link cut short would lead somewhere else
    [got_job] = await gh.jobs("o/r", run)
    assert got_job["name"] == "J" * MAX_TEXT and got_job["runner"] == "N" * MAX_TEXT
    assert got_job["labels"] == fit_labels(long_labels)
    assert got_job["labels"][:2] == ["self-hosted", "L" * LABEL_CHARS]
    assert sum(map(len, got_job["labels"])) <= MAX_LABEL_CHARS
    assert len(got_job["steps"][0]["name"]) == 300
    [runner] = await gh.runners("o/r")
    assert runner["name"] == "r" * MAX_TEXT
    assert runner["labels"] == fit_labels([*DEFAULT_LABELS, *long_labels])
    assert runner["custom_labels"] == runner["labels"][len(DEFAULT_LABELS):]
    listed.update(status="completed")
    [old], _, _ = await gh.completed_runs("o/r", "2025-12-31..2026-01-02", 1)
    assert old["name"] == "R" * MAX_TEXT and old["branch"] == "B" * MAX_TEXT
    assert len(json.dumps([got, got_job, runner, old])) < 10 * MAX_LABEL_CHARS


async def test_runs_in_flight_with_long_names_keep_the_snapshot_small(host: Host) -> None:
    """Runs in flight whose run name, job name and one label are 300 KB each: the snapshot
    lists them with their text cut (it was 143 MB for 50 such runs, and is encoded for every
    stream client each tick)."""
    env = {**host.full_env(), "FLEET_WATCH_REPOS": "o/r"}
    runs = 20
    for n in range(runs):
        run = host.github.add_run("o/r", "queued", f"2026-01-01T00:{n:02d}:00Z",
                                  ["self-hosted", "L" * LONG + str(n)], name="R" * LONG + str(n))
        host.github.repo("o/r")["jobs"][run][0]["name"] = "J" * LONG + str(n)
    async with open_parts(host, env) as parts:
        snapshots = Snapshots(parts.plane, parts.supervisor, parts.github, parts.hub)
        await GitHubSync(parts.plane, parts.github, snapshots).refresh()
        built = await snapshots.rebuild()
        assert len(built["active_runs"]) == runs
        size = len(json.dumps(built))
        # About 4 KB a run now (its name, its job's name and labels, the rest); uncut, each
        # run was over 900 KB.
        assert size < 200_000, size
        assert {run["name"] for run in built["active_runs"]} == {"R" * MAX_TEXT}


# --- rate-limit headers -----------------------------------------------------------------

@pytest.mark.parametrize("reset", ["1e17", "-1e17", "1e16", "-62135596801"])
async def test_a_rate_reset_past_the_platform_clock_is_left_out(
        github: FakeGitHub, gh: GitHub, reset: str) -> None:
    github.add_runner("o/r", "r1")
    github.reset_header = reset
    assert [r["name"] for r in await gh.runners("o/r")] == ["r1"]
    assert gh.rate == {} or isinstance(gh.rate["reset_at"], str)


@pytest.mark.parametrize("status", [403, 429])
async def test_a_rate_limit_refusal_is_not_retried_in_a_loop(github: FakeGitHub, gh: GitHub,
                                                             status: int) -> None:
    github.hijack = serve("/actions/runners", '{"message": "slow down"}', status=status,
                          headers={"Retry-After": "-99999999999999999999",
                                   "X-RateLimit-Remaining": "0", "X-RateLimit-Limit": "x"})
    with pytest.raises(GitHubError) as caught:
        await gh.runners("o/r")
    assert caught.value.status == status and requests_to(github, "/actions/runners") == 1


# --- tokens -------------------------------------------------------------------------------

@pytest.mark.parametrize("token", ["A\ud800B", "A\x00B", "A\nB"])
async def test_a_removal_token_that_cannot_be_handed_on_is_refused(
        host: Host, client: Any, token: str) -> None:
    host.add_runner("r1")
    await until(lambda: _registered(client, "r1"))
    host.github.hijack = serve("/remove-token", json.dumps({"token": token}), status=201)
    resp = await client.post("/api/action", json={"id": "runner.deregister",
                                                   "args": {"name": "r1"}},
                             headers=auth(cp_of(client)))
    body = await resp.json()
    assert resp.status == 503 and "remove token" in body["error"], body
    assert "r1" in host.github.repos["octo/app"]["runners"]


async def _registered(client: Any, name: str) -> bool:
    views = (await (await client.get("/api/state")).json())["runners"]
    return any(v["name"] == name and v["registration"] == "registered" for v in views)


async def test_links_the_pages_show_are_web_addresses_only(host: Host) -> None:
    """A run's html_url (GitHub's answer) and a runner's gitHubUrl (its .runner file) became
    links on the overview and runner pages as they were: `javascript:` ones too, stopped only
    by the page's Content-Security-Policy. Anything but an http(s) URL is no link now."""
    env = {**host.full_env(), "FLEET_WATCH_REPOS": "o/r"}
    runner_dir = host.add_runner("r1", repo="o/r")
    runner_file = runner_dir / ".runner"
    data = json.loads(runner_file.read_text(encoding="utf-8-sig"))
    runner_file.write_text(json.dumps({**data, "gitHubUrl": "javascript:alert(1)//github.com/o/r"}),
                           encoding="utf-8")
    run = host.github.add_run("o/r", "in_progress", "2026-01-01T00:00:00Z", ["self-hosted"],
                              "r1")
    good = host.github.add_run("o/r", "queued", "2026-01-01T00:00:00Z", ["self-hosted"])
    host.github.repo("o/r")["runs"][-2]["html_url"] = "JavaScript:alert(document.domain)"
    async with open_parts(host, env) as parts:
        snapshots = Snapshots(parts.plane, parts.supervisor, parts.github, parts.hub)
        await GitHubSync(parts.plane, parts.github, snapshots).refresh()
        built = await snapshots.rebuild()
        urls = {r["id"]: r["url"] for r in built["active_runs"]}
        assert urls[run] is None and urls[good].startswith("https://github.com/o/r/")
        assert [r["url"] for r in built["runners"] if r["name"] == "r1"] == [None]
    for text, kept in (("https://github.com/o/r", True), ("http://ghe.lan/o/r", True),
                       (" javascript:alert(1)", False), ("java\tscript:alert(1)", False),
                       ("data:text/html,x", False), ("/o/r", False), ("https://", False),
                       ("", False), (None, False)):
        assert link_url(text) == (text if kept else None), text

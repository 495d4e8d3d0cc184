"""Job-history collection against the fake GitHub API: the 30-day backfill, idempotent rounds
and restarts, incremental updates, re-run attempts, listing windows past GitHub's 1,000-run cap,
and the per-round budget."""

from __future__ import annotations

import itertools
import sys
import time

from fleet_min.controlplane.github.client import GitHub
from fleet_min.controlplane.github.history import HistoryCollector, status
from fleet_min.db import Database
from tests.support import history_gen
from tests.support.fake_github import TOKEN, FakeGitHub

REPO = "octo/app"


def job_requests(github: FakeGitHub) -> int:
    return sum(1 for _, path, _ in github.log if "/jobs" in path)


async def stored(db: Database) -> set[int]:
    return {row["job_id"] for row in await db.read("SELECT job_id FROM jobs")}


async def test_backfill_stores_30_days_of_jobs_with_steps_once(
        github: FakeGitHub, gh: GitHub, db: Database) -> None:
    end = time.time()
    history = history_gen.generate(REPO, end, 40, ids=itertools.count(10_000))
    github.load_history(history)
    collector = HistoryCollector(gh, db, 30, time.time, runs_per_round=10_000)
    await collector.round([REPO])
    since = history_gen.iso(end - 30 * 86400)
    expected = {j["id"] for r in history.runs if r["created_at"] >= since
                for j in history.jobs[r["id"]]}
    assert await stored(db) == expected  # every attempt of every run in the window
    row = await db.read_one("SELECT * FROM jobs WHERE name = 'e2e (chromium)' LIMIT 1")
    assert row is not None and "playwright install" in row["steps"]
    assert row["runner"].startswith("app-") and row["run_attempt"] >= 1
    [state] = await status(db, [REPO])
    assert state["backfill_complete"] and state["pending_runs"] == 0
    assert state["runs_fetched"] == sum(1 for r in history.runs if r["created_at"] >= since)

    # A second round and a restart (a new collector and client) fetch no job again.
    before = job_requests(github)
    await collector.round([REPO])
    restarted = HistoryCollector(GitHub(github.url, TOKEN), db, 30, time.time)
    try:
        await restarted.round([REPO])
    finally:
        await restarted.github.close()
    assert job_requests(github) == before
    assert await stored(db) == expected


async def test_incremental_rounds_pick_up_new_runs_and_reruns(
        github: FakeGitHub, gh: GitHub, db: Database) -> None:
    end = time.time() - 3 * 3600
    history = history_gen.generate(REPO, end, 5, ids=itertools.count(20_000))
    github.load_history(history)
    collector = HistoryCollector(gh, db, 30, time.time)
    await collector.round([REPO])
    first = await stored(db)
    fresh = history_gen.generate(REPO, time.time(), 1, ids=itertools.count(90_000), seed=9)
    newest = [r for r in fresh.runs if r["created_at"] > history_gen.iso(end)][:3]
    github.repo(REPO)["runs"] += newest
    github.repo(REPO)["jobs"].update({r["id"]: fresh.jobs[r["id"]] for r in newest})
    # A re-run of a recent run: same run id, attempt 2, new job ids. (A re-run of a run created
    # before the look-back overlap is not seen: GitHub lists runs by creation time only.)
    old = history.runs[0]
    old["run_attempt"] += 1
    again = [{**job, "id": job["id"] + 1_000_000, "run_attempt": old["run_attempt"]}
             for job in history.jobs[old["id"]] if job["run_attempt"] == 1]
    github.repo(REPO)["jobs"][old["id"]] = history.jobs[old["id"]] + again
    before = job_requests(github)
    await collector.round([REPO])
    now_stored = await stored(db)
    added = {j["id"] for r in newest for j in fresh.jobs[r["id"]]} | {j["id"] for j in again}
    assert now_stored == first | added
    assert job_requests(github) - before == len(newest) + 1


async def test_windows_with_more_than_1000_runs_are_split(
        github: FakeGitHub, gh: GitHub, db: Database) -> None:
    day = (int(time.time()) // 86400 - 2) * 86400
    repo = github.repo(REPO)
    for n in range(1500):  # a very busy day: 1,500 runs, one job each
        created = history_gen.iso(day + 30 + n * 50)
        repo["runs"].append({"id": n + 1, "name": "CI", "status": "completed",
                             "created_at": created, "run_attempt": 1, "event": "push"})
        repo["jobs"][n + 1] = [{"id": 100_000 + n, "run_id": n + 1, "name": "build",
                                "status": "completed", "conclusion": "success",
                                "created_at": created, "started_at": created,
                                "completed_at": created, "labels": ["self-hosted"],
                                "runner_name": "r1", "steps": []}]
    collector = HistoryCollector(gh, db, 30, time.time, runs_per_round=10_000)
    runs = await collector.list_runs(REPO, day - 86400, time.time())
    assert len(runs) == 1500 and len({r.run_id for r in runs}) == 1500


async def test_a_round_fetches_at_most_its_budget_and_spares_the_rate_limit(
        github: FakeGitHub, gh: GitHub, db: Database) -> None:
    github.load_history(history_gen.generate(REPO, time.time(), 3, ids=itertools.count(1)))
    collector = HistoryCollector(gh, db, 30, time.time, runs_per_round=10)
    await collector.round([REPO])
    [state] = await status(db, [REPO])
    assert state["runs_fetched"] == 10 and state["pending_runs"] > 0
    assert not state["backfill_complete"]
    github.remaining = 100  # under a tenth of the 5,000 limit: jobs wait for a fuller budget
    before = job_requests(github)
    await collector.round([REPO])
    assert job_requests(github) <= before + 1  # the one answer that tells the rate
    await collector.round([REPO])
    assert job_requests(github) <= before + 1


async def test_an_unreachable_repository_is_reported_not_raised(
        gh: GitHub, db: Database) -> None:
    collector = HistoryCollector(gh, db, 30, time.time)
    await collector.round(["octo/missing"])
    [state] = await status(db, ["octo/missing"])
    assert "404" in (state["error"] or "") and not state["backfill_complete"]


def held_bytes(value: object, seen: set[int] | None = None) -> int:
    """The memory `value` holds: its own size and, once each, that of every container item
    and string reached from it."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        size += sum(held_bytes(k, seen) + held_bytes(v, seen) for k, v in value.items())
    elif isinstance(value, list | tuple):
        size += sum(held_bytes(item, seen) for item in value)
    return size


async def test_runs_waiting_for_their_jobs_are_held_without_their_names(
        github: FakeGitHub, gh: GitHub, db: Database) -> None:
    """A long backfill waits hours for its runs' jobs, a round's budget at a time: what waits
    is each run's id, attempt, creation time, event and branch, not the run as listed (whose
    name GitHub, or what answers in its place, may make 300 KB long)."""
    day = (int(time.time()) // 86400 - 2) * 86400
    repo = github.repo(REPO)
    runs = 20  # of 600 KB each: a page stays under the client's 16 MiB answer cap
    for n in range(runs):
        created = history_gen.iso(day + 30 + n * 50)
        repo["runs"].append({"id": n + 1, "name": "N" * 300_000 + str(n), "status": "completed",
                             "created_at": created, "run_attempt": 1, "event": "push",
                             "head_branch": "main", "path": "P" * 300_000})
        repo["jobs"][n + 1] = [{"id": 100_000 + n, "run_id": n + 1, "name": "build",
                                "status": "completed", "conclusion": "success",
                                "created_at": created, "labels": ["self-hosted"], "steps": []}]
    collector = HistoryCollector(gh, db, 30, time.time, runs_per_round=1)
    await collector.round([REPO])
    [state] = await status(db, [REPO])
    assert state["runs_fetched"] == 1 and state["pending_runs"] == runs - 1
    waiting = collector._pending[REPO].runs
    assert len(waiting) == runs - 1
    # A record is a tuple of two ints, a float and two strings shared by all the runs: about
    # 150 bytes each (as listed, with the name and path cut to 500, it was some 3 KB).
    assert held_bytes(waiting) < 300 * runs, held_bytes(waiting)
    # The job fetched first is the newest run's, stored with the event and branch of its run.
    [row] = await db.read("SELECT run_id, event, head_branch FROM jobs")
    assert (row["run_id"], row["event"], row["head_branch"]) == (runs, "push", "main")

"""Every analysis endpoint against one real daemon process fed by the fake GitHub API with weeks
of generated history (tests/support/history_gen.py).

The daemon backfills octo/app (35 days generated, 30 fetched) and octo/lib (12 days) over HTTP
once for the module; each test then checks one endpoint's figures against an independent
computation from the generated data, and its refusals.
"""

from __future__ import annotations

import itertools
import json
import math
import sqlite3
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import aiohttp
import pytest

from fleet_min.timeutil import iso, parse_iso
from tests.support import cp_fakes as fakes
from tests.support import history_gen
from tests.support.controlplane import Daemon, Host, until
from tests.support.fake_github import FakeGitHub

pytestmark = pytest.mark.slow

APP, LIB = "octo/app", "octo/lib"
BILLING = {"total_minutes_used": 1234, "total_paid_minutes_used": 34, "included_minutes": 3000,
           "minutes_used_breakdown": {"UBUNTU": 1200, "MACOS": 34}}


@dataclass
class World:
    github: FakeGitHub
    host: Host
    daemon: Daemon
    app: history_gen.History
    lib: history_gen.History

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.daemon.url + path, timeout=30) as resp:
            return json.loads(resp.read())

    def db(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.host.state / "controlplane.db", timeout=30)
        conn.row_factory = sqlite3.Row
        return conn


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    github = FakeGitHub()
    github.start()
    end = time.time()
    app = history_gen.generate(APP, end, 35, runners=3, seed=7,
                               ids=itertools.count(5_000_000))
    lib = history_gen.generate(LIB, end, 12, runners=1, seed=11,
                               ids=itertools.count(8_000_000))
    github.load_history(app)
    github.load_history(lib)
    github.repo(APP)["files"].update(history_gen.WORKFLOW_FILES)
    github.accounts.update({"octo": "Organization", "acme": "User"})
    github.billing["octo"] = BILLING
    host = Host(tmp_path_factory.mktemp("analysis"), github)
    for name in ("app-1", "app-2"):
        host.add_runner(name, repo=APP, labels=["linux"])
    host.add_runner("lib-1", repo=LIB, labels=["linux"])
    host.add_runner("tools-1", repo="octo/tools", labels=["linux"], status="offline")
    github.repo("octo/docs")
    github.repo("acme/site")
    github.hidden_runners.add("acme/site")
    host.env.update({"FLEET_HISTORY_S": "0.5", "FLEET_WORKFLOWS_S": "1", "FLEET_CEILING": "8",
                     "FLEET_WATCH_REPOS": "octo/docs,acme/site"})
    daemon = Daemon(host)
    world = World(github, host, daemon, app, lib)
    deadline = time.monotonic() + 90
    while True:
        history = {h["repo"]: h for h in world.get("/api/analytics")["history"]}
        if all(history.get(r, {}).get("backfill_complete") for r in (APP, LIB)):
            break
        assert time.monotonic() < deadline, history
        time.sleep(0.2)
    yield world
    daemon.stop()
    fakes.kill_all_listeners(host.root)
    github.stop()


def fetched_jobs(history: history_gen.History, backfill_since: str) -> list[dict[str, Any]]:
    """The generated jobs the daemon fetched: those of runs created since the backfill start."""
    since = parse_iso(backfill_since)
    return [job for run in history.runs if parse_iso(run["created_at"]) >= since
            for job in history.jobs[run["id"]]]


def t(job: dict[str, Any], key: str) -> float:
    return parse_iso(job[key])


def nearest_rank(values: list[float], pct: int) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(pct / 100 * len(ordered))) - 1]


# --- analytics ---------------------------------------------------------------------------------

async def test_analytics_figures_match_the_generated_history(world: World) -> None:
    body = world.get("/api/analytics")
    assert body["days"] == 30 and body["until"].endswith("Z")
    history = {h["repo"]: h for h in body["history"]}
    assert set(history) == {APP, LIB, "octo/tools", "octo/docs", "acme/site"}
    app = next(r for r in body["repos"] if r["repo"] == APP)
    since = parse_iso(body["since"])
    jobs = [j for j in fetched_jobs(world.app, history[APP]["backfill_since"])
            if t(j, "completed_at") >= since]
    assert app["jobs"] == len(jobs)
    durations = [t(j, "completed_at") - t(j, "started_at") for j in jobs]
    assert app["duration_s"]["p50"] == round(nearest_rank(durations, 50), 1)
    assert app["duration_s"]["p95"] == round(nearest_rank(durations, 95), 1)
    queues = [t(j, "started_at") - t(j, "created_at") for j in jobs]
    assert app["queue_s"]["p95"] == round(nearest_rank(queues, 95), 1)
    failed = sum(j["conclusion"] == "failure" for j in jobs)
    decided = sum(j["conclusion"] in ("success", "failure") for j in jobs)
    assert app["failure_rate"] == round(failed / decided, 4)
    assert {r["repo"] for r in body["repos"]} == {APP, LIB}

    browser = body["browser_test"]
    installs = [s for j in jobs for s in j["steps"]
                if "playwright install" in s["name"] or "setup-chrome" in s["name"]]
    lib_since = history[LIB]["backfill_since"]
    installs += [s for j in fetched_jobs(world.lib, lib_since) if t(j, "completed_at") >= since
                 for s in j["steps"]
                 if "playwright install" in s["name"] or "setup-chrome" in s["name"]]
    assert browser["install_steps"]["count"] == len(installs)
    names = {n["name"] for n in browser["install_steps"]["by_name"]}
    assert names == {"Run npx playwright install --with-deps chromium",
                     "Run browser-actions/setup-chrome@v1"}
    e2e = {(j["repo"], j["name"]) for j in browser["e2e_jobs"]["by_job"]}
    assert e2e == {(APP, "e2e (chromium)"), (APP, "browsers"), (LIB, "e2e (chromium)"),
                   (LIB, "browsers")}
    assert 0 < browser["e2e_jobs"]["success_rate"] < 1

    week = world.get("/api/analytics?days=7")
    assert next(r for r in week["repos"] if r["repo"] == APP)["jobs"] < app["jobs"]
    assert world.get("/api/analytics?days=365")["days"] == 365


@pytest.mark.parametrize("query", ["days=0", "days=366", "days=abc", "days=-1", "days=",
                                   "days=1.5", "days=%207", "days=1e2"])
async def test_analytics_refuses_bad_days(world: World, http: aiohttp.ClientSession,
                                          query: str) -> None:
    async with http.get(f"{world.daemon.url}/api/analytics?{query}") as resp:
        assert resp.status == 400
        assert "days must be a whole number from 1 to 365" in (await resp.json())["error"]


# --- repository detail -------------------------------------------------------------------------

async def test_repo_detail_and_its_concurrency_peak(world: World,
                                                    http: aiohttp.ClientSession) -> None:
    body = world.get(f"/api/repo?name={APP}")
    since = parse_iso(body["since"])
    jobs = [j for j in fetched_jobs(world.app, body["history"]["backfill_since"])
            if t(j, "completed_at") >= since]
    assert body["jobs"] == len(jobs) and body["days"] == 30
    events = sorted([(t(j, "started_at"), 1) for j in jobs]
                    + [(t(j, "completed_at"), -1) for j in jobs])
    peak = max(itertools.accumulate(delta for _, delta in events))
    assert body["concurrency_peak"]["jobs"] == peak
    assert {w["workflow"] for w in body["workflows"]} >= {"CI", "Docs", "Nightly"}
    assert {r["name"] for r in body["runners"]} == {"app-1", "app-2"}
    assert {r["name"] for r in body["registered"]} == {"app-1", "app-2"}
    watched_empty = world.get("/api/repo?name=octo/docs")
    assert watched_empty["jobs"] == 0 and watched_empty["concurrency_peak"]["jobs"] == 0
    for query, status in (("name=octo/nothing", 404), ("name=octo", 400), ("", 400),
                          ("name=a/b/c", 400), ("name=../etc", 400)):
        async with http.get(f"{world.daemon.url}/api/repo?{query}") as resp:
            assert resp.status == status, query
            assert isinstance((await resp.json())["error"], str)


# --- queue causes ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def queued(world: World) -> dict[str, int]:
    """One queued run per cause (host-saturated needs a lower ceiling: the test sets it)."""
    gh, now = world.github, iso(time.time() - 200)
    assert now is not None
    world.host.start_unit("app-1", APP)   # idle and usable
    world.host.start_unit("lib-1", LIB)
    gh.repos[LIB]["runners"]["lib-1"]["busy"] = True  # GitHub gave it a job
    runs = {
        "label-mismatch": gh.add_run(APP, "queued", now, ["self-hosted", "gpu"]),
        "github-hosted": gh.add_run(APP, "queued", now, ["ubuntu-latest"], name="Docs"),
        "concurrency-block": gh.add_run(APP, "pending", now, ["self-hosted", "linux"],
                                        name="Deploy"),
        "github-delay": gh.add_run(APP, "queued", now, ["self-hosted", "linux"]),
        "repo-at-capacity": gh.add_run(LIB, "queued", now, ["self-hosted", "linux"]),
        "runner-down": gh.add_run("octo/tools", "queued", now, ["self-hosted", "linux"]),
        "unserved": gh.add_run("octo/docs", "queued", now, ["self-hosted"]),
        "telemetry-unavailable": gh.add_run("acme/site", "queued", now, ["self-hosted"]),
    }
    return runs


async def _causes(world: World, want: int) -> dict[int, dict[str, Any]] | None:
    body = world.get("/api/queue-causes")
    causes = {c["run_id"]: c for c in body["queue_causes"]}
    return causes if len(causes) >= want else None


async def test_queue_causes_of_every_kind_in_the_daemon(world: World, queued: dict[str, int],
                                                        http: aiohttp.ClientSession) -> None:
    causes = await until(lambda: _causes(world, len(queued)), timeout=30)
    for expected, run_id in queued.items():
        assert causes[run_id]["cause"] == expected, (expected, causes[run_id])
    capacity = causes[queued["repo-at-capacity"]]
    assert capacity["recommendation"]["action"] == {"id": "runner.duplicate",
                                                   "args": {"name": "lib-1"}}
    assert "acme/site" in causes[queued["telemetry-unavailable"]]["message"]
    snapshot = world.get("/api/state")
    assert {c["run_id"] for c in snapshot["queue_causes"]} == set(causes)
    # With the ceiling at the runners this host has, the busy repository is host-saturated.
    headers = world.daemon.headers()
    async with http.post(f"{world.daemon.url}/api/settings", json={"key": "ceiling",
                         "value": 4}, headers=headers) as resp:
        assert resp.status == 200

    async def saturated() -> bool:
        found = await _causes(world, len(queued))
        return bool(found and found[queued["repo-at-capacity"]]["cause"] == "host-saturated")
    await until(saturated, timeout=30)
    async with http.post(f"{world.daemon.url}/api/settings", json={"key": "ceiling",
                         "reset": True}, headers=headers) as resp:
        assert resp.status == 200


# --- concurrency findings ----------------------------------------------------------------------

async def test_concurrency_findings_from_cached_workflow_files(world: World) -> None:
    body = world.get("/api/concurrency")
    repo = next(r for r in body["repos"] if r["repo"] == APP)
    assert repo["default_branch"] == "main" and repo["files"] == 7 and not repo["parse_errors"]
    kinds = {f["kind"] for f in body["findings"] if f["repo"] == APP}
    assert kinds == {"matrix-exceeds-runners", "unbounded-matrix", "missing-concurrency",
                     "static-group-collision"}
    exceeds = next(f for f in body["findings"] if f["kind"] == "matrix-exceeds-runners")
    assert exceeds["runners"] == 2 and exceeds["matrix_size"] == 5
    # A changed file is fetched again (and only it); a broken one is reported, not fatal.
    world.github.repo(APP)["files"][".github/workflows/broken.yml"] = "jobs: [oops"
    mark = len(world.github.log)

    def refreshed() -> dict[str, Any] | None:
        found = world.get("/api/concurrency")
        app = next(r for r in found["repos"] if r["repo"] == APP)
        return found if app["parse_errors"] else None
    found = await until(refreshed, timeout=30)
    app = next(r for r in found["repos"] if r["repo"] == APP)
    assert app["files"] == 8 and app["parse_errors"][0]["file"].endswith("broken.yml")
    downloads = {p for _, p, s in world.github.log[mark:] if "/contents/.github/workflows/" in p
                 and s == 200}
    assert all("broken.yml" in p for p in downloads)


# --- simulation --------------------------------------------------------------------------------

async def test_simulation_replays_the_recorded_jobs(world: World,
                                                    http: aiohttp.ClientSession) -> None:
    body = {"repo": APP, "runnerCounts": [1, 2, 3, 6], "sloSec": 120}
    async with http.post(f"{world.daemon.url}/api/simulate", json=body) as resp:
        assert resp.status == 200
        first = await resp.json()
    async with http.post(f"{world.daemon.url}/api/simulate", json=body) as resp:
        again = await resp.json()
    assert {k: v for k, v in first.items() if k not in ("generated_at", "since")} == \
        {k: v for k, v in again.items() if k not in ("generated_at", "since")}  # deterministic
    assert first["self_hosted_only"] and [r["runners"] for r in first["results"]] == [1, 2, 3, 6]
    p95 = [r["wait_s"]["p95"] for r in first["results"]]
    assert p95 == sorted(p95, reverse=True) and p95[0] > p95[-1]
    over = [r["over_slo"] for r in first["results"]]
    assert over == sorted(over, reverse=True)
    # The generator queued these jobs on 3 runners: the replay with 3 agrees with the record.
    three = first["results"][2]["wait_s"]["p95"]
    assert abs(three - first["recorded"]["wait_s"]["p95"]) <= 0.25 * first["recorded"][
        "wait_s"]["p95"] + 30
    history = {h["repo"]: h for h in world.get("/api/analytics")["history"]}
    since = parse_iso(again["since"])
    self_hosted = [j for j in fetched_jobs(world.app, history[APP]["backfill_since"])
                   if "self-hosted" in j["labels"] and t(j, "completed_at") >= since]
    assert first["jobs"] == len(self_hosted)


@pytest.mark.parametrize(("body", "status"), [
    ({"runnerCounts": [1], "sloSec": 60}, 400),
    ({"repo": "octo", "runnerCounts": [1], "sloSec": 60}, 400),
    ({"repo": "a/b/c", "runnerCounts": [1], "sloSec": 60}, 400),
    ({"repo": APP, "runnerCounts": 3, "sloSec": 60}, 400),
    ({"repo": APP, "runnerCounts": [], "sloSec": 60}, 400),
    ({"repo": APP, "runnerCounts": [-1], "sloSec": 60}, 400),
    ({"repo": APP, "runnerCounts": [True], "sloSec": 60}, 400),
    ({"repo": APP, "runnerCounts": [1.5], "sloSec": 60}, 400),
    ({"repo": APP, "runnerCounts": [10**9], "sloSec": 60}, 400),
    ({"repo": APP, "runnerCounts": list(range(17)), "sloSec": 60}, 400),
    ({"repo": APP, "runnerCounts": [1]}, 400),
    ({"repo": APP, "runnerCounts": [1], "sloSec": "60"}, 400),
    ({"repo": APP, "runnerCounts": [1], "sloSec": 60, "days": 0}, 400),
    ({"repo": "octo/nothing", "runnerCounts": [1], "sloSec": 60}, 404),
])
async def test_simulation_refusals(world: World, http: aiohttp.ClientSession,
                                   body: dict[str, Any], status: int) -> None:
    async with http.post(f"{world.daemon.url}/api/simulate", json=body) as resp:
        assert resp.status == status, await resp.text()
        assert isinstance((await resp.json())["error"], str)


async def test_simulation_refuses_other_sites_and_huge_bodies(world: World,
                                                              http: aiohttp.ClientSession
                                                              ) -> None:
    body = {"repo": APP, "runnerCounts": [1], "sloSec": 60}
    async with http.post(f"{world.daemon.url}/api/simulate", json=body,
                         headers={"Origin": "http://evil.example"}) as resp:
        assert resp.status == 403
    async with http.post(f"{world.daemon.url}/api/simulate",
                         data=b'{"repo": "' + b"x" * (2 << 20) + b'"}') as resp:
        assert resp.status == 413


# --- forecast ----------------------------------------------------------------------------------

def slot_peak(jobs: list[dict[str, Any]], start: float) -> int:
    end = start + 3600
    events = []
    for job in jobs:
        a, b = max(t(job, "created_at"), start), min(t(job, "completed_at"), end)
        if a < b:
            events += [(a, 1), (b, -1)]
    events.sort()
    return max(itertools.accumulate((d for _, d in events)), default=0)


async def test_forecast_from_weekly_history_and_schedules(world: World) -> None:
    body = world.get("/api/forecast")
    hour = parse_iso(body["hour_start"])
    assert hour % 3600 == 0 and hour > time.time()
    app = next(r for r in body["repos"] if r["repo"] == APP)
    past, scheduled = app["predictions"]
    history = {h["repo"]: h for h in world.get("/api/analytics")["history"]}
    # The history starts at the backfill's start or the oldest run fetched, whichever is later.
    covered = max(parse_iso(history[APP]["backfill_since"]),
                  parse_iso(history[APP]["oldest_run_at"]))
    demand = [j for j in fetched_jobs(world.app, history[APP]["backfill_since"])
              if "self-hosted" in j["labels"] and j["conclusion"] != "skipped"]
    weeks = [hour - w * 7 * 86400 for w in range(1, 9) if hour - w * 7 * 86400 >= covered]
    assert past["weeks"] == len(weeks) and len(weeks) in (3, 4)  # 30 days: 4, or 3 after a
    assert past["confidence"] == ("medium" if len(weeks) == 4 else "low")  # quiet weekend
    peaks = [slot_peak(demand, start) for start in weeks]
    assert [w["peak"] for w in past["weekly_peaks"]] == peaks
    assert past["value"] == statistics.median(peaks)
    # The nightly schedule: 03:30 Europe/Berlin on weekdays.
    berlin = datetime.fromtimestamp(hour, UTC).astimezone(ZoneInfo("Europe/Berlin"))
    due = [berlin + timedelta(minutes=m) for m in range(60)]
    expected = [d for d in due if (d.hour, d.minute) == (3, 30) and d.weekday() < 5]
    assert len(scheduled["runs"]) == len(expected)
    assert scheduled["value"] == (2 if expected else 0)
    assert app["expected"]["value"] == max(past["value"], scheduled["value"])
    lib = next(r for r in body["repos"] if r["repo"] == LIB)
    assert lib["predictions"][0]["value"] is None
    assert "3 are needed" in lib["predictions"][0]["reason"]
    with world.db() as conn:
        stored = conn.execute("SELECT source FROM forecasts WHERE repo = ? AND hour_start = ?",
                              (APP, hour)).fetchall()
    assert {row[0] for row in stored} == {"history", "schedule", "combined"}


async def test_past_predictions_are_scored_against_what_happened(world: World) -> None:
    history = {h["repo"]: h for h in world.get("/api/analytics")["history"]}
    base = (int(time.time()) // 3600 - 75) * 3600  # hours of three days ago
    made = [(APP, base + k * 3600, "combined", float(k % 3), "medium", base - 60, "{}")
            for k in range(6)]
    with world.db() as conn:
        conn.executemany("INSERT OR REPLACE INTO forecasts (repo, hour_start, source, predicted, "
                         "confidence, made_at, detail) VALUES (?, ?, ?, ?, ?, ?, ?)", made)
    body = world.get("/api/forecast")
    score = next(s for s in body["scores"] if s["repo"] == APP)
    demand = [j for j in fetched_jobs(world.app, history[APP]["backfill_since"])
              if "self-hosted" in j["labels"] and j["conclusion"] != "skipped"]
    actual = {iso(start): slot_peak(demand, start) for _, start, *_ in made}
    recent = {r["hour_start"]: r for r in score["recent"]}
    for hour_start, peak in actual.items():
        assert recent[hour_start]["actual"] == peak, hour_start
    errors = [abs(p - actual[iso(h)]) for _, h, _, p, *_ in made]
    assert score["scored"] == 6 and score["mae"] == round(sum(errors) / 6, 2)


# --- autoscale ---------------------------------------------------------------------------------

async def _setting(world: World, http: aiohttp.ClientSession, key: str, value: Any) -> None:
    async with http.post(f"{world.daemon.url}/api/settings", json={"key": key, "value": value},
                         headers=world.daemon.headers()) as resp:
        assert resp.status == 200, await resp.text()


def _decisions(world: World, **match: Any) -> list[dict[str, Any]] | None:
    found = [d for d in world.get("/api/autoscale")["decisions"]
             if all(d.get(k) == v for k, v in match.items())]
    return found or None


async def test_autoscale_off_then_dry_run_then_execute_then_scale_down(
        world: World, queued: dict[str, int], http: aiohttp.ClientSession) -> None:
    body = world.get("/api/autoscale")
    assert (body["enabled"], body["mode"], body["decisions"]) == (False, "dry-run", [])
    # octo/app has 2 runners: at this limit its forecast-driven proposals (which depend on the
    # hour the test runs at) are refused, so only octo/lib's queue drives what runs here.
    await _setting(world, http, "max_per_repo", 2)
    await _setting(world, http, "autoscale", "on")
    proposed = await until(lambda: _decisions(world, repo=LIB, outcome="proposed"), timeout=30)
    assert proposed[0]["action"] == {"id": "runner.duplicate", "args": {"name": "lib-1"}}
    assert proposed[0]["direction"] == "up" and proposed[0]["mode"] == "dry-run"
    assert not (world.host.root / "lib-2").exists()  # dry-run: nothing ran
    await _setting(world, http, "autoscale_mode", "execute")
    executed = await until(lambda: _decisions(world, repo=LIB, outcome="executed"), timeout=60)
    assert executed[0]["result"]["ok"] and executed[0]["result"]["runner"] == "lib-2"
    assert (world.host.root / "lib-2" / ".runner").exists()
    assert "lib-2" in world.github.repos[LIB]["runners"]
    with world.db() as conn:
        who = conn.execute("SELECT who FROM audit WHERE action = 'runner.duplicate'").fetchone()
    assert who[0] == "autoscale"
    # The new runner takes a job too: the queue is back at capacity, and the cooldown says no.
    world.github.repos[LIB]["runners"]["lib-2"]["busy"] = True
    await until(lambda: _decisions(world, repo=LIB, outcome="refused"), timeout=30)
    refused = _decisions(world, repo=LIB, outcome="refused") or []
    assert any("cooldown" in r for r in refused[0]["reasons"])
    # The queue empties and the duplicate idles: with no idle threshold and no cooldown it goes.
    world.github.repos[LIB]["runs"].clear()
    world.github.repos[LIB]["runners"]["lib-1"]["busy"] = False
    world.github.repos[LIB]["runners"]["lib-2"]["busy"] = False
    await _setting(world, http, "autoscale_idle_s", 0)
    await _setting(world, http, "autoscale_cooldown_s", 0)
    down = await until(lambda: _decisions(world, repo=LIB, direction="down",
                                          outcome="executed"), timeout=60)
    assert down[0]["action"]["args"] == {"name": "lib-2", "delete_dir": True}
    assert not (world.host.root / "lib-2").exists()
    assert (world.host.root / "lib-1").exists()  # never the original
    await _setting(world, http, "autoscale", "off")
    assert not _decisions(world, repo=APP, outcome="executed")


# --- admission and billing ---------------------------------------------------------------------

async def test_admission_decisions_from_the_hook_log(world: World,
                                                     http: aiohttp.ClientSession) -> None:
    hook = Path(__file__).resolve().parents[2] / "deploy" / "controlplane" / "job-started.sh"
    loadavg = world.host.tmp / "loadavg"
    loadavg.write_text("0.10 0.10 0.10 1/100 1\n")
    env = {"PATH": world.host.env["PATH"], "HOME": str(world.host.home),
           "FLEET_ADMISSION_LOG": str(world.host.state / "admission.log"),
           "FLEET_ADMIT_LOADAVG_FILE": str(loadavg), "RUNNER_NAME": "app-1",
           "GITHUB_REPOSITORY": APP, "GITHUB_RUN_ID": "77", "GITHUB_JOB": "build"}
    for _ in range(3):
        subprocess.run(["bash", "-e", str(hook)], env=env, check=True, timeout=30)
    body = world.get("/api/admission?limit=2")
    assert body["totals"]["admitted"] == 3 and len(body["decisions"]) == 2
    assert body["decisions"][0] == {**body["decisions"][0], "decision": "admitted",
                                    "runner": "app-1", "repo": APP, "run_id": 77}
    assert len(world.get("/api/admission")["decisions"]) == 3
    for query in ("limit=0", "limit=501", "limit=x", "limit=", "limit=-5", "limit=2.0"):
        async with http.get(f"{world.daemon.url}/api/admission?{query}") as resp:
            assert resp.status == 400, query


async def test_billing_per_owner_when_the_token_may_read_it(world: World) -> None:
    body = world.get("/api/billing")
    owners = {o["owner"]: o for o in body["owners"]}
    assert body["available"] is True
    assert owners["octo"]["type"] == "Organization"
    assert owners["octo"]["total_minutes_used"] == 1234
    assert owners["octo"]["minutes_used_breakdown"] == {"UBUNTU": 1200, "MACOS": 34}
    assert owners["acme"]["available"] is False and "scope" in owners["acme"]["reason"]


async def test_hosts_lists_this_host_with_its_runners(world: World) -> None:
    body = world.get("/api/hosts")
    [here] = body["hosts"]
    assert here["role"] == "coordinator" and here["stale"] is False
    assert {r["name"] for r in here["runners"]} >= {"app-1", "app-2", "lib-1", "tools-1"}

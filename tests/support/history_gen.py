"""Weeks of generated but realistic GitHub Actions history for the fake GitHub API.

Deterministic for a seed and an end time. What makes it realistic enough to test analytics,
simulation and forecast against:
- pushes arrive as a Poisson process whose rate follows the working week: busy weekday
  daytimes (UTC 08-18), quiet nights, a trickle at weekends;
- each push runs the CI workflow (lint, build, unit tests, an end-to-end browser job that
  installs Playwright) on self-hosted runners, and one in four the Docs workflow on a
  GitHub-hosted image;
- a nightly scheduled workflow (cron, Europe/Berlin) and an occasional matrix workflow;
- durations are log-normal around each job's median; failures (about 7 %) end early, a few
  jobs are cancelled, and some failed runs are re-run (a second attempt with new job ids);
- queue times come from replaying the self-hosted jobs first come, first served on the
  repository's runner count (plus a few seconds of dispatch), so they are consistent with the
  concurrency the jobs really had.
The workflow files served for the same repository match these jobs.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

HOUR = 3600
DAY = 86400


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class JobSpec:
    name: str
    labels: tuple[str, ...]
    median_s: float
    steps: tuple[tuple[str, float], ...]  # (name, share of the job's time)


@dataclass(frozen=True)
class FlowSpec:
    name: str
    path: str
    event: str
    jobs: tuple[JobSpec, ...]


SELF = ("self-hosted", "linux")
CI = FlowSpec("CI", ".github/workflows/ci.yml", "push", (
    JobSpec("lint", SELF, 90, (("Run actions/checkout@v4", 0.1), ("Run npm ci", 0.4),
                                ("Run npm run lint", 0.5))),
    JobSpec("build", SELF, 360, (("Run actions/checkout@v4", 0.05), ("Run npm ci", 0.25),
                                  ("Run npm run build", 0.7))),
    JobSpec("unit tests", SELF, 420, (("Run actions/checkout@v4", 0.05), ("Run npm ci", 0.2),
                                       ("Run npm test", 0.75))),
    JobSpec("e2e (chromium)", SELF, 600, (
        ("Run actions/checkout@v4", 0.03), ("Run npm ci", 0.12),
        ("Run npx playwright install --with-deps chromium", 0.2),
        ("Run npx playwright test", 0.65))),
))
DOCS = FlowSpec("Docs", ".github/workflows/docs.yml", "push", (
    JobSpec("publish", ("ubuntu-latest",), 120, (("Run actions/checkout@v4", 0.2),
                                                 ("Run mkdocs build", 0.8))),))
NIGHTLY = FlowSpec("Nightly", ".github/workflows/nightly.yml", "schedule", (
    JobSpec("soak", SELF, 1500, (("Run ./soak.sh", 1.0),)),
    JobSpec("browsers", SELF, 900, (("Run browser-actions/setup-chrome@v1", 0.1),
                                     ("Run ./cross-browser.sh", 0.9))),
))
MATRIX = FlowSpec("Matrix", ".github/workflows/matrix.yml", "workflow_dispatch", tuple(
    JobSpec(f"test ({node})", SELF, 300, (("Run npm test", 1.0),)) for node in (18, 20, 22)))
NIGHTLY_HOUR_BERLIN = 3  # "30 3 * * 1-5" in Europe/Berlin

WORKFLOW_FILES = {
    ".github/workflows/ci.yml": """\
name: CI
on: [push, pull_request]
jobs:
  lint:
    runs-on: [self-hosted, linux]
    steps: [{uses: actions/checkout@v4}, {run: npm ci}, {run: npm run lint}]
  build:
    runs-on: [self-hosted, linux]
    steps: [{uses: actions/checkout@v4}, {run: npm ci}, {run: npm run build}]
  unit:
    name: unit tests
    runs-on: [self-hosted, linux]
    steps: [{uses: actions/checkout@v4}, {run: npm test}]
  e2e:
    name: e2e (chromium)
    runs-on: [self-hosted, linux]
    steps:
      - uses: actions/checkout@v4
      - run: npx playwright install --with-deps chromium
      - run: npx playwright test
""",
    ".github/workflows/docs.yml": """\
name: Docs
on:
  push:
    branches: [main]
jobs:
  publish:
    runs-on: ubuntu-latest
    steps: [{run: mkdocs build}]
""",
    ".github/workflows/nightly.yml": """\
name: Nightly
on:
  schedule:
    - cron: '30 3 * * 1-5'
      timezone: Europe/Berlin
concurrency: nightly-${{ github.ref }}
jobs:
  soak:
    runs-on: [self-hosted, linux]
    steps: [{run: ./soak.sh}]
  browsers:
    runs-on: [self-hosted, linux]
    steps: [{uses: browser-actions/setup-chrome@v1}, {run: ./cross-browser.sh}]
""",
    ".github/workflows/matrix.yml": """\
name: Matrix
on: workflow_dispatch
concurrency:
  group: matrix-${{ github.ref }}
  cancel-in-progress: true
jobs:
  test:
    runs-on: [self-hosted, linux]
    strategy:
      matrix:
        node: [18, 20, 22]
        os: [jammy, noble]
        exclude:
          - {node: 18, os: noble}
    steps: [{run: npm test}]
""",
    ".github/workflows/dynamic.yml": """\
name: Dynamic
on: workflow_dispatch
concurrency: dynamic-${{ github.ref }}
jobs:
  plan:
    runs-on: ubuntu-latest
    outputs: {targets: '${{ steps.p.outputs.targets }}'}
    steps: [{id: p, run: ./plan.sh}]
  run:
    needs: plan
    runs-on: [self-hosted, linux]
    strategy:
      matrix: ${{ fromJSON(needs.plan.outputs.targets) }}
    steps: [{run: ./run.sh}]
""",
    ".github/workflows/deploy.yml": """\
name: Deploy
on: {push: {tags: ['v*']}}
concurrency: deploy
jobs:
  ship:
    runs-on: [self-hosted, linux]
    steps: [{run: ./deploy.sh}]
""",
    ".github/workflows/release.yml": """\
name: Release
on: {release: {types: [published]}}
jobs:
  notes:
    runs-on: [self-hosted, linux]
    concurrency: deploy
    steps: [{run: ./notes.sh}]
""",
}


def push_rate(t: float) -> float:
    """Pushes per hour at time t: the working week in UTC."""
    moment = datetime.fromtimestamp(t, UTC)
    if moment.weekday() >= 5:
        return 0.25
    if 8 <= moment.hour < 18:
        return 2.0 if moment.hour not in (12, 13) else 1.2
    return 0.15 if moment.hour < 6 or moment.hour >= 21 else 0.6


@dataclass
class History:
    repo: str
    runs: list[dict[str, Any]] = field(default_factory=list)
    jobs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    def all_jobs(self) -> list[dict[str, Any]]:
        """The jobs of the listed runs (every attempt)."""
        return [job for run in self.runs for job in self.jobs[run["id"]]]


class _Builder:
    def __init__(self, repo: str, runners: int, seed: int, ids: itertools.count) -> None:
        self.history = History(repo)
        self.rng = random.Random(seed)
        self.runners = runners
        self.ids = ids
        self.pending: list[tuple[float, int, dict[str, Any], JobSpec]] = []

    def run(self, flow: FlowSpec, created: float, attempt_of: dict[str, Any] | None = None
            ) -> None:
        rng = self.rng
        run_id = attempt_of["id"] if attempt_of else next(self.ids)
        attempt = attempt_of["run_attempt"] + 1 if attempt_of else 1
        run = attempt_of or {"id": run_id, "name": flow.name, "path": flow.path,
                             "event": flow.event, "head_branch": "main", "status": "completed",
                             "conclusion": "success", "created_at": iso(created),
                             "run_started_at": iso(created), "updated_at": iso(created),
                             "run_attempt": 1,
                             "html_url": f"https://github.com/{self.history.repo}/actions/runs/"
                                         f"{run_id}"}
        run["run_attempt"] = attempt
        if attempt_of is None:
            self.history.runs.append(run)
            self.history.jobs[run_id] = []
        for spec in flow.jobs:
            job = {"id": next(self.ids), "run_id": run_id, "run_attempt": attempt,
                   "name": spec.name, "workflow_name": flow.name, "labels": list(spec.labels),
                   "head_branch": "main", "status": "completed",
                   "created_at": iso(created)}
            self.history.jobs[run_id].append(job)
            self.pending.append((created, job["id"], job, spec))
            job["_created"] = created
            job["_run"] = run
            job["_spec"] = spec
            job["_duration"] = spec.median_s * math.exp(rng.gauss(0, 0.35))
            roll = rng.random()
            job["conclusion"] = "failure" if roll < 0.07 else "cancelled" if roll < 0.09 \
                else "success"
            if job["conclusion"] != "success":
                job["_duration"] *= rng.uniform(0.2, 0.8)

    def settle(self) -> None:
        """Queue times: self-hosted jobs first come, first served on the runner count."""
        rng = self.rng
        names = [f"{self.history.repo.split('/')[1]}-{n + 1}" for n in range(self.runners)]
        slots = [(0.0, n) for n in range(self.runners)]
        heapq.heapify(slots)
        for created, _, job, spec in sorted(self.pending, key=lambda p: (p[0], p[1])):
            if "self-hosted" in spec.labels:
                at, slot = heapq.heappop(slots)
                start = max(created + rng.uniform(2, 8), at)
                end = start + job["_duration"]
                heapq.heappush(slots, (end, slot))
                runner = names[slot]
            else:
                start = created + rng.uniform(5, 20)
                end = start + job["_duration"]
                runner = f"GitHub Actions {rng.randint(1, 90)}"
            self._finish(job, spec, start, end, runner)
        self.pending.clear()

    def _finish(self, job: dict[str, Any], spec: JobSpec, start: float, end: float,
                runner: str) -> None:
        job.update({"started_at": iso(start), "completed_at": iso(end), "runner_name": runner,
                    "runner_id": abs(hash(runner)) % 100000, "runner_group_name": "Default"})
        steps, t = [{"name": "Set up job", "status": "completed", "conclusion": "success",
                     "number": 1, "started_at": iso(start), "completed_at": iso(start + 2)}], \
            start + 2
        span = max(1.0, end - start - 4)
        for number, (name, share) in enumerate(spec.steps, start=2):
            step_end = t + span * share
            steps.append({"name": name, "status": "completed", "conclusion": "success",
                          "number": number, "started_at": iso(t),
                          "completed_at": iso(step_end)})
            t = step_end
        if job["conclusion"] != "success":
            steps[-1]["conclusion"] = job["conclusion"]
        steps.append({"name": "Complete job", "status": "completed", "conclusion": "success",
                      "number": len(steps) + 1, "started_at": iso(t), "completed_at": iso(end)})
        job["steps"] = steps
        run = job["_run"]
        if job["conclusion"] == "failure":
            run["conclusion"] = "failure"
        run["updated_at"] = max(run["updated_at"], iso(end))


def generate(repo: str, end: float, days: int, runners: int = 3, seed: int = 7,
             ids: itertools.count | None = None) -> History:
    """`days` of history of `repo` ending at `end` (every job completed before `end`)."""
    builder = _Builder(repo, runners, seed, ids or itertools.count(5_000_000))
    rng = builder.rng
    start = math.floor((end - days * DAY) / HOUR) * HOUR
    t = start
    while t < end - 2 * HOUR:
        hour_end = t + HOUR
        arrival = t + rng.expovariate(push_rate(t) / HOUR)
        while arrival < hour_end:
            builder.run(CI, arrival)
            if rng.random() < 0.25:
                builder.run(DOCS, arrival + 1)
            if rng.random() < 0.05:
                builder.run(MATRIX, arrival + 30)
            arrival += rng.expovariate(push_rate(t) / HOUR)
        t = hour_end
    _nightlies(builder, start, end)
    builder.settle()
    _reruns(builder, end)
    history = builder.history
    for jobs in history.jobs.values():
        for job in jobs:
            for key in [k for k in job if k.startswith("_")]:
                del job[key]
    history.runs = [r for r in history.runs if r["updated_at"] < iso(end)]
    history.runs.sort(key=lambda r: r["created_at"], reverse=True)
    return history


def _nightlies(builder: _Builder, start: float, end: float) -> None:
    from zoneinfo import ZoneInfo
    berlin = ZoneInfo("Europe/Berlin")
    day = datetime.fromtimestamp(start, berlin).date()
    while True:
        local = datetime(day.year, day.month, day.day, NIGHTLY_HOUR_BERLIN, 30, tzinfo=berlin)
        at = local.timestamp()
        if at >= end - 3 * HOUR:
            return
        if at >= start and local.weekday() < 5:
            builder.run(NIGHTLY, at + builder.rng.uniform(60, 400))  # GitHub starts them late
        day = datetime.fromordinal(day.toordinal() + 1).date()


def _reruns(builder: _Builder, end: float) -> None:
    """A few failed CI runs are re-run about ten minutes after they ended."""
    rng = builder.rng
    failed = [r for r in builder.history.runs if r["conclusion"] == "failure"
              and r["name"] == "CI"]
    for run in failed:
        if rng.random() < 0.3:
            again = datetime.fromisoformat(run["updated_at"].replace("Z", "+00:00")).timestamp()
            if again + 1800 < end - 2 * HOUR:
                run["conclusion"] = "success"
                builder.run(CI, again + 600, attempt_of=run)
    builder.settle()

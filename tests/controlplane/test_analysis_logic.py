"""The analysis modules as plain functions: statistics, analytics, workflow files and their
findings, simulation, forecast, autoscale decisions."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml

from fleet_min.controlplane.analysis import (
    analytics,
    autoscale,
    forecast,
    reports,
    stats,
    workflows,
)
from fleet_min.controlplane.analysis.simulate import Trace, compare, replay
from fleet_min.controlplane.github.history import job_row
from tests.support import history_gen

# --- stats -------------------------------------------------------------------------------------


def test_nearest_rank_percentiles_are_observations() -> None:
    assert stats.percentiles([4, 1, 3, 2]) == {"p50": 2, "p90": 4, "p95": 4}
    assert stats.percentiles(range(1, 101), (50, 90, 95)) == {"p50": 50, "p90": 90, "p95": 95}
    assert stats.percentiles([]) == {"p50": None, "p90": None, "p95": None}
    assert stats.median([1, 2, 3, 10]) == 2.5 and stats.median([]) is None


def test_peak_overlap_counts_touching_intervals_apart() -> None:
    assert stats.peak_overlap([(0, 10), (10, 20)]) == (1, 0)
    assert stats.peak_overlap([(0, 10), (5, 20), (6, 7), (30, 40)]) == (3, 6)
    assert stats.peak_overlap([]) == (0, None)


# --- analytics ---------------------------------------------------------------------------------

def _row(job_id: int, name: str = "build", conclusion: str = "success", created: float = 0,
         started: float = 10, completed: float = 70, workflow: str = "CI",
         steps: list[list[Any]] | None = None, runner: str | None = "r1") -> dict[str, Any]:
    return {"job_id": job_id, "repo": "octo/app", "name": name, "workflow": workflow,
            "runner": runner, "conclusion": conclusion, "created_at": created,
            "started_at": started, "completed_at": completed, "labels": "[]",
            "steps": json.dumps(steps) if steps is not None else None}


@pytest.mark.parametrize(("name", "expected"), [
    ("Run npx playwright install --with-deps", True),
    ("Run browser-actions/setup-chrome@v1", True),
    ("Cache Playwright browsers", True),
    ("Install Chromium", True),
    ("Download geckodriver", True),
    ("Install dependencies", False),
    ("Run npx playwright test", False),
    ("Run npm ci", False),
])
def test_browser_install_steps_are_recognised_by_name(name: str, expected: bool) -> None:
    assert analytics.is_browser_install(name) is expected


def test_e2e_jobs_by_job_or_workflow_name() -> None:
    assert analytics.is_e2e_job("e2e (chromium)", "CI")
    assert analytics.is_e2e_job("test", "Playwright Tests")
    assert analytics.is_e2e_job("End-to-end", None)
    assert not analytics.is_e2e_job("unit tests", "CI")
    assert not analytics.is_e2e_job("release notes", "Release")  # "e2e" needs a word boundary


def test_analytics_windows_cover_the_days_asked_for() -> None:
    assert [reports.window_days(d) for d in (1, 7, 8, 30, 31, 90, 91, 364, 365)] == \
        [1, 7, 10, 30, 45, 90, 120, 365, 365]
    assert all(d <= reports.window_days(d) <= 365 for d in range(1, 366))
    assert {7, 30, 90, 365} <= set(reports.WINDOWS)  # the web page's choices are exact


def test_browser_figures_of_the_rows_that_may_count_equal_those_of_all() -> None:
    history = history_gen.generate("octo/app", 1_800_000_000, 6, runners=2, seed=5,
                                   ids=itertools.count(1))
    rows = [job_row({"repo": "octo/app", "run_id": run["id"], **job}, run)
            for run in history.runs for job in history.jobs[run["id"]]]
    for row in rows[::3]:  # as the database hands steps over: only those with a browser word
        row["steps"] = None
    kept = [row for row in rows if analytics.may_be_browser_test(row)]
    assert 0 < len(kept) < len(rows)
    assert analytics.browser_test(kept) == analytics.browser_test(rows)
    assert analytics.per_repo(iter(rows)) == analytics.per_repo(rows)


def test_job_figures_failure_rate_leaves_cancels_out() -> None:
    rows = [_row(1), _row(2, conclusion="failure"), _row(3, conclusion="timed_out"),
            _row(4, conclusion="cancelled"), _row(5, conclusion="skipped", runner=None)]
    figures = analytics.job_figures(rows)
    assert figures["jobs"] == 4  # the skipped job never ran
    assert figures["failure_rate"] == round(2 / 3, 4) and figures["failures"] == 2
    assert figures["duration_s"]["p50"] == 60 and figures["queue_s"]["p50"] == 10
    assert figures["conclusions"] == {"cancelled": 1, "failure": 1, "skipped": 1,
                                      "success": 1, "timed_out": 1}


def test_browser_test_figures_from_steps_and_names() -> None:
    install = ["Run npx playwright install --with-deps", "success", 20.0, 50.0]
    rows = [_row(1, "e2e", steps=[["Run npm ci", "success", 10.0, 20.0], install],
                 completed=110),
            _row(2, "smoke", conclusion="failure", workflow="Playwright", completed=40),
            _row(3, "unit")]
    out = analytics.browser_test(rows)
    assert out["install_steps"]["count"] == 1 and out["install_steps"]["jobs"] == 1
    assert out["install_steps"]["duration_s"]["p50"] == 30.0
    assert out["install_steps"]["share_of_job_time_pct"] == 30.0  # 30 s of a 100 s job
    e2e = out["e2e_jobs"]
    assert e2e["jobs"] == 2 and e2e["success_rate"] == 0.5 and e2e["failures"] == 1
    assert {j["name"] for j in e2e["by_job"]} == {"e2e", "smoke"}


def test_repo_detail_peak_concurrency() -> None:
    rows = [_row(1, started=0, completed=100), _row(2, started=50, completed=150),
            _row(3, started=60, completed=70), _row(4, started=150, completed=200)]
    detail = analytics.repo_detail("octo/app", rows)
    assert detail["concurrency_peak"]["jobs"] == 3
    assert detail["concurrency_peak"]["at"] == "1970-01-01T00:01:00.000000Z"
    assert detail["workflows"][0]["workflow"] == "CI" and detail["jobs"] == 4


# --- workflow files ----------------------------------------------------------------------------

def _flows() -> list[workflows.Workflow]:
    return [workflows.parse(path, text) for path, text in history_gen.WORKFLOW_FILES.items()]


def test_workflow_models() -> None:
    by_name = {f.name: f for f in _flows()}
    ci = by_name["CI"]
    assert [j.key for j in ci.jobs] == ["lint", "build", "unit", "e2e"]
    assert all(j.self_hosted for j in ci.jobs) and ci.group is None
    nightly = by_name["Nightly"]
    assert [(s.cron, s.timezone) for s in nightly.schedules] == [("30 3 * * 1-5",
                                                                 "Europe/Berlin")]
    matrix = by_name["Matrix"].jobs[0].matrix
    assert matrix is not None and matrix.size == 5 and not matrix.expression
    dynamic = by_name["Dynamic"].jobs[1].matrix
    assert dynamic is not None and dynamic.expression and dynamic.size is None
    assert by_name["Docs"].jobs[0].self_hosted is False


def test_matrix_include_exclude_and_runs_on_from_the_matrix() -> None:
    text = """
on: push
jobs:
  t:
    runs-on: ${{ matrix.runner }}
    strategy:
      max-parallel: 2
      matrix:
        runner: [[self-hosted, arm], [self-hosted, x64]]
        py: ['3.11', '3.12']
        include:
          - {py: '3.12', extra: yes}
          - {runner: [self-hosted, riscv], py: '3.13'}
"""
    job = workflows.parse("w.yml", text).jobs[0]
    assert job.matrix is not None and job.matrix.size == 5 and job.matrix.max_parallel == 2
    assert job.self_hosted and job.labels is not None and "arm" in job.labels


def test_bad_files_give_errors_not_exceptions() -> None:
    assert workflows.parse("a.yml", "jobs: [unclosed").error is not None
    assert workflows.parse("b.yml", "- just\n- a list").error == "not a YAML mapping"
    big = "x: " + "y" * (workflows.MAX_FILE_BYTES + 1)
    assert "KiB" in (workflows.parse("c.yml", big).error or "")
    code = "!!python/object/apply:os.system ['echo pwned']"
    assert workflows.parse("d.yml", code).error is not None  # the safe loader refuses tags


def _laughs(levels: int) -> str:
    """A workflow whose name is nested anchors: each level repeats the one before it ten
    times, so a few hundred bytes name 10**levels strings."""
    lines = ['a0: &a0 "lol"']
    for n in range(1, levels + 1):
        lines.append(f"a{n}: &a{n} [" + ", ".join([f"*a{n - 1}"] * 10) + "]")
    return "\n".join([*lines, f"name: *a{levels}", "on: push",
                       "jobs: {build: {runs-on: ubuntu-latest}}", ""])


def test_a_file_deeper_or_larger_than_it_looks_is_an_error_not_a_crash(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 60 KB file of brackets 30,000 deep crashed the daemon (the C loader's recursion: a
    segfault, and again at every start, the file being kept in SQLite); 500 bytes of nested
    anchors named a workflow with a 312 MB string. Both are refused from the parser's events,
    before anything is built, by the C loader and the pure-Python one (fleet.pyz) alike."""
    deep = "name: x\non: push\nx: " + "[" * 30_000 + "]" * 30_000 + "\n"
    child = subprocess.run(
        [sys.executable, "-c", "import sys; from fleet_min.controlplane.analysis import "
         "workflows; print(workflows.parse('deep.yml', sys.stdin.read()).error)"],
        input=deep, capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr[-500:]
    assert child.stdout.strip() == "nested deeper than 64 levels; skipped"
    for loader in (workflows._Loader, yaml.SafeLoader):
        monkeypatch.setattr(workflows, "_Loader", loader)
        mapping = "{a: " * 1000 + "1" + "}" * 1000
        assert workflows.parse("m.yml", f"name: x\nx: {mapping}\n").error == (
            "nested deeper than 64 levels; skipped")
        bomb = workflows.parse("bomb.yml", _laughs(7))
        assert bomb.error is not None and "aliases expand it" in bomb.error, bomb
        few = workflows.parse("few.yml", _laughs(2))  # 100 strings: an honest use of anchors
        assert few.error is None and few.name == "few.yml"  # a list is no name
        assert workflows.parse("ok.yml", "name: 2024\non: push\njobs: {}\n").name == "2024"


def test_concurrency_findings() -> None:
    runners = [{"name": n, "labels": ["self-hosted", "Linux", "linux"]} for n in ("a", "b")]
    found = workflows.findings("octo/app", _flows(), runners)
    kinds = {(f["kind"], f.get("file") or f.get("group")) for f in found}
    assert ("matrix-exceeds-runners", ".github/workflows/matrix.yml") in kinds
    assert ("unbounded-matrix", ".github/workflows/dynamic.yml") in kinds
    assert ("missing-concurrency", ".github/workflows/ci.yml") in kinds
    assert ("static-group-collision", "deploy") in kinds
    assert not any(f["kind"] == "missing-concurrency" and "docs" in f["file"] for f in found)
    exceeds = next(f for f in found if f["kind"] == "matrix-exceeds-runners")
    assert (exceeds["matrix_size"], exceeds["runners"]) == (5, 2)
    # Enough runners: no finding.
    many = runners * 3
    assert not any(f["kind"] == "matrix-exceeds-runners"
                   for f in workflows.findings("octo/app", _flows(), many))


def test_a_job_sharing_its_workflows_group_is_a_deadlock() -> None:
    text = "on: push\nconcurrency: ci\njobs:\n  a:\n    runs-on: self-hosted\n" \
           "    concurrency: ci\n"
    [finding] = workflows.findings("o/r", [workflows.parse("ci.yml", text)], [])
    assert finding["kind"] == "static-group-collision" and finding["severity"] == "critical"


def test_a_deadlock_is_found_across_files_and_a_collision_lists_its_first_places() -> None:
    """Whether a job shares its own workflow's group was asked of every other place of the
    group (a file of 12,000 jobs of one group took 11 s on the event loop)."""
    jobs = "".join(f"  j{n}: *b\n" for n in range(3000))
    big = f"on: push\nx: &b {{runs-on: self-hosted, concurrency: g}}\njobs:\n{jobs}"
    other = "on: push\nconcurrency: g\njobs:\n  a:\n    runs-on: self-hosted\n"
    flows = [workflows.parse("big.yml", big), workflows.parse("other.yml", other)]
    [collision] = [f for f in workflows.findings("o/r", flows, [])
                   if f["kind"] == "static-group-collision"]
    # Two files share the group, but no job shares its own workflow's: not a deadlock.
    assert collision["severity"] == "warning", collision["message"]
    assert collision["places_total"] == 3001 and len(collision["places"]) == 100
    assert "declared 3001 times across big.yml, other.yml" in collision["message"]
    inside = other.replace("  a:\n", "  a:\n    concurrency: g\n")
    [own] = [f for f in workflows.findings("o/r", [flows[0], workflows.parse("other.yml",
                                                                              inside)], [])
             if f["kind"] == "static-group-collision"]
    assert own["severity"] == "critical"


def test_a_file_of_thousands_of_schedules_is_read_to_its_bound() -> None:
    """One anchored schedule and 20,000 aliases of it fit in 180 KB: the forecast listed a
    run for every due minute of each (178 MB an answer). A file's first MAX_SCHEDULES are
    read, the first MAX_RUNS_LISTED runs listed, and both bounds said."""
    aliases = "".join("    - *c\n" for _ in range(20_000))
    text = ("on:\n  schedule:\n    - &c {cron: '* * * * *'}\n" + aliases
            + "jobs: {a: {runs-on: [self-hosted], steps: []}}\n")
    flow = workflows.parse("many.yml", text)
    assert flow.error is None and len(flow.schedules) == workflows.MAX_SCHEDULES + 1
    out = forecast.schedule_prediction([flow], _ts("2026-02-03T10:00:00"))
    assert out["errors"] == [f"many.yml: more than {workflows.MAX_SCHEDULES} schedules; the "
                             f"first {workflows.MAX_SCHEDULES} are read"]
    assert out["runs_total"] == 60 * workflows.MAX_SCHEDULES
    assert len(out["runs"]) == forecast.MAX_RUNS_LISTED
    assert out["value"] == workflows.MAX_SCHEDULES  # each minute: every schedule's one job
    assert out["reason"] == f"{60 * workflows.MAX_SCHEDULES} scheduled run(s) due in the hour"


# --- simulation --------------------------------------------------------------------------------

def _brute_force_waits(arrivals: list[float], durations: list[float], c: int) -> list[float]:
    """First come, first served by c runners, by scanning every runner for every job."""
    free = [float("-inf")] * c
    waits = []
    for arrival, duration in zip(arrivals, durations, strict=True):
        i = min(range(c), key=lambda k: free[k])
        start = max(arrival, free[i])
        free[i] = start + duration
        waits.append(start - arrival)
    return waits


def test_replay_matches_a_brute_force_queue_and_is_deterministic() -> None:
    rng = random.Random(3)
    jobs, t = [], 0.0
    for job_id in range(2000):
        t += rng.expovariate(1 / 30)
        jobs.append((job_id, t, t + 5, t + 5 + rng.lognormvariate(4, 0.6)))
    trace = Trace.build(jobs)
    for c in (1, 2, 3, 5):
        assert replay(trace, c) == pytest.approx(
            _brute_force_waits(trace.arrivals, trace.durations, c))
    assert compare(trace, [1, 2, 8], 60) == compare(Trace.build(list(reversed(jobs))),
                                                    [1, 2, 8], 60)


def test_compare_figures_on_a_hand_worked_case() -> None:
    # Three jobs arrive at 0, 0, 0 and take 100 s each.
    trace = Trace.build([(1, 0, 0, 100), (2, 0, 0, 100), (3, 0, 0, 100)])
    out = compare(trace, [0, 1, 2, 3], 50)
    by = {r["runners"]: r for r in out["results"]}
    assert by[0]["wait_s"]["p50"] is None and by[0]["over_slo"] == 3
    assert by[1]["wait_s"] == {"p50": 100, "p90": 200, "p95": 200, "max": 200}
    assert by[1]["over_slo"] == 2 and by[1]["peak_concurrency"] == 1
    assert by[2]["wait_s"]["max"] == 100 and by[2]["peak_concurrency"] == 2
    assert by[3]["over_slo"] == 0 and by[3]["peak_concurrency"] == 3
    assert by[3]["busy_runner_hours"] == round(300 / 3600, 2)
    assert by[3]["utilization_pct"] == 100.0 and out["demand_peak"] == 3
    assert out["recorded"]["wait_s"]["p50"] == 0


# --- forecast ----------------------------------------------------------------------------------

def _ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def test_history_prediction_is_the_median_of_weekly_peaks() -> None:
    hour = _ts("2026-03-02T10:00:00")  # a Monday
    intervals = []
    for week, jobs in zip(range(1, 9), (3, 5, 4, 4, 6, 4, 3, 5), strict=True):
        start = hour - week * forecast.WEEK
        intervals += [(start + 60 * k, start + 600 + 60 * k) for k in range(jobs)]
        intervals.append((start - 86400, start - 86000))  # another day: ignored
    full = forecast.history_prediction(intervals, hour, hour - 60 * 86400)
    assert full["weeks"] == 8 and full["value"] == 4.0 and full["confidence"] == "high"
    assert [w["peak"] for w in full["weekly_peaks"]] == [3, 5, 4, 4, 6, 4, 3, 5]
    four = forecast.history_prediction(intervals, hour, hour - 4 * forecast.WEEK - 1)
    assert four["weeks"] == 4 and four["confidence"] == "medium"
    two = forecast.history_prediction(intervals, hour, hour - 2 * forecast.WEEK)
    assert two["value"] is None and "3 are needed" in two["reason"]


def test_schedules_are_read_in_their_time_zone_across_dst() -> None:
    flow = workflows.parse("n.yml", history_gen.WORKFLOW_FILES[".github/workflows/nightly.yml"])
    winter = forecast.schedule_prediction([flow], _ts("2026-03-02T02:00:00"))  # CET = UTC+1
    assert [r["due_at"] for r in winter["runs"]] == ["2026-03-02T02:30:00.000000Z"]
    assert winter["value"] == 2  # soak and browsers, both self-hosted
    summer = forecast.schedule_prediction([flow], _ts("2026-04-06T01:00:00"))  # CEST = UTC+2
    assert [r["due_at"] for r in summer["runs"]] == ["2026-04-06T01:30:00.000000Z"]
    weekend = forecast.schedule_prediction([flow], _ts("2026-03-07T02:00:00"))
    assert weekend["runs"] == [] and weekend["value"] == 0


def test_full_cron_syntax_and_bad_schedules() -> None:
    text = """
on:
  schedule:
    - cron: '*/20 9-17 * jan-mar mon-fri'
    - cron: '0 0 31 feb *'
    - cron: '15 * * * *'
      timezone: Mars/Olympus
jobs: {a: {runs-on: [self-hosted], steps: []}}
"""
    flow = workflows.parse("c.yml", text)
    out = forecast.schedule_prediction([flow], _ts("2026-02-03T10:00:00"))
    assert [r["due_at"][11:16] for r in out["runs"]] == ["10:00", "10:20", "10:40"]
    assert len(out["errors"]) == 2


def test_combined_prediction_and_scores() -> None:
    history = {"source": "history", "value": 2.0, "confidence": "medium"}
    schedule = {"source": "schedule", "value": 3, "confidence": "high", "runs": [{}]}
    assert forecast.combine(history, schedule)["value"] == 3
    assert forecast.combine(history, schedule)["confidence"] == "high"
    none = forecast.combine({**history, "value": None}, {**schedule, "value": 0, "runs": []})
    assert none["value"] is None
    summary = forecast.score_summary([{"predicted": 2, "actual": 3}, {"predicted": 4,
                                                                       "actual": 1},
                                      {"predicted": 1, "actual": None}])
    assert summary == {"scored": 2, "mae": 2.0, "bias": 1.0, "within_one_pct": 50.0}


# --- autoscale ---------------------------------------------------------------------------------

ROOM = {"can_add": True, "reasons": [], "per_repo": {"octo/app": 1},
        "limits": {"max_per_repo": 4}}


def _state(**kw: Any) -> autoscale.RepoState:
    base: dict[str, Any] = {
        "repo": "octo/app",
        "runners": [{"name": "r1", "busy": True, "draining": False, "state": "working",
                     "registration": "registered"}],
        "causes": [], "forecast": None, "duplicates": {}, "last_executed_at": None,
        "capacity": ROOM}
    base.update(kw)
    return autoscale.RepoState(**base)


AT_CAPACITY = {"cause": "repo-at-capacity", "recommendation": {
    "action": {"id": "runner.duplicate", "args": {"name": "r1"}}}}


def test_scale_up_when_jobs_wait_at_capacity() -> None:
    d = autoscale.decide(_state(causes=[AT_CAPACITY]), 1000.0, 600, 1800)
    assert d is not None and (d.direction, d.outcome) == ("up", "proposed")
    assert d.action == {"id": "runner.duplicate", "args": {"name": "r1"}}
    assert d.inputs["at_capacity_runs"] == 1


def test_scale_up_refused_by_cooldown_and_capacity() -> None:
    d = autoscale.decide(_state(causes=[AT_CAPACITY], last_executed_at=900.0), 1000.0, 600,
                         1800)
    assert d is not None and d.outcome == "refused" and any("cooldown" in r for r in d.reasons)
    full = {**ROOM, "can_add": False, "reasons": ["4 runners already reach the ceiling of 4"]}
    d = autoscale.decide(_state(causes=[AT_CAPACITY], capacity=full), 1000.0, 600, 1800)
    assert d is not None and d.outcome == "refused" and "ceiling of 4" in d.reasons[-1]


def test_scale_up_from_the_forecast_only_when_confident() -> None:
    sure = {"value": 3.0, "confidence": "medium"}
    d = autoscale.decide(_state(forecast=sure), 1000.0, 600, 1800)
    assert d is not None and d.direction == "up" and "forecast expects 3" in d.reasons[0]
    assert autoscale.decide(_state(forecast={"value": 3.0, "confidence": "low"}), 1000.0,
                            600, 1800) is None


def test_scale_down_an_idle_duplicate_only() -> None:
    runners = [{"name": "r1", "busy": False, "draining": False, "state": "idle",
                "registration": "registered"},
               {"name": "r1-2", "busy": False, "draining": False, "state": "idle",
                "registration": "registered"}]
    d = autoscale.decide(_state(runners=runners, duplicates={"r1-2": 0.0}), 5000.0, 600, 1800)
    assert d is not None and (d.direction, d.outcome) == ("down", "proposed")
    assert d.action == {"id": "runner.deregister", "args": {"name": "r1-2", "delete_dir": True}}
    young = autoscale.decide(_state(runners=runners, duplicates={"r1-2": 4000.0}), 5000.0,
                             600, 1800)
    assert young is None
    needed = autoscale.decide(_state(runners=runners, duplicates={"r1-2": 0.0},
                                     forecast={"value": 2, "confidence": "high"}),
                              5000.0, 600, 1800)
    assert needed is not None and needed.outcome == "refused" and needed.action is None
    assert autoscale.decide(_state(runners=runners), 5000.0, 600, 1800) is None


# --- the fixture generator itself ----------------------------------------------------------------

def test_generated_history_is_deterministic_and_busy_on_weekdays() -> None:
    end = _ts("2026-03-01T00:00:00")
    a = history_gen.generate("octo/app", end, 14, ids=itertools.count(1))
    b = history_gen.generate("octo/app", end, 14, ids=itertools.count(1))
    assert a.runs == b.runs and a.jobs == b.jobs
    weekday = sum(1 for r in a.runs if datetime.fromisoformat(
        r["created_at"].replace("Z", "+00:00")).weekday() < 5)
    assert weekday > 4 * (len(a.runs) - weekday)
    assert all(j["completed_at"] < history_gen.iso(end) for j in a.all_jobs())
    assert any(r["run_attempt"] == 2 for r in a.runs)

"""Analytics over the stored job history: per-repository figures, browser-test figures, and the
detail of one repository. Pure functions over job rows; docs/controlplane-analysis.md explains
every figure.

Which jobs count:
- a job *ran* when GitHub gave it a runner (runner name set) and it has start and end times;
  only those give a duration (end - start) and a queue time (start - created);
- its outcome is its conclusion; the failure rate is failed / (succeeded + failed), where
  failed means `failure` or `timed_out`; cancelled and skipped jobs are counted apart and left
  out of the rate (a cancel is a person's decision, not the job's result).
"""

from __future__ import annotations

import functools
import json
import re
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fleet_min.controlplane.analysis.stats import peak_overlap, percentiles, rate
from fleet_min.timeutil import iso

FAILED = ("failure", "timed_out")
DECIDED = ("success", *FAILED)

# A step installs a browser when its name names a browser (or a browser-test tool) and an act
# of installing it; e.g. "Run npx playwright install --with-deps", "Run browser-actions/
# setup-chrome@v1", "Cache Playwright browsers". A bare "Install dependencies" does not count.
BROWSER_WORDS = re.compile(
    r"playwright|puppeteer|chromium|chrome|chromedriver|firefox|geckodriver|webkit|msedge|"
    r"edgedriver|selenium|cypress|browsers?\b", re.I)
INSTALL_WORDS = re.compile(r"install|set[ -]?up|download|provision|cache", re.I)
# An end-to-end browser test job: its job or workflow name says so, or it installs a browser.
E2E_WORDS = re.compile(
    r"\be2e\b|end[ -]to[ -]end|playwright|cypress|selenium|puppeteer|webdriver|browser|"
    r"\bui[ -]tests?\b", re.I)
# What the database is asked to hand back steps for (a cheap LIKE prefilter; the regular
# expressions above decide).
STEP_PREFILTER = ("playwright", "puppeteer", "chrom", "firefox", "gecko", "webkit", "edge",
                  "selenium", "cypress", "browser")


@functools.lru_cache(maxsize=4096)  # a repository has a handful of distinct label sets
def self_hosted(labels_json: str) -> bool:
    """Whether a job's runs-on labels (as stored, a JSON list) ask for a self-hosted runner."""
    try:
        labels = json.loads(labels_json)
    except ValueError:
        return False
    return any(str(label).lower() == "self-hosted" for label in labels)


def is_browser_install(step_name: str) -> bool:
    return bool(BROWSER_WORDS.search(step_name) and INSTALL_WORDS.search(step_name))


@functools.lru_cache(maxsize=4096)  # a history has a few hundred distinct job names
def is_e2e_job(name: str, workflow: str | None) -> bool:
    return bool(E2E_WORDS.search(name) or (workflow and E2E_WORDS.search(workflow)))


def _ran(row: Mapping[str, Any]) -> bool:
    return bool(row["runner"] and row["started_at"] is not None
                and row["completed_at"] is not None and row["completed_at"] >= row["started_at"])


def _queue(row: Mapping[str, Any]) -> float | None:
    if not _ran(row) or row["created_at"] is None:
        return None
    return max(0.0, row["started_at"] - row["created_at"])


def _duration(row: Mapping[str, Any]) -> float:
    return float(row["completed_at"] - row["started_at"])


class _Tally:
    """job_figures of jobs seen one at a time: only their numbers are kept, not the rows (a
    list of a million rows costs the garbage collector a quarter of a second a pass)."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.durations = array("d")  # not lists: the garbage collector walks a list's items
        self.queues = array("d")

    def add(self, row: Mapping[str, Any]) -> None:
        self.outcomes[row["conclusion"] or "unknown"] += 1
        if _ran(row):
            self.durations.append(_duration(row))
            queue = _queue(row)
            if queue is not None:
                self.queues.append(queue)

    def figures(self) -> dict[str, Any]:
        outcomes, durations = self.outcomes, self.durations
        decided = sum(outcomes[c] for c in DECIDED)
        failed = sum(outcomes[c] for c in FAILED)
        return {
            "jobs": len(durations),
            "duration_s": {**percentiles(durations),
                           "mean": round(sum(durations) / len(durations), 1)
                           if durations else None},
            "queue_s": percentiles(self.queues, (50, 95)),
            "failure_rate": rate(failed, decided),
            "failures": failed,
            "conclusions": dict(sorted(outcomes.items())),
        }


def job_figures(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Count, duration and queue percentiles, failure rate and outcomes of a set of jobs."""
    tally = _Tally()
    for row in rows:
        tally.add(row)
    return tally.figures()


def per_repo(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """job_figures per repository, in one pass over the rows (which may be a stream)."""
    by_repo: dict[str, _Tally] = defaultdict(_Tally)
    for row in rows:
        by_repo[row["repo"]].add(row)
    return [{"repo": repo, **tally.figures()} for repo, tally in sorted(by_repo.items())]


def may_be_browser_test(row: Mapping[str, Any]) -> bool:
    """Whether browser_test could count this row (it has steps to look at, or an end-to-end
    name); the others may be left out of what it is given."""
    return bool(row["steps"]) or is_e2e_job(row["name"], row["workflow"])


def _steps(row: Mapping[str, Any]) -> list[list[Any]]:
    raw = row["steps"]
    if not raw:
        return []
    try:
        steps = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return []
    return [s for s in steps if isinstance(s, list) and len(s) == 4]


def browser_test(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Browser-install step timings and end-to-end test job figures, from names only."""
    installs: list[tuple[str, float, str | None]] = []
    install_jobs: dict[int, float] = {}
    e2e: list[Mapping[str, Any]] = []
    for row in rows:
        found = False
        for name, conclusion, started, completed in _steps(row):
            if (is_browser_install(name) and started is not None and completed is not None
                    and completed >= started):
                installs.append((name, completed - started, conclusion))
                install_jobs[row["job_id"]] = install_jobs.get(row["job_id"], 0) + (
                    completed - started)
                found = True
        if found or is_e2e_job(row["name"], row["workflow"]):
            e2e.append(row)
    return {"install_steps": _install_figures(installs, install_jobs, e2e),
            "e2e_jobs": _e2e_figures(e2e),
            "rules": {"install_step": "step name matches /" + BROWSER_WORDS.pattern + "/ and /"
                      + INSTALL_WORDS.pattern + "/ (case-insensitive)",
                      "e2e_job": "job or workflow name matches /" + E2E_WORDS.pattern
                      + "/, or the job has a browser-install step"}}


def _install_figures(installs: list[tuple[str, float, str | None]],
                     per_job: dict[int, float], e2e: list[Mapping[str, Any]]
                     ) -> dict[str, Any]:
    seconds = [s for _, s, _ in installs]
    job_time = sum(_duration(r) for r in e2e if r["job_id"] in per_job and _ran(r))
    by_name: dict[str, list[float]] = defaultdict(list)
    for name, secs, _ in installs:
        by_name[name].append(secs)
    names = sorted(by_name.items(), key=lambda item: -len(item[1]))[:10]
    return {"count": len(installs), "jobs": len(per_job),
            "duration_s": percentiles(seconds),
            "total_s": round(sum(seconds), 1),
            "share_of_job_time_pct": round(100 * sum(per_job.values()) / job_time, 1)
            if job_time else None,
            "failed": sum(1 for _, _, c in installs if c in FAILED),
            "by_name": [{"name": name, "count": len(values),
                         "duration_s": percentiles(values, (50, 95))} for name, values in names]}


def _e2e_figures(e2e: list[Mapping[str, Any]]) -> dict[str, Any]:
    figures = job_figures(e2e)
    decided = sum(figures["conclusions"].get(c, 0) for c in DECIDED)
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for row in e2e:
        groups[(row["repo"], row["workflow"] or "", row["name"])].append(row)
    top = sorted(groups.items(), key=lambda item: -len(item[1]))[:20]
    return {"jobs": figures["jobs"], "queue_s": figures["queue_s"],
            "duration_s": figures["duration_s"],
            "success_rate": rate(figures["conclusions"].get("success", 0), decided),
            "failures": figures["failures"],
            "by_job": [{"repo": repo, "workflow": workflow or None, "name": name,
                        **_short(job_figures(group))}
                       for (repo, workflow, name), group in top]}


def _short(figures: dict[str, Any]) -> dict[str, Any]:
    return {"jobs": figures["jobs"], "duration_p50_s": figures["duration_s"]["p50"],
            "queue_p50_s": figures["queue_s"]["p50"], "failure_rate": figures["failure_rate"]}


def repo_detail(repo: str, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """30-day figures of one repository, its concurrency peak and its workflows."""
    ran = [r for r in rows if _ran(r)]
    peak, at = peak_overlap((r["started_at"], r["completed_at"]) for r in ran)
    workflows: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        workflows[row["workflow"] or "(unknown)"].append(row)
    return {"repo": repo, **job_figures(rows),
            "concurrency_peak": {"jobs": peak, "at": iso(at)},
            "workflows": [{"workflow": name, **_short(job_figures(group))}
                          for name, group in sorted(workflows.items())]}

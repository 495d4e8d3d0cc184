"""Why each queued run waits: one classification per queued run, with the cause, how sure we
are, the evidence it rests on and what to do about it. Pure functions over what the snapshot
already holds (GitHub's runners and jobs, our runner views, the host's capacity).

Causes, in the order a run's jobs are weighed (the first that applies to any queued job of the
run names the run):

- telemetry-unavailable: GitHub's runner list (or the run's jobs) could not be read;
- unserved: the repository has no self-hosted runner registered at all;
- label-mismatch: no registered runner carries every label the job asks for;
- runner-down: runners with the labels exist but none is usable (offline, draining, service
  dead);
- concurrency-block: GitHub holds the run (status `pending`) for its concurrency group;
- host-saturated: every usable runner is busy and this host has no room for another;
- repo-at-capacity: every usable runner is busy and the host has room: `runner.duplicate` fixes
  it (the one cause an action can fix, and the one autoscale acts on);
- github-delay: an idle usable runner exists; GitHub has not handed it the job yet;
- github-hosted: the job asks for a GitHub-hosted image; no runner here is meant to take it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleet_min.controlplane.analysis.capacity import refusals_for_repo
from fleet_min.timeutil import parse_iso

ORDER = ("telemetry-unavailable", "unserved", "label-mismatch", "runner-down",
         "concurrency-block", "host-saturated", "repo-at-capacity", "github-delay",
         "github-hosted")
HOSTED_IMAGE = re.compile(r"^(ubuntu|windows|macos)-[\w.-]+$", re.I)
DELAY_MEDIUM_S = 30
DELAY_HIGH_S = 120


@dataclass
class Verdict:
    cause: str
    confidence: str
    message: str
    evidence: list[str] = field(default_factory=list)
    advice: str = ""
    action: dict[str, Any] | None = None


@dataclass
class Context:
    """What the classifier knows besides the run itself."""
    registered: dict[str, list[dict[str, Any]] | None]   # repo -> GitHub's runners (None: unknown)
    views: dict[str, dict[str, Any]]                      # runner name -> snapshot view (any host)
    local: set[str]                                       # names of this host's runners
    capacity: dict[str, Any]
    errors: dict[str, str] = field(default_factory=dict)  # repo -> why GitHub data is missing
    # (repo, the job's labels) -> the runners with them all: each set is matched once however
    # many queued runs ask for it.
    matched: dict[tuple[str, frozenset[str]], list[dict[str, Any]]] = field(
        default_factory=dict)


def _labels(job: Mapping[str, Any]) -> list[str]:
    return [str(label) for label in job.get("labels") or []]


def _hosted(labels: list[str]) -> bool:
    return bool(labels) and all(HOSTED_IMAGE.match(label) for label in labels)


def _unusable(runner: dict[str, Any], view: dict[str, Any] | None) -> str | None:
    if runner.get("status") != "online":
        return f"{runner['name']} is offline on GitHub"
    if view is None:
        return None
    if view.get("draining"):
        return f"{runner['name']} is draining"
    if view.get("state") in ("failed", "stopped", "drained"):
        return f"the service of {runner['name']} is {view['state']}"
    return None


def classify_job(repo: str, job: Mapping[str, Any], queued_s: float | None, ctx: Context
                 ) -> Verdict:
    labels = _labels(job)
    wanted = {label.lower() for label in labels}
    shown = ", ".join(labels) or "none"
    registered = ctx.registered.get(repo)
    if "self-hosted" not in wanted and _hosted(labels):
        return Verdict("github-hosted", "high", f"the job runs on a GitHub-hosted image ({shown})",
                       [f"labels: {shown}"], "nothing to do here: GitHub's own runners take it")
    if registered is None:
        why = ctx.errors.get(repo) or "it has not been read yet"
        return Verdict("telemetry-unavailable", "low",
                       f"GitHub's runner list for {repo} is unavailable: {why}", [why],
                       "check the GitHub token (GH_TOKEN) and the alerts")
    if not registered:
        return Verdict("unserved", "high", f"no self-hosted runner is registered for {repo}",
                       [f"GitHub lists 0 runners for {repo}"],
                       f"register a runner for {repo} (config.sh)")
    key = (repo, frozenset(wanted))
    if key not in ctx.matched:
        ctx.matched[key] = [r for r in registered
                            if wanted <= {label.lower() for label in r.get("labels", [])}]
    matching = ctx.matched[key]
    if not matching:
        return _mismatch(repo, labels, registered)
    down = [(r, _unusable(r, ctx.views.get(r["name"]))) for r in matching]
    usable = [r for r, why in down if why is None]
    if not usable:
        return Verdict("runner-down", "high",
                       f"every runner with labels {shown} is unusable",
                       [why for _, why in down if why],
                       "resume or restart them (runner.resume), or check their hosts")
    idle = [r for r in usable if not r.get("busy")]
    if idle:
        return _delay(idle, queued_s)
    return _busy(repo, usable, ctx, shown)


def _mismatch(repo: str, labels: list[str], registered: list[dict[str, Any]]) -> Verdict:
    wanted = {label.lower() for label in labels}
    nearest = min(registered, key=lambda r: len(wanted - {x.lower() for x in r["labels"]}))
    missing = sorted(wanted - {x.lower() for x in nearest["labels"]})
    return Verdict("label-mismatch", "high",
                   f"no runner of {repo} has every label the job asks for "
                   f"({', '.join(labels)})",
                   [f"closest: {nearest['name']} lacks {', '.join(missing)}",
                    f"{len(registered)} runner(s) registered"],
                   "fix the job's runs-on, or add the labels to a runner")


def _delay(idle: list[dict[str, Any]], queued_s: float | None) -> Verdict:
    waited = queued_s or 0
    confidence = ("high" if waited >= DELAY_HIGH_S else "medium" if waited >= DELAY_MEDIUM_S
                  else "low")
    names = ", ".join(r["name"] for r in idle[:5])
    return Verdict("github-delay", confidence,
                   f"idle matching runner(s) ({names}) are online; GitHub has not assigned "
                   "the job yet",
                   [f"queued for {int(waited)} s", f"{len(idle)} idle matching runner(s)"],
                   "usually resolves in seconds; if it lasts, check githubstatus.com")


def _busy(repo: str, usable: list[dict[str, Any]], ctx: Context, shown: str) -> Verdict:
    evidence = [f"{len(usable)} usable runner(s) with labels {shown}, all busy"]
    local = [r["name"] for r in usable if r["name"] in ctx.local]
    if local and not ctx.capacity.get("can_add", True):
        return Verdict("host-saturated", "high",
                       "every matching runner is busy and this host has no room for another",
                       evidence + list(ctx.capacity.get("reasons", [])),
                       "add a host (federation), free resources, or raise the ceiling")
    refusals = refusals_for_repo(ctx.capacity, repo)
    if not local:
        return Verdict("repo-at-capacity", "medium",
                       f"every runner of {repo} with labels {shown} is busy (on other hosts)",
                       evidence, "duplicate one of them on its own host")
    if refusals:
        return Verdict("repo-at-capacity", "high",
                       f"every runner of {repo} with labels {shown} is busy",
                       evidence + refusals, "raise max_per_repo to let a duplicate in")
    return Verdict("repo-at-capacity", "high",
                   f"every runner of {repo} with labels {shown} is busy; this host has room",
                   evidence, f"duplicate {local[0]}",
                   {"id": "runner.duplicate", "args": {"name": local[0]}})


def _queued_s(run: Mapping[str, Any], now: float) -> float | None:
    created = run.get("created_at")
    try:
        return max(0.0, now - parse_iso(created)) if created else None
    except ValueError:
        return None


def classify_run(run: Mapping[str, Any], jobs: Sequence[Mapping[str, Any]], ctx: Context,
                 now: float) -> dict[str, Any]:
    queued_s = _queued_s(run, now)
    waiting = [j for j in jobs if j.get("run_id") == run["id"]
               and j.get("status") in ("queued", "waiting", "pending")]
    # A job's verdict depends on its labels alone within a run: a matrix of 256 jobs of a few
    # label sets is judged a few times (150 such runs took 13 s a snapshot, judged a job each).
    verdicts: dict[tuple[str, ...], Verdict] = {}
    per_job = []
    for job in waiting:
        labels = tuple(_labels(job))
        if labels not in verdicts:
            verdicts[labels] = classify_job(run["repo"], job, queued_s, ctx)
        per_job.append((job, verdicts[labels]))
    if run.get("status") == "pending":
        verdict = Verdict("concurrency-block", "high",
                          "GitHub holds the run for its concurrency group",
                          [f"run status pending for {int(queued_s or 0)} s"],
                          "it starts when the group's running run ends; see GET /api/concurrency")
    elif per_job:
        verdict = min((v for _, v in per_job), key=lambda v: ORDER.index(v.cause))
    else:
        verdict = _jobless(run["repo"], ctx)
    return {"run_id": run["id"], "repo": run["repo"], "workflow": run.get("name"),
            "queued_s": int(queued_s) if queued_s is not None else None,
            "cause": verdict.cause, "confidence": verdict.confidence,
            "message": verdict.message, "evidence": verdict.evidence,
            "recommendation": {"text": verdict.advice, "action": verdict.action},
            "jobs": [{"job_id": job.get("id"), "name": job.get("name"),
                      "labels": _labels(job), "cause": v.cause} for job, v in per_job]}


def _jobless(repo: str, ctx: Context) -> Verdict:
    registered = ctx.registered.get(repo)
    if registered == []:
        return Verdict("unserved", "medium", f"no self-hosted runner is registered for {repo}",
                       ["GitHub has not listed the run's jobs yet"],
                       f"register a runner for {repo} (config.sh)")
    return Verdict("telemetry-unavailable", "low", "GitHub has not listed the run's jobs yet, "
                   "so their labels are unknown", [ctx.errors.get(repo) or "no jobs listed"],
                   "wait for the next refresh")


def queue_causes(runs: Sequence[Mapping[str, Any]], jobs: Sequence[Mapping[str, Any]],
                 ctx: Context,
                 now: float) -> list[dict[str, Any]]:
    by_run: dict[Any, list[Mapping[str, Any]]] = {}
    for job in jobs:  # each run's jobs found once, not by a look through all of them a run
        run_id = job.get("run_id")
        if isinstance(run_id, int | str):
            by_run.setdefault(run_id, []).append(job)
    return [classify_run(run, by_run.get(run["id"], []) if isinstance(run["id"], int | str)
                         else [], ctx, now)
            for run in runs if run.get("status") in ("queued", "pending")]

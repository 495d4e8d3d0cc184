"""Drift: where what is on disk, what the service manager runs and what GitHub has registered
disagree, plus runs stuck in the queue. Pure functions over the snapshot's views.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from fleet_min.timeutil import parse_iso


def _alert(kind: str, severity: str, message: str, **subject: Any) -> dict[str, Any]:
    return {"kind": kind, "severity": severity, "message": message, **subject}


def runner_drift(r: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    name, service = r["name"], r["service"]
    if service["active"] != "unknown" and not service["loaded"]:
        out.append(_alert("service-missing", "warning",
                          f"{name} is on disk but has no service unit {service['unit']}",
                          runner=name))
    elif service["loaded"] and service["active"] in ("failed", "inactive") and not r["draining"]:
        out.append(_alert("service-dead", "critical",
                          f"the service of {name} is {service['active']}", runner=name))
    if service["active"] == "active" and r["listener"] is None:
        out.append(_alert("no-listener", "critical",
                          f"the service of {name} runs but no Runner.Listener process was found",
                          runner=name))
    registration = r["registration"]
    if registration == "missing":
        out.append(_alert("unregistered", "warning",
                          f"{name} is on disk but not registered with {r['repo']}", runner=name))
    elif (registration == "registered" and r["registered"]["status"] == "offline"
          and not r["draining"]):
        out.append(_alert("offline", "warning",
                          f"{name} is registered but GitHub sees it offline", runner=name))
    return out


def label_mismatches(runners: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Siblings (same repo) whose label sets differ: a job may wait for one of them only."""
    by_repo: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runners:
        if r["repo"] and r["labels"]:
            by_repo[r["repo"]].append(r)
    out = []
    for repo, group in sorted(by_repo.items()):
        sets = {frozenset(label.lower() for label in r["labels"]) for r in group}
        if len(sets) > 1:
            names = ", ".join(sorted(r["name"] for r in group))
            out.append(_alert("label-mismatch", "warning",
                              f"the runners of {repo} ({names}) carry different labels",
                              repo=repo, runners=sorted(r["name"] for r in group)))
    return out


def ours(job: dict[str, Any], runners: list[dict[str, Any]]) -> bool:
    """Whether a job is for a self-hosted runner: it asks for `self-hosted`, or one of the known
    runners of its repository carries every label it asks for (a job may name custom labels
    only). `ubuntu-latest` and other GitHub images are GitHub's to run, never stuck here."""
    wanted = {str(label).lower() for label in job.get("labels") or []}
    if not wanted:
        return False
    if "self-hosted" in wanted:
        return True
    return any(r.get("repo") == job.get("repo") and
               wanted <= {str(label).lower() for label in r.get("labels") or []}
               for r in runners)


def stuck_runs(runs: list[dict[str, Any]], jobs: list[dict[str, Any]],
               runners: list[dict[str, Any]], now: float, stuck_s: float
               ) -> list[dict[str, Any]]:
    """Runs queued longer than stuck_s with a job a self-hosted runner should take; a run whose
    jobs GitHub has not listed yet is left to the queue causes (its labels are unknown)."""
    out = []
    for run in runs:
        if run.get("status") != "queued" or not run.get("created_at"):
            continue
        if not any(job.get("run_id") == run["id"] and ours({**job, "repo": run["repo"]},
                                                            runners) for job in jobs):
            continue
        waited = now - parse_iso(run["created_at"])
        if waited >= stuck_s:
            out.append(_alert("queue-stuck", "warning",
                              f"run {run['id']} of {run['repo']} ({run.get('name')}) has been "
                              f"queued for {int(waited // 60)} min", repo=run["repo"],
                              run_id=run["id"]))
    return out


def drift_alerts(runners: list[dict[str, Any]], runs: list[dict[str, Any]],
                 jobs: list[dict[str, Any]], every: list[dict[str, Any]], now: float,
                 stuck_s: float) -> list[dict[str, Any]]:
    """`runners` are this host's (their drift is ours to report); `every` adds the agents'
    runners, which decide whether a queued job is for a self-hosted runner at all."""
    out = [alert for r in runners for alert in runner_drift(r)]
    return out + label_mismatches(runners) + stuck_runs(runs, jobs, every, now, stuck_s)

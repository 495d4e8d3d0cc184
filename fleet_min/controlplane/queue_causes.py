"""Why each queued run waits: one classification per queued run, from the runners GitHub has
registered for its repository (on any host), their labels, state and this host's capacity."""

from __future__ import annotations

from typing import Any

from fleet_min.timeutil import parse_iso


def _needs(run: dict[str, Any], jobs: list[dict[str, Any]]) -> set[str]:
    labels: set[str] = set()
    for job in jobs:
        if job.get("run_id") == run["id"] and job.get("status") in ("queued", "waiting"):
            labels.update(label.lower() for label in job.get("labels") or [])
    return labels


def classify(run: dict[str, Any], jobs: list[dict[str, Any]],
             registered: list[dict[str, Any]] | None, draining: set[str],
             can_add: bool) -> tuple[str, str]:
    """(cause, sentence) for one queued run."""
    if registered is None:
        return "unknown", "GitHub's runner list for this repository is not available"
    needs = _needs(run, jobs)
    matching = [r for r in registered
                if needs <= {label.lower() for label in r.get("labels", [])}]
    wanted = ", ".join(sorted(needs)) or "any"
    if not matching:
        return "no-matching-runner", f"no runner of {run['repo']} has every label: {wanted}"
    online = [r for r in matching if r.get("status") == "online"]
    if not online:
        return "runners-offline", f"every runner with labels {wanted} is offline"
    ready = [r for r in online if r["name"] not in draining]
    if not ready:
        return "runners-draining", f"every online runner with labels {wanted} is draining"
    if all(r.get("busy") for r in ready):
        if not can_add:
            return "capacity", ("every matching runner is busy and this host is at capacity "
                                "(see capacity.reasons)")
        return "runners-busy", f"every runner with labels {wanted} is busy"
    return "dispatching", "an idle matching runner is online; GitHub has not assigned it yet"


def queue_causes(runs: list[dict[str, Any]], jobs: list[dict[str, Any]],
                 registered: dict[str, list[dict[str, Any]] | None], draining: set[str],
                 can_add: bool, now: float) -> list[dict[str, Any]]:
    out = []
    for run in runs:
        if run.get("status") != "queued":
            continue
        cause, message = classify(run, jobs, registered.get(run["repo"]), draining, can_add)
        created = run.get("created_at")
        out.append({"run_id": run["id"], "repo": run["repo"], "workflow": run.get("name"),
                    "queued_s": int(now - parse_iso(created)) if created else None,
                    "cause": cause, "message": message})
    return out

"""Autoscale: add a runner where jobs wait and one more fits, remove an idle duplicate where
none is needed. Off by default; when on, dry-run by default (decisions are proposed, nothing
runs). In execute mode the decision runs through the same action path as POST /api/action
(runner.duplicate, runner.deregister), audited as "autoscale".

decide() is a pure function of one repository's inputs:

- scale up when a queued run's cause is repo-at-capacity with a runner that can be duplicated,
  or when the next-hour forecast (medium confidence or better) expects more jobs at once than
  the repository has runners here;
- scale down when a runner that autoscale or an operator duplicated has been idle for
  `autoscale_idle_s`, nothing of the repository is queued, and the forecast needs fewer runners;
- refused, with the reasons, when capacity or the per-repo limit says no, or while the cooldown
  since the repository's last executed decision runs.
Only duplicates are ever removed, never the runner they were copied from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleet_min.controlplane.analysis.capacity import refusals_for_repo

USEFUL_CONFIDENCE = ("medium", "high")


@dataclass
class RepoState:
    repo: str
    runners: list[dict[str, Any]]                 # this host's runner views of the repository
    causes: list[dict[str, Any]]                  # queue causes of its queued runs
    forecast: dict[str, Any] | None               # combined next-hour prediction
    duplicates: dict[str, float]                  # duplicate name -> idle since (epoch s)
    last_executed_at: float | None
    capacity: dict[str, Any] = field(default_factory=dict)


@dataclass
class Decision:
    repo: str
    direction: str                                # "up" or "down"
    outcome: str                                  # "proposed", "refused" (later "executed"...)
    action: dict[str, Any] | None
    reasons: list[str]
    inputs: dict[str, Any]


def _inputs(s: RepoState) -> dict[str, Any]:
    return {"runners": len(s.runners), "busy": sum(1 for r in s.runners if r["busy"]),
            "queued_runs": len(s.causes),
            "at_capacity_runs": sum(1 for c in s.causes if c["cause"] == "repo-at-capacity"),
            "forecast": None if s.forecast is None else {
                "value": s.forecast.get("value"), "confidence": s.forecast.get("confidence")}}


def _forecast_need(s: RepoState) -> float | None:
    f = s.forecast
    if not f or f.get("value") is None or f.get("confidence") not in USEFUL_CONFIDENCE:
        return None
    return float(f["value"])


def _up_reasons(s: RepoState) -> tuple[list[str], str | None]:
    reasons, sibling = [], None
    waiting = [c for c in s.causes if c["cause"] == "repo-at-capacity"]
    for cause in waiting:
        action = (cause.get("recommendation") or {}).get("action")
        if action and action.get("id") == "runner.duplicate":
            sibling = sibling or action["args"]["name"]
    if waiting:
        reasons.append(f"{len(waiting)} queued run(s) wait with every runner busy")
    need = _forecast_need(s)
    if need is not None and need > len(s.runners):
        reasons.append(f"the forecast expects {need:g} job(s) at once next hour for "
                       f"{len(s.runners)} runner(s)")
    if reasons and sibling is None:
        ready = [r["name"] for r in s.runners if not r["draining"]
                 and r["registration"] == "registered"]
        sibling = ready[0] if ready else None
    return reasons, sibling


def decide(s: RepoState, now: float, cooldown_s: float, idle_s: float) -> Decision | None:
    inputs = _inputs(s)
    reasons, sibling = _up_reasons(s)
    if reasons:
        action = {"id": "runner.duplicate", "args": {"name": sibling}} if sibling else None
        refusals = _refusals(s, now, cooldown_s)
        if sibling is None:
            refusals.append("no registered, non-draining runner of the repository to copy")
        return Decision(s.repo, "up", "refused" if refusals else "proposed", action,
                        reasons + refusals, inputs)
    return _down(s, now, cooldown_s, idle_s, inputs)


def _cooldown(s: RepoState, now: float, cooldown_s: float) -> list[str]:
    if s.last_executed_at is not None and now - s.last_executed_at < cooldown_s:
        return [f"cooldown: the last autoscale action for {s.repo} ran "
                f"{int(now - s.last_executed_at)} s ago (cooldown {int(cooldown_s)} s)"]
    return []


def _refusals(s: RepoState, now: float, cooldown_s: float) -> list[str]:
    out = list(refusals_for_repo(s.capacity, s.repo)) if s.capacity else []
    return out + _cooldown(s, now, cooldown_s)


def _down(s: RepoState, now: float, cooldown_s: float, idle_s: float,
          inputs: dict[str, Any]) -> Decision | None:
    if s.causes:
        return None
    idle = sorted((since, name) for name, since in s.duplicates.items()
                  if any(r["name"] == name and r["state"] == "idle" for r in s.runners)
                  and now - since >= idle_s)
    if not idle:
        return None
    need = _forecast_need(s) or 0.0
    since, name = idle[0]
    if need > len(s.runners) - 1:
        return Decision(s.repo, "down", "refused", None, [
            f"{name} is an idle duplicate, but the forecast expects {need:g} job(s) at once "
            f"next hour for {len(s.runners)} runner(s)"], inputs)
    reasons = [f"{name} is a duplicate idle for {int(now - since)} s "
               f"(threshold {int(idle_s)} s) and nothing of {s.repo} is queued"]
    cooldown = _cooldown(s, now, cooldown_s)
    return Decision(s.repo, "down", "refused" if cooldown else "proposed",
                    {"id": "runner.deregister", "args": {"name": name, "delete_dir": True}},
                    reasons + cooldown, inputs)

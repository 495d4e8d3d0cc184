"""The wire of the agents and clients already in the field (decisions.md; docs/api.md,
"Compatibility"): the names they send beside ours, turned into the neutral form once, when a
document is accepted, so that nothing stored or shown carries them.

- suite kinds `maestro`, `xcuitest` and `playwright` are `flow_runner`, `native_bundle` and
  `browser_runner`;
- `report_to.github_status` is `report_to.ci_status`;
- a result row without `iter` is iteration 0.

Beacon field names are not rewritten: a beacon is kept as the agent sent it, and the constraint
rules read both spellings (rules.constraint_refusal).

Each function costs a few dictionary lookups on the usual document, which needs no change and is
returned as it is.
"""

from __future__ import annotations

from typing import Any

from fleet_min.errors import BadRequest
from fleet_min.validate import SUITE_KIND_ALIASES


def neutral_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """A validated job spec with the aliases replaced (a copy when one was present)."""
    suite, report = spec.get("suite"), spec.get("report_to")
    kind = suite.get("kind") if isinstance(suite, dict) else None
    renamed = isinstance(kind, str) and kind in SUITE_KIND_ALIASES
    reported = isinstance(report, dict) and "github_status" in report
    if not renamed and not reported:
        return spec
    spec = dict(spec)
    if renamed:
        assert isinstance(suite, dict) and isinstance(kind, str)
        spec["suite"] = {**suite, "kind": SUITE_KIND_ALIASES[kind]}
    if reported:
        assert isinstance(report, dict)
        spec["report_to"] = _neutral_report(report)
    return spec


def _neutral_report(report: dict[str, Any]) -> dict[str, Any]:
    target = report["github_status"]
    if report.get("ci_status", target) != target:
        raise BadRequest("report_to names two targets, ci_status and github_status (its older "
                         "name); send ci_status only")
    neutral = {k: v for k, v in report.items() if k != "github_status"}
    neutral["ci_status"] = target
    return neutral


def neutral_row(row: dict[str, Any]) -> dict[str, Any]:
    """A validated result row; one without `iter` becomes iteration 0 (a copy)."""
    return row if "iter" in row else {**row, "iter": 0}

"""The dashboard guard: which routes are dashboard changes, and whether a request may make one.

A route is named by its method and its route template (for example `POST
/api/jobs/{job_id}/cancel`), never by the request path alone: the template is what the router
matched, so percent-encoding tricks in the path cannot walk around a rule. New routes join the
guard by adding a rule to GUARDED; routes that change state but must stay open (agents, POST
/jobs, ticks) are listed in OPEN_ON_PURPOSE so a test can insist every mutating /api route is
in one list or the other.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass

from fleet_min.config import CollectorConfig
from fleet_min.errors import Forbidden, Unauthorized

TOKEN_HEADER = "X-Fleet-Token"  # noqa: S105 - a header name, not a secret
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})

MISSING = "this collector requires X-Fleet-Token for dashboard changes"
WRONG = "X-Fleet-Token does not match this collector's dashboard token"
CROSS_SITE = ("a page on another site cannot change this collector; use its own dashboard "
              "or a client that is not a browser")


@dataclass(frozen=True)
class RouteRule:
    """Methods plus a template pattern: `{}` is any one path variable, a trailing `*` a prefix."""

    methods: frozenset[str]
    pattern: str
    why: str
    template_re: re.Pattern[str]
    path_re: re.Pattern[str]

    def matches(self, method: str, template: str | None, path: str) -> bool:
        if method not in self.methods:
            return False
        if template is not None and self.template_re.fullmatch(template):
            return True
        # The path is checked too, so a rule holds even for a route registered in an unusual way.
        return bool(self.path_re.fullmatch(path))


def _compile(pattern: str, variable: str) -> re.Pattern[str]:
    prefix = pattern.endswith("*")
    body = pattern[:-1] if prefix else pattern
    regex = variable.join(re.escape(part) for part in body.split("{}"))
    return re.compile(regex + (".*" if prefix else ""), re.S)


def rule(methods: str, pattern: str, why: str) -> RouteRule:
    """A rule for `methods` ("POST", "PATCH DELETE", or "*" for every mutating method)."""
    wanted = MUTATING if methods == "*" else frozenset(methods.split())
    return RouteRule(wanted, pattern, why, _compile(pattern, r"\{[^{}/]+\}"),
                     _compile(pattern, r"[^/]+"))


GUARDED: tuple[RouteRule, ...] = (
    rule("POST", "/api/jobs/{}/cancel", "cancel a job"),
    rule("POST", "/api/jobs/{}/retry", "retry a job"),
    rule("PATCH", "/api/jobs/{}", "change a job's priority"),
    rule("PATCH DELETE", "/api/devices/{}", "edit or forget a device"),
    rule("*", "/api/devices/{}/*", "any other change to a device"),
    rule("POST", "/api/devices/forget", "forget many devices at once"),
    rule("DELETE", "/api/executors/{}", "forget a host executor"),
    rule("*", "/api/schedules*", "create, change, enable, run or delete a schedule"),
    rule("POST", "/schedules", "create or replace a schedule (the original's route)"),
    rule("PATCH DELETE", "/schedules/{}", "enable, change or delete a schedule (the original's "
         "route)"),
    rule("*", "/api/templates*", "save, change, delete or enqueue from a job template"),
    rule("POST", "/api/alerts/{}/ack", "acknowledge an alert"),
    rule("POST", "/api/alerts/{}/snooze", "snooze an alert"),
    rule("*", "/api/alerts/{}/*", "any other change to an alert"),
    rule("*", "/api/artifacts*", "delete an artifact, pin, unpin, accept a baseline"),
    rule("*", "/api/visual*", "accept a capture as a visual baseline"),
    rule("*", "/api/system/retention*", "prune old rows (a dry run is guarded too)"),
    rule("POST", "/api/system/sweep", "requeue or fail expired claims on demand"),
    rule("POST", "/api/peers/forget", "let a peer's address name a new collector id"),
)

# Mutating routes that stay open on purpose: agents and scripts use them, and the spec keeps
# POST /jobs open. A tick only does early what the service's own loop would do anyway.
OPEN_ON_PURPOSE: tuple[RouteRule, ...] = (
    rule("POST", "/jobs", "enqueue (always open, by the spec)"),
    rule("POST", "/api/jobs", "enqueue: the original clients' name for POST /jobs"),
    rule("*", "/jobs/*", "agent release (the mesh allowlist applies) and the lease sweep"),
    rule("POST", "/devices/register", "agent registration (the mesh allowlist applies)"),
    rule("POST", "/executors/register",
         "executor registration (the mesh allowlist and name binding apply)"),
    rule("POST", "/results", "agent results and beacons (the mesh allowlist applies)"),
    rule("POST", "/api/jobs/{}/mirror", "live-mirror frames from a running host job's "
         "executor (the mesh allowlist and name binding apply)"),
    rule("POST", "/locks/*", "a host job's device locks, by its claimant (the mesh allowlist "
         "and name binding apply)"),
    rule("*", "/artifacts*", "artifact upload by agents and CI"),
    rule("POST", "/schedules/tick", "scheduler tick, like POST /jobs/sweep"),
    rule("POST", "/api/alerts/tick", "alert evaluation on demand"),
    rule("POST", "/api/jobs/preview-targets", "reads only: counts matching devices"),
    rule("POST", "/events/{}", "pipeline topics: workloads publish events"),
    rule("POST", "/api/events/{}", "pipeline topics: the same publish under /api"),
    rule("*", "/api/peers/{}/*", "the peer proxy answers every mutation with 403 itself"),
)


def _one_pattern(patterns: list[re.Pattern[str]]) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{p.pattern})" for p in patterns) or "(?!)", re.S)


# Per method, the guarded rules' templates and paths as one alternation each: a request to an
# agent route (POST /results, POST /jobs) is two regex matches, not two per rule.
_GUARDED_BY_METHOD: dict[str, tuple[re.Pattern[str], re.Pattern[str]]] = {
    method: (_one_pattern([r.template_re for r in GUARDED if method in r.methods]),
             _one_pattern([r.path_re for r in GUARDED if method in r.methods]))
    for method in MUTATING
}


def is_guarded(method: str, template: str | None, path: str) -> bool:
    patterns = _GUARDED_BY_METHOD.get(method)
    if patterns is None:
        return False  # every guarded route changes something; reads never pay for the scan
    template_re, path_re = patterns
    return ((template is not None and template_re.fullmatch(template) is not None)
            or path_re.fullmatch(path) is not None)


def is_open_on_purpose(method: str, template: str | None, path: str) -> bool:
    return any(r.matches(method, template, path) for r in OPEN_ON_PURPOSE)


def check(method: str, template: str | None, path: str, headers: Mapping[str, str],
          token: str | None) -> None:
    """Refuse a dashboard change that lacks the token.

    A page on another site is refused before this, for every change (fleet_min.origin): it
    must not use a visitor's browser to change a collector on their network, token or not.
    """
    # No token set (the default): nothing to require, so no route is scanned for it.
    if token and is_guarded(method.upper(), template, path):
        _require(headers, token, MISSING)


def _require(headers: Mapping[str, str], token: str, missing: str) -> None:
    """401 without the token, 403 with another; the comparison is constant-time."""
    given = headers.get(TOKEN_HEADER)
    if given is None or given == "":
        raise Unauthorized(missing)
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                               token.encode("utf-8", "surrogateescape")):
        raise Forbidden(WRONG)


# Workloads whose jobs use a secret of the executor's owner on bytes the job names: an archive
# job signs its source with a release key. POST /jobs stays open (the spec), so with a token set
# such a job is a dashboard change: whoever can reach the collector must not get their own bytes
# signed under the owner's name.
SIGNING_WORKLOADS = frozenset({"archive"})
SIGNING_MISSING = ("this collector requires X-Fleet-Token for jobs that sign with an executor's "
                   "release key (the archive workload), and for jobs whose workload is a "
                   "template reference, which could resolve to one")


def check_signing_jobs(workloads: list[str], headers: Mapping[str, str],
                       token: str | None) -> None:
    """Refuse jobs of a signing workload without the dashboard token, when one is set. A
    workload holding a template reference (`${jobs.<id>.metrics.<key>}`, whole or inside a
    longer name) is named only at promotion, from a dependency's row that whoever ran it
    chose, so it counts as signing: without this a job queued as `${jobs.dep.metrics.wl}`
    became an archive job nobody with the token had asked for."""
    if token and any(workload in SIGNING_WORKLOADS or "${" in workload
                     for workload in workloads):
        _require(headers, token, SIGNING_MISSING)


def dash_token(config: CollectorConfig) -> str | None:
    """FLEET_DASH_TOKEN, or None when unset."""
    value = str(config.dash_token).strip()
    return value or None

"""GitHub Actions billing of the watched repositories' owners, when the token may read it.

For each owner GitHub is asked whether it is a user or an organisation, then for its Actions
billing (`/users/{u}/settings/billing/actions` or `/orgs/{o}/settings/billing/actions`): minutes
used this billing cycle, paid minutes, included minutes, and minutes per runner OS. Those need a
token with the `user` or `admin:org` scope (read:org is not enough); without it the answer is
`{"available": false, "reason": ...}`. Jobs on self-hosted runners use no minutes, so these
figures are what GitHub-hosted jobs cost; the cycle is GitHub's, not a calendar month.
Answers are kept for CACHE_S: billing changes slowly and each owner costs two requests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleet_min.controlplane.github.client import GitHub, GitHubError
from fleet_min.timeutil import iso

CACHE_S = 3600.0


def _owner_figures(owner: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    def number(key: str) -> float | None:
        value = body.get(key)
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None

    breakdown = body.get("minutes_used_breakdown")
    return {"owner": owner, "type": kind, "available": True,
            "total_minutes_used": number("total_minutes_used"),
            "total_paid_minutes_used": number("total_paid_minutes_used"),
            "included_minutes": number("included_minutes"),
            "minutes_used_breakdown": {str(k): v for k, v in breakdown.items()
                                       if isinstance(v, int | float)}
            if isinstance(breakdown, dict) else {}}


class Billing:
    def __init__(self, github: GitHub, clock: Callable[[], float]) -> None:
        self.github = github
        self.clock = clock
        self._cache: dict[str, tuple[float, dict[str, Any]]] = {}

    async def owner(self, owner: str) -> dict[str, Any]:
        cached = self._cache.get(owner)
        if cached and self.clock() - cached[0] < CACHE_S:
            return cached[1]
        try:
            kind = await self.github.account_type(owner) or "User"
            body = await self.github.actions_billing(owner, kind == "Organization")
            entry = _owner_figures(owner, kind, body)
        except GitHubError as exc:
            why = ("the token may not read this account's billing (it needs the user or "
                   "admin:org scope)" if exc.status in (401, 403, 404) else str(exc))
            entry = {"owner": owner, "available": False, "reason": why}
        entry["fetched_at"] = iso(self.clock())
        self._cache[owner] = (self.clock(), entry)
        return entry

    async def snapshot(self, owners: list[str]) -> dict[str, Any]:
        if not self.github.token:
            return {"available": False, "reason": "no GitHub token: set GH_TOKEN (or log in "
                    "with gh)", "owners": []}
        if not owners:
            return {"available": False, "reason": "no repository is watched yet", "owners": []}
        entries = [await self.owner(owner) for owner in sorted(set(owners))]
        usable = [e for e in entries if e["available"]]
        out: dict[str, Any] = {"available": bool(usable), "owners": entries,
                               "note": "self-hosted runners use no Actions minutes; these "
                                       "figures are GitHub-hosted usage this billing cycle"}
        if not usable:
            out["reason"] = "; ".join(f"{e['owner']}: {e['reason']}" for e in entries)
        return out

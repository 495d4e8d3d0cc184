"""Federation as this daemon serves it: agent hosts' heartbeats and results (the coordinator's
side, kept by hosts.py) and the list of every host (GET /api/hosts), this one first, with its
link to its own coordinator when it is an agent. Domain only: no aiohttp.web here.
"""

from __future__ import annotations

from typing import Any

from fleet_min.controlplane.federation.hosts import (
    MAX_RESULTS,
    RUNNER_FIELDS,
    applied_of,
    check_host,
    clean_report,
    instance_of,
    wait_of,
)
from fleet_min.controlplane.federation.link import CoordinatorLink
from fleet_min.controlplane.state import Plane
from fleet_min.errors import BadRequest, Conflict, Forbidden
from fleet_min.timeutil import iso


def _speaks_for(host: str, bound: str | None) -> str:
    """Refuse (403) a host token used for another host's name."""
    if bound is not None and host != bound:
        raise Forbidden(f"this token is the host token of {bound!r}; it cannot speak for "
                        f"{host!r} (make that host its own: fleet-min controlplane token "
                        f"--agent-host {host})")
    return host


class Coordinator:
    def __init__(self, plane: Plane, link: CoordinatorLink | None) -> None:
        self.plane = plane
        self.link = link  # this host's own link when it runs as an agent

    async def heartbeat(self, body: dict[str, Any], bound: str | None = None) -> dict[str, Any]:
        """Keep an agent's report; answer with its commands (held up to its wait_s for one).
        `bound`: the one host the caller's token may speak for (a host token), or None."""
        host = _speaks_for(check_host(body.get("host")), bound)
        if host == self.plane.host_name:
            raise Conflict(f"{host} is this coordinator's own name; give the agent its own "
                           "(FLEET_HOST_NAME)")
        report, wait_s, applied, instance = (clean_report(body), wait_of(body),
                                             applied_of(body), instance_of(body))
        del body  # not held while the heartbeat waits: only the cleaned report is kept
        report = self.plane.hosts.fit(host, report)
        unwatched = self._unwatched(report)
        queue, commands = await self.plane.hosts.heartbeat(
            host, report, wait_s, applied, instance, self.plane.setting("stale_after_s"))
        return {"ok": True, "queue": queue, "commands": commands,
                "runners_kept": len(report["runners"]), "runners_dropped": report["dropped"],
                "unwatched_repos": unwatched}

    def _unwatched(self, report: dict[str, Any]) -> list[str]:
        """The repositories of a report's runners this coordinator does not read from GitHub
        (neither its own nor in FLEET_AGENT_REPOS): listed, never watched."""
        return self.plane.unwatched({r["repo"] for r in report.get("runners", [])
                                     if r.get("repo")})

    async def results(self, body: dict[str, Any], who: str, bound: str | None = None
                      ) -> dict[str, Any]:
        """An agent's command results, matched to the commands queued for it and audited."""
        host, results = _speaks_for(check_host(body.get("host")), bound), body.get("results")
        # Bounded: each result is a statement in the one writer's transaction, so an unbounded
        # list would hold the writer for seconds.
        if not isinstance(results, list) or len(results) > MAX_RESULTS or not all(
                isinstance(r, dict) and isinstance(r.get("id"), str) for r in results):
            raise BadRequest(f"results must be a list of at most {MAX_RESULTS} objects, each "
                             "with a string id")
        self.plane.hosts.check_instance(host, instance_of(body),
                                        self.plane.setting("stale_after_s"))
        matched = await self.plane.hosts.results(host, results, who)
        return {"ok": True, "received": len(results), "matched": matched}

    async def hosts_report(self) -> dict[str, Any]:
        """Every host: this one (with its role) and each agent that has called in."""
        plane = self.plane
        snap = plane.snapshot
        here: dict[str, Any] = {
            "host": plane.host_name, "role": plane.role,
            "runners": [{k: v.get(k) for k in RUNNER_FIELDS} for v in plane.views],
            "capacity": snap.get("capacity"), "vitals": snap.get("vitals"),
            "load": (snap.get("vitals") or {}).get("load"), "heartbeat_age_s": 0.0,
            "last_heartbeat_at": snap.get("generated_at"), "stale": False,
            "pending_commands": 0, "local": True}
        if self.link is not None:
            link = self.link.status()
            here["coordinator"] = {**link, "last_ok_at": iso(link["last_ok_at"])}
        stale = plane.setting("stale_after_s")
        agents = [{**h, "local": False, "unwatched_repos": self._unwatched(h)}
                  for h in await plane.hosts.listing(stale)]
        return {"generated_at": iso(plane.clock()), "stale_after_s": stale,
                "hosts": [here, *agents], "commands": await plane.hosts.commands(limit=50)}

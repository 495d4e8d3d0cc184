"""The snapshot: this host's runners (discovered, with their service states and GitHub
registrations), the agents' runners, active runs, capacity, drift, queue causes and alerts, as
GET /api/state serves it and the stream sends it.

A tick rebuilds it (faster while a runner is busy, at once when something asks: an action, a
setting change, a GitHub refresh) and publishes it to the stream's hub, encoded once for every
client. Each rebuild also records the runners' transitions as events and stops the service of a
drained runner once its job has ended. Domain only: no aiohttp.web here.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fleet_min.controlplane import store
from fleet_min.controlplane.analysis.capacity import capacity
from fleet_min.controlplane.analysis.drift import drift_alerts
from fleet_min.controlplane.analysis.queue_causes import Context, queue_causes
from fleet_min.controlplane.github.client import GitHub
from fleet_min.controlplane.loops import stop_tasks
from fleet_min.controlplane.runners.discovery import Discovery, Runner
from fleet_min.controlplane.runners.procs import process_table
from fleet_min.controlplane.runners.supervisor import ServiceState, Supervisor, service_name
from fleet_min.controlplane.runners.vitals import host_vitals
from fleet_min.controlplane.state import Plane
from fleet_min.http import link_url
from fleet_min.jsonio import dumps_body
from fleet_min.sse import EventHub
from fleet_min.timeutil import iso, now

log = logging.getLogger(__name__)

DRAIN_RETRY_S = 60.0


class Snapshots:
    """Builds the snapshot into the plane and publishes it; the tick loop while running."""

    def __init__(self, plane: Plane, supervisor: Supervisor, github: GitHub,
                 hub: EventHub) -> None:
        self.plane = plane
        self.supervisor = supervisor
        self.github = github
        self.hub = hub  # a latest_only hub: each client gets the newest snapshot
        self.discovery = Discovery(plane.root)  # reads a runner's files only when they change
        self.ticks = 0
        self._build_lock = asyncio.Lock()
        self._previous: dict[str, dict[str, Any]] = {}
        self._drain_tried: dict[str, float] = {}
        self._after_tick: list[Callable[[], Awaitable[object]]] = []
        self._tasks: list[asyncio.Task[None]] = []

    def after_tick(self, hook: Callable[[], Awaitable[object]]) -> None:
        """Run `hook` after each tick's rebuild (not after the rebuilds others ask for)."""
        self._after_tick.append(hook)

    async def running(self, _app: object) -> AsyncIterator[None]:
        """The first snapshot, then the tick loop until the daemon stops (a cleanup context)."""
        await self.rebuild()
        self._tasks = [asyncio.create_task(self._tick_loop(), name="controlplane-tick")]
        yield
        self.hub.close()
        await stop_tasks(self._tasks)

    async def _tick_loop(self) -> None:
        while True:
            await self.plane.tick.wait(time.monotonic())
            try:
                await self.rebuild()
                for hook in self._after_tick:
                    await hook()
            except Exception:
                log.exception("snapshot rebuild failed; the next tick tries again")

    def forget_drain_attempt(self, name: str) -> None:
        """A drain or resume by hand: the next idle drained service is stopped at once."""
        self._drain_tried.pop(name, None)

    async def discover(self) -> list[Runner]:
        return await asyncio.to_thread(lambda: self.discovery.discover(process_table()))

    async def rebuild(self) -> dict[str, Any]:
        plane = self.plane
        async with self._build_lock:
            plane.runners, plane.states = await self._runners_and_states()
            self._note_clashes(self.discovery.clashes)
            vitals = await asyncio.to_thread(host_vitals, plane.root)
            # Each repository's registrations by name, once per rebuild (the first of a name
            # wins, as a scan of the list would find it), not a scan of the list per runner.
            registered = {repo: {x["name"]: x for x in reversed(data.runners)}
                          for repo, data in plane.repos.items() if data.runners is not None}
            views = [self._view(r, registered) for r in plane.runners]
            await self._record_transitions(views)
            await self._enforce_drains(views)
            plane.views = views
            plane.snapshot = self._compose(views, vitals)
            self.ticks += 1
            self.hub.publish_latest(dumps_body(plane.snapshot))
            return plane.snapshot

    async def _runners_and_states(self) -> tuple[list[Runner], dict[str, ServiceState]]:
        """This host's runners and their services' states. The service manager is asked about
        the runners of the last build while discovery walks the root: one waits on a child
        process, the other on the disk (at 1,000 runners they took 25 and 15 ms one after the
        other). A runner that is new, or whose service name changed, is asked about after."""
        before = self.plane.runners
        known = {r.name: service_name(r) for r in before}
        asked = asyncio.create_task(self.supervisor.states(before)) if before else None
        if asked is not None:
            # Let the query start its child before the discovery thread starts: forking while
            # that thread held the interpreter's lock cost the loop a 5 ms switch interval.
            await asyncio.sleep(0)
        try:
            runners = await self.discover()
        except BaseException:
            if asked is not None:
                asked.cancel()
                await asyncio.gather(asked, return_exceptions=True)
            raise
        states = await asked if asked is not None else {}
        fresh = [r for r in runners if known.get(r.name) != service_name(r)]
        if fresh:
            states.update(await self.supervisor.states(fresh))
        return runners, {r.name: states[r.name] for r in runners}

    def _view(self, r: Runner, registered: dict[str, dict[str, dict[str, Any]]]
              ) -> dict[str, Any]:
        state = self.plane.states[r.name]
        listed = registered.get(r.repo) if r.repo else None
        reg = listed.get(r.name) if listed is not None else None
        registration = "unknown" if listed is None else ("registered" if reg else "missing")
        busy = r.working or bool(reg and reg["busy"])
        running = state.active == "active" and r.listener is not None
        if busy:
            label = "working"
        elif running:
            label = "draining" if r.draining else "idle"
        else:
            label = "drained" if r.draining else ("failed" if state.active == "failed"
                                                   else "stopped")
        return {"name": r.name, "dir": r.rel, "repo": r.repo, "owner": r.owner,
                "url": link_url(r.url),
                "labels": reg["labels"] if reg else r.labels,
                "custom_labels": reg["custom_labels"] if reg else r.labels,
                "version": r.version, "staged_versions": r.staged, "draining": r.draining,
                "draining_since": r.draining_since, "service": state.as_json(),
                "listener": _proc(r.listener), "workers": [_proc(w) for w in r.workers],
                "registration": registration,
                "registered": ({"id": reg["id"], "status": reg["status"], "busy": reg["busy"]}
                               if reg else None),
                "busy": busy, "state": label, "host": self.plane.host_name, "remote": False,
                "stale": False}

    def _compose(self, views: list[dict[str, Any]], vitals: dict[str, Any]) -> dict[str, Any]:
        at = now()
        plane, repos, setting = self.plane, self.plane.repos, self.plane.setting
        runs = [run for data in repos.values() for run in data.runs]
        jobs = [job for data in repos.values() for job in data.jobs]
        cap = capacity(views, vitals, setting)
        every = views + plane.hosts.remote_views(setting("stale_after_s"))
        ctx = Context(registered={repo: data.runners for repo, data in repos.items()},
                      views={v["name"]: v for v in reversed(every)},
                      local={v["name"] for v in views}, capacity=cap,
                      errors={repo: d.error for repo, d in repos.items() if d.error})
        if not self.github.token:
            ctx.errors = {repo: "no GitHub token" for repo in repos}
        return {
            "generated_at": iso(at),
            "host": {"name": plane.host_name, "platform": platform.system().lower(),
                     "supervisor": self.supervisor.kind, "root": str(plane.root),
                     "read_only": bool(plane.cfg.read_only), "role": plane.role,
                     "coordinator": plane.cfg.coordinator or None},
            "runners": every,
            "active_runs": _active_runs(runs, jobs),
            "groups": self._groups(every),
            "vitals": vitals,
            "capacity": cap,
            "drift": drift_alerts(views, runs, jobs, every, at, setting("stuck_queue_s")),
            "queue_causes": queue_causes(runs, jobs, ctx, at),
            "alerts": self._alerts(cap),
            "github": {**self.github.status(),
                       "repos": {repo: {"error": d.error, "refreshed_at": iso(d.refreshed_at)}
                                 for repo, d in sorted(repos.items())}},
        }

    def _groups(self, views: list[dict[str, Any]]) -> list[dict[str, Any]]:
        mode = self.plane.setting("grouping")
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for v in views:
            if mode == "owner":
                key = v["owner"] or "(none)"
            elif mode == "labels":
                key = ",".join(sorted(v["labels"])) or "(no labels)"
            else:
                key = v["repo"] or v["owner"] or "(none)"
            groups[key].append(v)
        # `members` names each runner with its host too: an agent's runner may share a name with
        # one of this host's (cloned images), and a page that took the name alone showed one
        # host's runner twice, hid the other, and sent its actions to the wrong host.
        return [{"key": key, "by": mode, "runners": [v["name"] for v in members],
                 "members": [{"name": v["name"], "host": v["host"]} for v in members],
                 "total": len(members), "busy": sum(v["busy"] for v in members),
                 "draining": sum(v["draining"] for v in members)}
                for key, members in sorted(groups.items())]

    def _alerts(self, cap: dict[str, Any]) -> list[dict[str, Any]]:
        alerts = []
        if self.plane.runners and not self.github.token:
            alerts.append({"severity": "warning", "message": "no GitHub token: set GH_TOKEN "
                           "(or log in with gh) to see registrations and queued runs"})
        for repo, data in sorted(self.plane.repos.items()):
            if data.error:
                alerts.append({"severity": "warning", "message": f"{repo}: {data.error}"})
        rate = self.github.rate
        if rate.get("limit") and rate["remaining"] < rate["limit"] * 0.1:
            alerts.append({"severity": "warning", "message": f"GitHub rate limit low: "
                           f"{rate['remaining']} of {rate['limit']} left until {rate['reset_at']}"})
        if not cap["can_add"]:
            alerts.append({"severity": "info", "message": "no room for another runner: "
                           + "; ".join(cap["reasons"])})
        for name, folders in sorted(self.plane.clashes.items()):
            alerts.append({"severity": "warning", "message": clash_sentence(name, folders)})
        return alerts

    async def _record_transitions(self, views: list[dict[str, Any]]) -> None:
        events = []
        current = {v["name"]: v for v in views}
        for name, v in current.items():
            before = self._previous.get(name)
            if before is None:
                if self._previous or self.ticks:
                    events.append((name, "discovered", f"found in {v['dir']}"))
                continue
            if before["state"] != v["state"]:
                events.append((name, "state", f"{before['state']} -> {v['state']}"))
            was = (before["registered"] or {}).get("status")
            is_ = (v["registered"] or {}).get("status")
            if was != is_ and v["registration"] != "unknown":
                events.append((name, "github", f"GitHub status {was or 'none'} -> {is_ or 'none'}"))
        for name in self._previous.keys() - current.keys():
            events.append((name, "removed", "no longer found under the root"))
        self._previous = current
        if events:
            await self.plane.db.write(store.add_events, events)

    def _note_clashes(self, clashes: dict[str, list[str]]) -> None:
        """Keep the names several directories claim, and log each new clash once."""
        for name, folders in clashes.items():
            if self.plane.clashes.get(name) != folders:
                log.warning("runner directories %s all claim the name %r in their .runner "
                            "files; no action is taken on %s until one alone does",
                            ", ".join(folders), name, name)
        self.plane.clashes = clashes

    async def _enforce_drains(self, views: list[dict[str, Any]]) -> None:
        """A draining runner's service is stopped as soon as it is idle (its job has ended);
        never one whose name another directory claims too (which runner it is, is unknown)."""
        for v in views:
            if not v["draining"] or v["busy"] or v["service"]["active"] != "active":
                continue
            if v["name"] in self.plane.clashes:
                continue
            if time.monotonic() - self._drain_tried.get(v["name"], -DRAIN_RETRY_S) < DRAIN_RETRY_S:
                continue
            self._drain_tried[v["name"]] = time.monotonic()
            runner = next(r for r in self.plane.runners if r.name == v["name"])
            result = await self.supervisor.stop(runner, self.plane.states[v["name"]])
            await self.plane.record(v["name"], "drain", "idle now; service stopped" if result.ok
                                    else "stopping the drained service failed: "
                                    f"{result.output[-200:]}")


def clash_sentence(name: str, folders: list[str]) -> str:
    """What an alert and a refused action say of a name several runner directories claim."""
    return (f"the runner directories {', '.join(folders)} all claim the name {name!r} in their "
            f".runner files (a job may have rewritten one); no action is taken on {name} until "
            "one alone does")


def _active_runs(runs: list[dict[str, Any]], jobs: list[dict[str, Any]]
                 ) -> list[dict[str, Any]]:
    """Each run with its jobs, without their steps: nothing that reads the snapshot shows them
    (the job history keeps them), and every tick encodes the whole snapshot again (a job of 5.5
    million steps once made each one 451 MB)."""
    by_run: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for job in jobs:
        by_run[job["run_id"]].append({k: v for k, v in job.items() if k != "steps"})
    return [{**run, "jobs": by_run.get(run["id"], [])} for run in runs]


def _proc(proc: Any) -> dict[str, Any] | None:
    if proc is None:
        return None
    return {"pid": proc.pid, "rss_kb": proc.rss_kb, "uptime_s": int(proc.uptime_s)}

"""The control plane's engine: discovery, supervisor states, GitHub data and the snapshot.

One ControlPlane per daemon. A tick rebuilds the snapshot (faster while a runner is busy, at
once after an action or a setting change) and publishes it to the stream; a second loop keeps
the GitHub data fresh with conditional requests (and lets autoscale look at it); a third runs
the analysis rounds (job history, workflow files, forecast). In agent mode a fourth sends
heartbeats to the coordinator. Domain only: no aiohttp.web here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import socket
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from fleet_min import filemodes
from fleet_min.config import Config
from fleet_min.controlplane import store, tokens
from fleet_min.controlplane.analysis.capacity import capacity
from fleet_min.controlplane.analysis.drift import drift_alerts
from fleet_min.controlplane.analysis.queue_causes import Context, queue_causes
from fleet_min.controlplane.analysis.reports import Analysis
from fleet_min.controlplane.federation.hosts import RUNNER_FIELDS, Hosts
from fleet_min.controlplane.federation.link import (
    CoordinatorLink,
    coordinator_token,
    coordinator_token_file,
)
from fleet_min.controlplane.github.client import GitHub, GitHubError, find_token
from fleet_min.controlplane.github.history import job_row
from fleet_min.controlplane.loops import Pacer, stop_tasks
from fleet_min.controlplane.runners import diag
from fleet_min.controlplane.runners.discovery import Discovery, Runner
from fleet_min.controlplane.runners.procs import process_table
from fleet_min.controlplane.runners.supervisor import ServiceState, choose
from fleet_min.controlplane.runners.vitals import host_vitals
from fleet_min.controlplane.settings import LiveValues, lookup
from fleet_min.controlplane.stream import SnapshotHub
from fleet_min.db import Database
from fleet_min.errors import NotFound
from fleet_min.timeutil import iso, now

log = logging.getLogger(__name__)

DRAIN_RETRY_S = 60.0
COMPLETED_JOBS_PER_REFRESH = 10
RUN_STATUSES = ("queued", "pending", "in_progress")


class RepoData:
    """What GitHub said about one repository at the last refresh."""

    def __init__(self) -> None:
        self.runners: list[dict[str, Any]] | None = None
        self.runs: list[dict[str, Any]] = []
        self.jobs: list[dict[str, Any]] = []
        self.error: str | None = None
        self.refreshed_at: float | None = None


class ControlPlane:
    def __init__(self, cfg: Config, environ: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.environ = dict(os.environ if environ is None else environ)
        self.root = Path(cfg.root).expanduser()
        self.state_dir = Path(cfg.state_dir).expanduser()
        self.db = Database(self.state_dir / "controlplane.db", store.MIGRATIONS, cfg.synchronous,
                           filemodes.CONTROLPLANE_FILE)
        self.supervisor = choose(cfg.supervisor, cfg.systemd_scope, cfg.command_timeout_s)
        self.github = GitHub(cfg.github_api, None)
        self.hub = SnapshotHub()
        self.live = LiveValues({}, self.environ)
        self.control_token: str | None = None
        self.agent_token: str | None = None
        self.repos: dict[str, RepoData] = defaultdict(RepoData)
        self.runners: list[Runner] = []
        self.discovery = Discovery(self.root)  # reads a runner's files only when they change
        self.states: dict[str, ServiceState] = {}
        self.snapshot: dict[str, Any] = {}
        self.views: list[dict[str, Any]] = []  # this host's runners (the snapshot adds remote)
        self.clock = now
        self.host_name = cfg.host_name or socket.gethostname()
        self.hosts = Hosts(self.db, self.clock)
        self.analysis = Analysis(self)
        self.link: CoordinatorLink | None = None
        self.action_lock = asyncio.Lock()
        self._build_lock = asyncio.Lock()
        self._tick = Pacer(self._tick_interval)
        self._github = Pacer(lambda: self.setting("github_s"))
        self._history = Pacer(lambda: self.setting("history_s"))
        self._tasks: list[asyncio.Task[None]] = []
        self._previous: dict[str, dict[str, Any]] = {}
        self._drain_tried: dict[str, float] = {}
        self._seen_completed: set[int] = set()
        self.ticks = 0

    # --- life cycle ------------------------------------------------------------------------

    async def open(self) -> None:
        # Tokens and the audit log live here: the owner's alone (0700, files 0600), tightened
        # at every start whatever an older version, a restore or a copy left behind.
        filemodes.private_dir(self.state_dir, filemodes.CONTROLPLANE_DIR)
        await asyncio.to_thread(filemodes.tighten_tree, self.state_dir,
                                filemodes.CONTROLPLANE_DIR, filemodes.CONTROLPLANE_FILE)
        await self.db.open()
        try:
            await self._start()
        except BaseException:
            # aiohttp does not exit a cleanup context whose start failed, and the database's
            # threads would otherwise keep the process alive after it reported the failure.
            await self.close()
            raise

    async def _start(self) -> None:
        self.live = LiveValues(await store.stored_settings(self.db), self.environ)
        if not self.cfg.read_only:
            self.control_token = tokens.ensure_token(self.state_dir)
            self.agent_token = tokens.agent_token(self.state_dir, self.control_token)
        self.github.token = await asyncio.to_thread(find_token, self.environ)
        await self.hosts.load()
        if self.cfg.coordinator:
            token = coordinator_token(coordinator_token_file(self.cfg))
            self.link = CoordinatorLink(self, self.cfg.coordinator, token)
            await self.link.load()
        await self.rebuild()
        self._tasks = [asyncio.create_task(self._tick_loop(), name="controlplane-tick"),
                       asyncio.create_task(self._github_loop(), name="controlplane-github"),
                       asyncio.create_task(self._history_loop(), name="controlplane-history")]
        if self.link is not None:
            self._tasks.append(asyncio.create_task(self.link.run(), name="controlplane-agent"))

    async def close(self) -> None:
        self.hub.close()
        self.hosts.close()
        if self.link is not None:
            self.link.stop()
        await stop_tasks(self._tasks)
        await self.github.close()
        await self.db.close()

    def wake(self, github: bool = False, history: bool = False) -> None:
        """Ask for a rebuild now (and a GitHub refresh, an analysis round)."""
        self._tick.poke()
        if github:
            self._github.poke()
        if history:
            self._history.poke()

    def setting(self, key: str) -> Any:
        return self.live.get(key)

    def _tick_interval(self) -> float:
        busy = any(r["busy"] for r in self.snapshot.get("runners", []))
        return float(self.setting("busy_tick_s" if busy else "tick_s"))

    async def _tick_loop(self) -> None:
        while True:
            await self._tick.wait(time.monotonic())
            try:
                await self.rebuild()
                await self.analysis.admission_log.ingest(self.clock())
            except Exception:
                log.exception("snapshot rebuild failed; the next tick tries again")

    async def _github_loop(self) -> None:
        while True:
            try:
                await self.refresh_github()
                await self.rebuild()
                await self.analysis.autoscale()
            except Exception:
                log.exception("GitHub refresh failed; the next round tries again")
            await self._github.wait(time.monotonic())  # the pause is between rounds

    async def _history_loop(self) -> None:
        while True:
            try:
                await self.analysis.round()
            except Exception:
                log.exception("analysis round failed; the next round tries again")
            await self._history.wait(time.monotonic())

    def watched_repos(self) -> list[str]:
        """This host's runners' repositories, the agents' and FLEET_WATCH_REPOS."""
        repos = {r.repo for r in self.runners if r.repo}
        repos |= {r["repo"] for r in self.hosts.remote_views(float("inf")) if r.get("repo")}
        return sorted(repos | set(self.cfg.watch_repos))

    # --- GitHub ----------------------------------------------------------------------------

    async def refresh_github(self) -> None:
        repos = self.watched_repos()
        for repo in list(self.repos):
            if repo not in repos:
                del self.repos[repo]
        for repo in repos:
            data = self.repos[repo]
            data.error = None
            try:
                await self._refresh_repo(repo, data)
            except GitHubError as exc:
                data.error = str(exc)
            data.refreshed_at = now()

    async def _refresh_repo(self, repo: str, data: RepoData) -> None:
        try:
            data.runners = await self.github.runners(repo)
        except GitHubError as exc:
            if exc.status not in (403, 404):
                raise
            # Listing runners needs admin rights a token may lack; its runs may still be
            # readable, and their queue causes then say the runner list is unavailable.
            data.runners, data.error = None, str(exc)
        runs = []
        for status in RUN_STATUSES:
            runs += await self.github.runs(repo, status)
        jobs = [job for run in runs for job in await self.github.jobs(repo, run["id"])]
        completed = await self.github.runs(repo, "completed")
        fresh = [run for run in completed if run["id"] not in self._seen_completed]
        if len(self._seen_completed) > 50_000:  # bounded memory; a re-read costs one request
            self._seen_completed.clear()
        for run in fresh[:COMPLETED_JOBS_PER_REFRESH]:
            jobs += await self.github.jobs(repo, run["id"])
            self._seen_completed.add(run["id"])
        data.runs, data.jobs = runs, [j for j in jobs if j["run_id"] in {r["id"] for r in runs}]
        if jobs:
            await self.db.write(store.upsert_jobs, [job_row(j) for j in jobs])

    # --- snapshot --------------------------------------------------------------------------

    async def discover(self) -> list[Runner]:
        return await asyncio.to_thread(lambda: self.discovery.discover(process_table()))

    async def rebuild(self) -> dict[str, Any]:
        async with self._build_lock:
            self.runners = await self.discover()
            self.states = await self.supervisor.states(self.runners)
            vitals = await asyncio.to_thread(host_vitals, self.root)
            # Each repository's registrations by name, once per rebuild (the first of a name
            # wins, as a scan of the list would find it), not a scan of the list per runner.
            registered = {repo: {x["name"]: x for x in reversed(data.runners)}
                          for repo, data in self.repos.items() if data.runners is not None}
            views = [self._view(r, registered) for r in self.runners]
            await self._record_transitions(views)
            await self._enforce_drains(views)
            self.views = views
            self.snapshot = self._compose(views, vitals)
            self.ticks += 1
            self.hub.publish(json.dumps(self.snapshot, separators=(",", ":")).encode())
            return self.snapshot

    def _view(self, r: Runner, registered: dict[str, dict[str, dict[str, Any]]]
              ) -> dict[str, Any]:
        state = self.states[r.name]
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
        return {"name": r.name, "dir": r.rel, "repo": r.repo, "owner": r.owner, "url": r.url,
                "labels": reg["labels"] if reg else r.labels,
                "custom_labels": reg["custom_labels"] if reg else r.labels,
                "version": r.version, "staged_versions": r.staged, "draining": r.draining,
                "draining_since": r.draining_since, "service": state.as_json(),
                "listener": _proc(r.listener), "workers": [_proc(w) for w in r.workers],
                "registration": registration,
                "registered": ({"id": reg["id"], "status": reg["status"], "busy": reg["busy"]}
                               if reg else None),
                "busy": busy, "state": label, "host": self.host_name, "remote": False,
                "stale": False}

    def _compose(self, views: list[dict[str, Any]], vitals: dict[str, Any]) -> dict[str, Any]:
        at = now()
        runs = [run for data in self.repos.values() for run in data.runs]
        jobs = [job for data in self.repos.values() for job in data.jobs]
        cap = capacity(views, vitals, self.setting)
        remote = self.hosts.remote_views(self.setting("stale_after_s"))
        every = views + remote
        ctx = Context(registered={repo: data.runners for repo, data in self.repos.items()},
                      views={v["name"]: v for v in reversed(every)},
                      local={v["name"] for v in views}, capacity=cap,
                      errors={repo: d.error for repo, d in self.repos.items() if d.error})
        if not self.github.token:
            ctx.errors = {repo: "no GitHub token" for repo in self.repos}
        return {
            "generated_at": iso(at),
            "host": {"name": self.host_name, "platform": platform.system().lower(),
                     "supervisor": self.supervisor.kind, "root": str(self.root),
                     "read_only": bool(self.cfg.read_only),
                     "role": "agent" if self.cfg.coordinator else "coordinator",
                     "coordinator": self.cfg.coordinator or None},
            "runners": every,
            "active_runs": [{**run, "jobs": [j for j in jobs if j["run_id"] == run["id"]]}
                            for run in runs],
            "groups": self._groups(every),
            "vitals": vitals,
            "capacity": cap,
            "drift": drift_alerts(views, runs, jobs, every, at, self.setting("stuck_queue_s")),
            "queue_causes": queue_causes(runs, jobs, ctx, at),
            "alerts": self._alerts(cap),
            "github": {**self.github.status(),
                       "repos": {repo: {"error": d.error, "refreshed_at": iso(d.refreshed_at)}
                                 for repo, d in sorted(self.repos.items())}},
        }

    def _groups(self, views: list[dict[str, Any]]) -> list[dict[str, Any]]:
        mode = self.setting("grouping")
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for v in views:
            if mode == "owner":
                key = v["owner"] or "(none)"
            elif mode == "labels":
                key = ",".join(sorted(v["labels"])) or "(no labels)"
            else:
                key = v["repo"] or v["owner"] or "(none)"
            groups[key].append(v)
        return [{"key": key, "by": mode, "runners": [v["name"] for v in members],
                 "total": len(members), "busy": sum(v["busy"] for v in members),
                 "draining": sum(v["draining"] for v in members)}
                for key, members in sorted(groups.items())]

    def _alerts(self, cap: dict[str, Any]) -> list[dict[str, Any]]:
        alerts = []
        if self.runners and not self.github.token:
            alerts.append({"severity": "warning", "message": "no GitHub token: set GH_TOKEN "
                           "(or log in with gh) to see registrations and queued runs"})
        for repo, data in sorted(self.repos.items()):
            if data.error:
                alerts.append({"severity": "warning", "message": f"{repo}: {data.error}"})
        rate = self.github.rate
        if rate.get("limit") and rate["remaining"] < rate["limit"] * 0.1:
            alerts.append({"severity": "warning", "message": f"GitHub rate limit low: "
                           f"{rate['remaining']} of {rate['limit']} left until {rate['reset_at']}"})
        if not cap["can_add"]:
            alerts.append({"severity": "info", "message": "no room for another runner: "
                           + "; ".join(cap["reasons"])})
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
            await self.db.write(store.add_events, events)

    async def _enforce_drains(self, views: list[dict[str, Any]]) -> None:
        """A draining runner's service is stopped as soon as it is idle (its job has ended)."""
        for v in views:
            if not v["draining"] or v["busy"] or v["service"]["active"] != "active":
                continue
            if time.monotonic() - self._drain_tried.get(v["name"], -DRAIN_RETRY_S) < DRAIN_RETRY_S:
                continue
            self._drain_tried[v["name"]] = time.monotonic()
            runner = next(r for r in self.runners if r.name == v["name"])
            result = await self.supervisor.stop(runner, self.states[v["name"]])
            await self.record(v["name"], "drain", "idle now; service stopped" if result.ok
                              else f"stopping the drained service failed: {result.output[-200:]}")

    # --- helpers for actions and the API ----------------------------------------------------

    def find(self, name: str) -> tuple[Runner, ServiceState]:
        for runner in self.runners:
            if runner.name == name:
                return runner, self.states[name]
        raise NotFound(f"no runner named {name!r} on this host")

    def view(self, name: str) -> dict[str, Any]:
        for v in self.views:
            if v["name"] == name:
                return v
        raise NotFound(f"no runner named {name!r} on this host")

    def forget_drain_attempt(self, name: str) -> None:
        self._drain_tried.pop(name, None)

    async def record(self, runner: str, kind: str, message: str) -> None:
        await self.db.write(store.add_events, [(runner, kind, message)])

    async def runner_detail(self, name: str) -> dict[str, Any]:
        view = self.view(name)
        runner, _ = self.find(name)
        at = now()
        day = await store.busy_seconds(self.db, name, at - 86400, at)
        week = await store.busy_seconds(self.db, name, at - 7 * 86400, at)
        return {
            "runner": view,
            "events": await store.recent_events(self.db, name),
            "jobs": await store.recent_jobs(self.db, name),
            "utilization": {"busy_24h_pct": round(100 * day / 86400, 2),
                            "busy_7d_pct": round(100 * week / (7 * 86400), 2),
                            "busy_now": view["busy"]},
            "diag": await asyncio.to_thread(diag.summary_and_tail, runner.path),
            "version": {"active": runner.version, "staged": runner.staged},
        }

    async def hosts_report(self) -> dict[str, Any]:
        """Every host: this one (with its role) and each agent that has called in."""
        snap = self.snapshot
        here: dict[str, Any] = {"host": self.host_name,
                "role": "agent" if self.cfg.coordinator else "coordinator",
                "runners": [{k: v.get(k) for k in RUNNER_FIELDS} for v in self.views],
                "capacity": snap.get("capacity"), "vitals": snap.get("vitals"),
                "load": (snap.get("vitals") or {}).get("load"), "heartbeat_age_s": 0.0,
                "last_heartbeat_at": snap.get("generated_at"), "stale": False,
                "pending_commands": 0, "local": True}
        if self.link is not None:
            link = self.link.status()
            here["coordinator"] = {**link, "last_ok_at": iso(link["last_ok_at"])}
        stale = self.setting("stale_after_s")
        agents = [{**h, "local": False} for h in await self.hosts.listing(stale)]
        return {"generated_at": iso(self.clock()), "stale_after_s": stale,
                "hosts": [here, *agents], "commands": await self.hosts.commands(limit=50)}

    async def change_setting(self, key: Any, value: Any, reset: bool) -> dict[str, Any]:
        setting = lookup(key)
        if reset:
            await self.db.write(store.delete_setting, setting.key)
            self.live.stored.pop(setting.key, None)
        else:
            checked = setting.check(value)
            await self.db.write(store.put_setting, setting.key, checked)
            self.live.stored[setting.key] = checked
        await self.rebuild()
        # Every loop measures its wait again with the new values now, not after the old
        # interval ends (github_s 300 -> 5 must not wait out the 300 s); none runs a round
        # early for it, and the rebuild above already shows the new value.
        for pacer in (self._tick, self._github, self._history):
            pacer.retime()
        return {"ok": True, "key": setting.key, "value": self.setting(setting.key),
                "source": self.live.source(setting.key)}


def _proc(proc: Any) -> dict[str, Any] | None:
    if proc is None:
        return None
    return {"pid": proc.pid, "rss_kb": proc.rss_kb, "uptime_s": int(proc.uptime_s)}

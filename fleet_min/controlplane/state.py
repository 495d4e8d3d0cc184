"""What the control plane holds: its configuration, its database, the live settings, the tokens,
this host's runners as last discovered, what GitHub last said of each repository, the agent
hosts' reports, the last snapshot, and when each background round is due next.

One Plane per daemon. The app makes it and hands it to each feature (the snapshot, the GitHub
refresh, the actions, federation, the analysis, the live settings), which reads and updates it.
It knows none of them: a feature that needs another is given it in its constructor. Domain only:
no aiohttp.web here.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fleet_min import filemodes
from fleet_min.controlplane import store, tokens
from fleet_min.controlplane.federation.hosts import Hosts
from fleet_min.controlplane.loops import Pacer
from fleet_min.controlplane.runners.discovery import Runner
from fleet_min.controlplane.runners.supervisor import ServiceState
from fleet_min.controlplane.settings import ControlPlaneConfig, LiveValues
from fleet_min.db import Database
from fleet_min.errors import NotFound
from fleet_min.timeutil import now


class RepoData:
    """What GitHub said about one repository at the last refresh."""

    def __init__(self) -> None:
        self.runners: list[dict[str, Any]] | None = None
        self.runs: list[dict[str, Any]] = []
        self.jobs: list[dict[str, Any]] = []
        self.error: str | None = None
        self.refreshed_at: float | None = None


def own_host_name(cfg: Any) -> str:
    """This host's name in federation: FLEET_HOST_NAME, else the machine's host name."""
    return str(cfg.host_name or socket.gethostname())


class Plane:
    def __init__(self, cfg: ControlPlaneConfig, environ: Mapping[str, str] | None = None) -> None:
        self.cfg = cfg
        self.environ = dict(os.environ if environ is None else environ)
        self.root = Path(cfg.root).expanduser()
        self.state_dir = Path(cfg.state_dir).expanduser()
        self.host_name = own_host_name(cfg)
        self.role = "agent" if cfg.coordinator else "coordinator"
        self.clock = now
        self.db = Database(self.state_dir / "controlplane.db", store.MIGRATIONS, cfg.synchronous,
                           filemodes.CONTROLPLANE_FILE)
        self.live = LiveValues({}, self.environ)
        self.control_token: str | None = None
        self._agent_token: tokens.AgentToken | None = None
        self.hosts = Hosts(self.db, self.clock)  # the agent hosts that call in, and their runners
        self.repos: dict[str, RepoData] = defaultdict(RepoData)
        self.runners: list[Runner] = []
        # Runner names several directories claim, with those directories (Discovery.clashes).
        self.clashes: dict[str, list[str]] = {}
        self.states: dict[str, ServiceState] = {}
        self.views: list[dict[str, Any]] = []  # this host's runners (the snapshot adds remote)
        self.snapshot: dict[str, Any] = {}
        # When each background round is due: the snapshot tick (faster while a runner is busy),
        # the GitHub refresh and the analysis round.
        self.tick = Pacer(self._tick_interval)
        self.github_round = Pacer(lambda: self.setting("github_s"))
        self.analysis_round = Pacer(lambda: self.setting("history_s"))

    async def open(self) -> None:
        # Tokens and the audit log live here: the owner's alone (0700, files 0600), tightened
        # at every start whatever an older version, a restore or a copy left behind.
        filemodes.private_dir(self.state_dir, filemodes.CONTROLPLANE_DIR)
        await asyncio.to_thread(filemodes.tighten_tree, self.state_dir,
                                filemodes.CONTROLPLANE_DIR, filemodes.CONTROLPLANE_FILE)
        await self.db.open()
        try:
            self.live = LiveValues(await store.stored_settings(self.db), self.environ)
            if not self.cfg.read_only:
                self.control_token = tokens.ensure_token(self.state_dir)
                self._agent_token = tokens.AgentToken(self.state_dir, self.control_token)
            await self.hosts.load()
        except BaseException:
            # Whoever opens the plane sees the failure, not a half-open plane: the database's
            # threads would otherwise keep the process alive after it reported the failure.
            await self.db.close()
            raise

    @property
    def agent_token(self) -> str | None:
        """The token agent routes take (None read-only), as its file says now."""
        return self._agent_token.current() if self._agent_token is not None else None

    async def close(self) -> None:
        self.hosts.close()
        await self.db.close()

    def setting(self, key: str) -> Any:
        return self.live.get(key)

    def _tick_interval(self) -> float:
        busy = any(r["busy"] for r in self.snapshot.get("runners", []))
        return float(self.setting("busy_tick_s" if busy else "tick_s"))

    def wake(self, github: bool = False, history: bool = False) -> None:
        """Ask for a rebuild now (and a GitHub refresh, an analysis round)."""
        self.tick.poke()
        if github:
            self.github_round.poke()
        if history:
            self.analysis_round.poke()

    def retime(self) -> None:
        """Every round measures its wait again with the settings as they are now."""
        for pacer in (self.tick, self.github_round, self.analysis_round):
            pacer.retime()

    def own_repos(self) -> list[str]:
        """This host's runners' repositories and FLEET_WATCH_REPOS."""
        return sorted({r.repo for r in self.runners if r.repo} | set(self.cfg.watch_repos))

    def watched_repos(self) -> list[str]:
        """This host's own repositories, and those of live agents' runners that are already
        among them or listed in FLEET_AGENT_REPOS (in that list's spelling: GitHub's names
        ignore case, so `OCTO/lib` is octo/lib, not one more repository to read). A host token
        speaks for its own host: the runners it reports cannot make this host read others."""
        own = self.own_repos()
        allowed = self._agent_watchable(own)
        live = self.hosts.live_repos(self.setting("stale_after_s"))
        return sorted(set(own) | {allowed[repo.lower()] for repo in live
                                  if repo.lower() in allowed})

    def unwatched(self, repos: set[str]) -> list[str]:
        """Those of `repos` an agent's runner does not make watched: listed, never read."""
        allowed = self._agent_watchable(self.own_repos())
        return sorted(repo for repo in repos if repo.lower() not in allowed)

    def _agent_watchable(self, own: list[str]) -> dict[str, str]:
        return {repo.lower(): repo for repo in (*self.cfg.agent_repos, *own)}

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

    async def record(self, runner: str, kind: str, message: str) -> None:
        """One event in a runner's history (GET /api/runner shows the latest)."""
        await self.db.write(store.add_events, [(runner, kind, message)])

"""The control plane's app: the plane (its state) and the features that use it, each handed
what it needs, and each feature's routes and background loops put on the app by its own
module here (http/<feature>.py). The order of the features is the order they start in: the
plane and the GitHub client first, then the first snapshot and its tick, the GitHub refresh,
the analysis round and, on an agent host, the link to its coordinator; they stop in reverse.

Nothing imports this module but the CLI: the features import the plane and each other, never
the app.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from fleet_min import origin
from fleet_min.controlplane.federation.coordinator import Coordinator
from fleet_min.controlplane.federation.link import CoordinatorLink, coordinator_token_file
from fleet_min.controlplane.github.client import GitHub, find_token
from fleet_min.controlplane.github.sync import GitHubSync
from fleet_min.controlplane.http import (
    actions,
    analysis,
    federation,
    metrics,
    pages,
    routes,
    settings,
    snapshot,
)
from fleet_min.controlplane.live import LiveSettings
from fleet_min.controlplane.runners.actions import Actions
from fleet_min.controlplane.runners.supervisor import choose
from fleet_min.controlplane.settings import ControlPlaneConfig
from fleet_min.controlplane.snapshot import Snapshots
from fleet_min.controlplane.state import Plane
from fleet_min.controlplane.telemetry import ControlPlaneMetrics
from fleet_min.http import MAX_JSON_KEY, base_middleware_with
from fleet_min.sse import EventHub
from fleet_min.timeutil import now


def shared_parts(plane: Plane, github: GitHub) -> Callable[[web.Application],
                                                           AsyncIterator[None]]:
    """The parts every feature uses: the plane (database, settings, tokens, agents' reports)
    and the GitHub client with its token."""

    async def open_and_close(app: web.Application) -> AsyncIterator[None]:
        await plane.open()
        try:
            github.token = await asyncio.to_thread(find_token, plane.environ)
        except BaseException:
            await plane.close()
            raise
        yield
        await github.close()
        await plane.close()

    return open_and_close


def create_app(cfg: ControlPlaneConfig, environ: dict[str, str] | None = None) -> web.Application:
    # client_max_size is a backstop above the JSON limit; read_json answers 413 itself.
    gate = origin.HostGate("control plane", cfg.allowed_hosts, origin.own_names())
    app = web.Application(middlewares=[base_middleware_with(routes.request_check(gate))],
                          client_max_size=cfg.max_json_bytes + 1024)
    app[MAX_JSON_KEY] = cfg.max_json_bytes
    app[routes.NEEDS] = {}
    plane = app[routes.PLANE] = Plane(cfg, environ)
    github = GitHub(cfg.github_api, None)
    supervisor = choose(cfg.supervisor, cfg.systemd_scope, cfg.command_timeout_s)
    app.cleanup_ctx.append(shared_parts(plane, github))

    pages.setup(app)
    snapshots = snapshot.setup(app, Snapshots(plane, supervisor, github,
                                              EventHub(latest_only=True)))
    metrics.setup(app, ControlPlaneMetrics(
        lambda: plane.snapshot, github, plane.hosts, snapshots.hub,
        lambda: plane.setting("stale_after_s"), plane.clock, now()))
    sync = GitHubSync(plane, github, snapshots)
    app.cleanup_ctx.append(sync.running)
    acting = actions.setup(app, Actions(plane, snapshots, supervisor, github))
    settings.setup(app, LiveSettings(plane, snapshots))
    analysis.setup(app, plane, analysis.build(plane, github, acting), snapshots, sync)
    link = (CoordinatorLink(plane, acting, snapshots, cfg.coordinator,
                            coordinator_token_file(cfg)) if cfg.coordinator else None)
    federation.setup(app, Coordinator(plane, link))
    return app

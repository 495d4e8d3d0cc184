"""Federation on the app: the hosts list (GET /api/hosts), agents' heartbeats and results
(POST /api/host/heartbeat, /api/host/results), and, on an agent host, the link to its
coordinator."""

from __future__ import annotations

from aiohttp import web

from fleet_min.controlplane.federation.coordinator import Coordinator
from fleet_min.controlplane.http import routes
from fleet_min.controlplane.http.auth import Need, token_host
from fleet_min.http import json_response, read_json_object

COORDINATOR = web.AppKey("coordinator", Coordinator)


async def hosts(request: web.Request) -> web.Response:
    return json_response(await request.app[COORDINATOR].hosts_report())


def _token_host(request: web.Request) -> str | None:
    """The host a host token limits the request to (None: a token for any host)."""
    return token_host(request.headers, request.app[COORDINATOR].plane.agent_token)


async def heartbeat(request: web.Request) -> web.Response:
    # The body is passed on unnamed: the coordinator lets go of it before the heartbeat waits.
    return json_response(await request.app[COORDINATOR].heartbeat(
        await read_json_object(request), _token_host(request)))


async def host_results(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    return json_response(await request.app[COORDINATOR].results(body, routes.who(request),
                                                                _token_host(request)))


def setup(app: web.Application, coordinator: Coordinator) -> None:
    app[COORDINATOR] = coordinator
    routes.add(app, "GET", "/api/hosts", hosts)
    routes.add(app, "POST", "/api/host/heartbeat", heartbeat, Need.AGENT)
    routes.add(app, "POST", "/api/host/results", host_results, Need.AGENT)
    if coordinator.link is not None:
        app.cleanup_ctx.append(coordinator.link.running)
    plane = coordinator.plane

    async def answer_heartbeats(app: web.Application) -> None:
        plane.hosts.close()  # every held heartbeat is answered now, so shutdown waits on none

    app.on_shutdown.append(answer_heartbeats)

"""The snapshot's routes: GET /api/state, the live stream of snapshots (GET /api/stream), the
queue causes, one runner in depth and its diagnostic bundle; and the tick loop's life."""

from __future__ import annotations

from aiohttp import web

from fleet_min.controlplane.http import routes
from fleet_min.controlplane.http.auth import Need
from fleet_min.controlplane.runners.detail import runner_bundle, runner_detail
from fleet_min.controlplane.snapshot import Snapshots
from fleet_min.http import SECURITY_HEADERS, json_response
from fleet_min.sse import stream

SNAPSHOTS = web.AppKey("snapshots", Snapshots)
KEEP_ALIVE_S = 15.0


async def state(request: web.Request) -> web.Response:
    payload = request.app[SNAPSHOTS].hub.latest or b"{}"
    return web.Response(body=payload, content_type="application/json")


async def live(request: web.Request) -> web.StreamResponse:
    # Headers go out with the stream's first bytes, before the middleware could add them.
    return await stream(request, request.app[SNAPSHOTS].hub, None, KEEP_ALIVE_S,
                        headers=SECURITY_HEADERS)


async def queue_causes(request: web.Request) -> web.Response:
    snapshot = request.app[routes.PLANE].snapshot
    return json_response({"generated_at": snapshot.get("generated_at"),
                          "queue_causes": snapshot.get("queue_causes", [])})


async def runner(request: web.Request) -> web.Response:
    return json_response(await runner_detail(request.app[routes.PLANE],
                                             routes.runner_name(request)))


async def bundle(request: web.Request) -> web.Response:
    name = routes.runner_name(request)
    text = await runner_bundle(request.app[routes.PLANE], name)
    return web.Response(text=text, content_type="text/plain", charset="utf-8", headers={
        "Content-Disposition": f'attachment; filename="runner-{name}-bundle.txt"',
        "Cache-Control": "no-store"})


def setup(app: web.Application, snapshots: Snapshots) -> Snapshots:
    app[SNAPSHOTS] = snapshots
    routes.add(app, "GET", "/api/state", state)
    routes.add(app, "GET", "/api/stream", live)
    routes.add(app, "GET", "/api/runner", runner)
    routes.add(app, "GET", "/api/queue-causes", queue_causes)
    routes.add(app, "GET", "/api/runner/bundle", bundle, Need.CONTROL)
    app.cleanup_ctx.append(snapshots.running)

    async def end_streams(app: web.Application) -> None:
        snapshots.hub.close()  # every open stream ends now, so shutdown waits on none

    app.on_shutdown.append(end_streams)
    return snapshots

"""The live settings' routes: GET /api/settings lists them, POST /api/settings changes one."""

from __future__ import annotations

from aiohttp import web

from fleet_min.controlplane.http import routes
from fleet_min.controlplane.http.auth import Need
from fleet_min.controlplane.live import LiveSettings
from fleet_min.http import json_response, read_json_object

LIVE = web.AppKey("live settings", LiveSettings)


async def listing(request: web.Request) -> web.Response:
    return json_response(request.app[LIVE].listing())


async def change(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    return json_response(await request.app[LIVE].change(body, routes.who(request)))


def setup(app: web.Application, live: LiveSettings) -> None:
    app[LIVE] = live
    routes.add(app, "GET", "/api/settings", listing)
    routes.add(app, "POST", "/api/settings", change, Need.CONTROL)

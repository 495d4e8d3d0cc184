"""The actions' routes: the catalogue (GET /api/actions) and running one (POST /api/action)."""

from __future__ import annotations

from aiohttp import web

from fleet_min.controlplane.http import routes
from fleet_min.controlplane.http.auth import Need
from fleet_min.controlplane.runners.actions import Actions, catalogue, parse_request
from fleet_min.errors import Refused
from fleet_min.http import json_response, read_json_object

ACTIONS = web.AppKey("actions", Actions)


async def action_catalogue(request: web.Request) -> web.Response:
    return json_response(catalogue(bool(request.app[routes.PLANE].cfg.read_only)))


async def action(request: web.Request) -> web.Response:
    actions, who = request.app[ACTIONS], routes.who(request)
    body: object = None
    try:
        body = await read_json_object(request)
        action_id, args = parse_request(body)
    except Refused as exc:
        await actions.audit_refusal(who, body, exc.message)
        return json_response({"ok": False, "error": exc.message}, status=exc.status)
    try:
        reply = await actions.run(action_id, args, who)
    except Refused as exc:
        return json_response({"ok": False, "error": exc.message}, status=exc.status)
    return json_response(reply)


def setup(app: web.Application, actions: Actions) -> Actions:
    app[ACTIONS] = actions
    routes.add(app, "GET", "/api/actions", action_catalogue)
    routes.add(app, "POST", "/api/action", action, Need.CONTROL)
    return actions

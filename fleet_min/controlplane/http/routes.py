"""How the control plane's features put their routes on the app: each route with what it needs
(auth.Need), checked by the middleware before its handler runs, and the small request helpers
the handlers share."""

from __future__ import annotations

import re

from aiohttp import web

from fleet_min import origin
from fleet_min.controlplane.http import auth
from fleet_min.controlplane.http.auth import Need
from fleet_min.controlplane.runners.discovery import valid_name
from fleet_min.controlplane.state import Plane
from fleet_min.errors import BadRequest
from fleet_min.http import Handler, RequestCheck

PLANE = web.AppKey("plane", Plane)
NEEDS: web.AppKey[dict[tuple[str, str], Need]] = web.AppKey("needs")
_DIGITS = re.compile(r"[0-9]{1,6}")


def add(app: web.Application, method: str, path: str, handler: Handler,
        need: Need = Need.NONE) -> None:
    app.router.add_route(method, path, handler)
    app[NEEDS][method, path] = need


def request_check(gate: origin.HostGate) -> RequestCheck:
    """The boundary (Host; for a change also Origin and body type), then who is asking; run by
    base_middleware_with before every handler (refusing raises)."""

    def boundary_and_auth(request: web.Request) -> None:
        headers = request.headers
        gate.check(headers.get("Host"))
        method = request.method.upper()
        origin.check_request(method, headers, "control plane", auth.CROSS_ORIGIN)
        if (method in ("GET", "HEAD") and request.path.startswith("/api/")
                and origin.from_a_page(headers)):
            # A page on another site cannot read an answer (no CORS), but it can still make
            # the daemon build one: a few dozen analytics reads a second is gigabytes and
            # minutes of CPU. Only this daemon's own pages (or an address typed) may ask.
            origin.check_page_read(headers, auth.CROSS_ORIGIN)
        authorize_request(request)

    return boundary_and_auth


def authorize_request(request: web.Request) -> None:
    """Who is asking, checked against what the route needs."""
    route = request.match_info.route
    path = route.resource.canonical if route.resource is not None else ""
    need = request.app[NEEDS].get((request.method, path), Need.NONE)
    plane = request.app[PLANE]
    agent_route = need is Need.AGENT  # only these read the agent token (a file's stat)
    request["who"] = auth.authorize(
        need, request.headers, read_only=bool(plane.cfg.read_only), control=plane.control_token,
        agent=plane.agent_token if agent_route else None,
        shared_agent=agent_route and plane.setting("agent_tokens") == "any")


def who(request: web.Request) -> str:
    """Who asked, for the audit log."""
    return f"{request.get('who', 'anonymous')} from {request.remote or 'unknown'}"


def runner_name(request: web.Request) -> str:
    name = request.query.get("name", "")
    if not name:
        raise BadRequest("the query needs name=<runner name>")
    if not valid_name(name):
        raise BadRequest("name is not a valid runner name")
    return name


def strict_int(request: web.Request, name: str, default: int, high: int) -> int:
    """A query integer from 1 to high; anything else (empty, signs, spaces, 0) is a 400."""
    raw = request.query.get(name)
    if raw is None:
        return default
    if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= high:
        raise BadRequest(f"{name} must be a whole number from 1 to {high} (default {default})")
    return int(raw)

"""Enrolment: GET /api/enroll (addresses, devices known, the agent and the newest phone runner
build; ?device_id= asks whether an id is taken), GET /api/enroll/qr (a QR code as SVG, drawn
here so the page needs no internet and no script library), GET /agent/fleet_agent.py (the
agent, from the package)."""

from __future__ import annotations

import io
import socket

from aiohttp import web

from fleet_min.collector.access import enrolment, guard, mdns
from fleet_min.collector.service import Service
from fleet_min.errors import BadRequest
from fleet_min.http import json_response, static_file
from fleet_min.timeutil import iso, now

PACKAGE = "fleet_min"
AGENT_RESOURCE = "web/agent/fleet_agent.py"
APP_NAME_MAX = 200
DEVICE_ID_MAX = 200  # a device id is 1 to 200 characters (validate.py)


def qr_svg(text: str) -> bytes:
    """Black on white whatever the page's theme (a dark QR code does not scan), with the quiet
    zone of four modules scanners need."""
    import segno  # here, not at start: it and what it imports are 1 MiB of an idle collector

    code = segno.make(text, error="m", micro=False)
    out = io.BytesIO()
    code.save(out, kind="svg", scale=1, border=4, dark="#000", light="#fff", xmldecl=False,
              title="QR code", svgclass="qr", lineclass=None, omitsize=True)
    return out.getvalue()


def _routes(service: Service) -> list[web.RouteDef]:
    config = service.config
    guarded = guard.dash_token(config) is not None  # pins then need the operator's token

    async def enroll(request: web.Request) -> web.Response:
        app = request.query.get("app") or enrolment.RUNNER_APP
        if len(app) > APP_NAME_MAX:
            raise BadRequest(f"app must be at most {APP_NAME_MAX} characters")
        mdns_name = (mdns.Advert(service.name, service.collector_id, config.port, ()).host
                     if mdns.enabled(config) else None)
        bases = (enrolment.bound_bases(config.bind)
                 + enrolment.name_bases(config.allowed_hosts, mdns_name))
        asked = request.query.get("device_id") or None
        if asked is not None and len(asked) > DEVICE_ID_MAX:
            raise BadRequest(f"device_id must be at most {DEVICE_ID_MAX} characters")
        known = await enrolment.known_devices(service.db)
        taken = ({} if asked is None
                 else {"device_id_taken": await enrolment.device_id_taken(service.db, asked)})
        return json_response({
            "port": config.port,
            "hostname": socket.gethostname(),
            "bases": enrolment.describe(bases, config.port),
            "agent": {"path": enrolment.AGENT_PATH,
                      "options": "--pool <name> joins a pool; --name <label> names it"},
            "runner_app": app,
            "runner_apk": await enrolment.runner_build(service.db, app, pinned_only=guarded),
            "runner_pinned_only": guarded,
            "known_device_ids": known.ids,
            "known_devices": known.count,
            # The page lists as new the devices first seen after this (the ids above are only
            # the newest 1,000 of a registry that may hold 25,000).
            "now": iso(now()),
            "pools": known.pools,
            "pools_truncated": known.pools_truncated,
            **taken,
        })

    async def qr(request: web.Request) -> web.Response:
        text = request.query.get("text", "")
        if not text or len(text) > enrolment.QR_TEXT_MAX:
            raise BadRequest(f"text is required: what the QR code should say, at most "
                             f"{enrolment.QR_TEXT_MAX} characters")
        return web.Response(body=qr_svg(text), content_type="image/svg+xml",
                            headers={"Cache-Control": "max-age=3600"})

    async def agent(request: web.Request) -> web.Response:
        response = static_file(PACKAGE, AGENT_RESOURCE, cache_s=0)
        response.content_type = "text/x-python"
        return response

    return [web.get("/api/enroll", enroll), web.get("/api/enroll/qr", qr),
            web.get(enrolment.AGENT_PATH, agent)]


def setup(app: web.Application, service: Service) -> None:
    app.router.add_routes(_routes(service))

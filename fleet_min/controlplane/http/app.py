"""HTTP surface of the control plane: the route table, auth middleware and thin handlers.

Each handler parses the request, calls one engine/domain function and shapes the answer; the
auth rules live in auth.py, the actions in actions.py, the snapshot in engine.py.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from importlib import resources

from aiohttp import web

from fleet_min import origin
from fleet_min.config import Config
from fleet_min.controlplane import store
from fleet_min.controlplane.analysis.reports import check_repo
from fleet_min.controlplane.federation.hosts import applied_of, check_host, clean_report, wait_of
from fleet_min.controlplane.http import auth, openapi
from fleet_min.controlplane.http.auth import Need
from fleet_min.controlplane.runners import actions
from fleet_min.controlplane.runners.bundle import build_bundle
from fleet_min.controlplane.runners.discovery import valid_name
from fleet_min.controlplane.snapshot import ControlPlane
from fleet_min.controlplane.stream import KEEP_ALIVE, sse_event
from fleet_min.controlplane.telemetry import ControlPlaneMetrics
from fleet_min.errors import BadRequest, Conflict, Refused
from fleet_min.http import (
    MAX_JSON_KEY,
    SECURITY_HEADERS,
    Handler,
    RequestCheck,
    base_middleware_with,
    json_response,
    metrics_response,
    read_json_object,
    static_file,
)
from fleet_min.timeutil import iso, now

ENGINE = web.AppKey("controlplane", ControlPlane)
METRICS = web.AppKey("metrics", ControlPlaneMetrics)
KEEP_ALIVE_S = 15.0
WEB_PACKAGE = "fleet_min"
WEB_FOLDER = "web/controlplane/"
# Stricter than the shared page policy: the control-plane UI has no inline style or script.
UI_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
          "connect-src 'self'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'")
_DIGITS = re.compile(r"[0-9]{1,6}")


def engine(request: web.Request) -> ControlPlane:
    return request.app[ENGINE]


def _who(request: web.Request) -> str:
    return f"{request.get('who', 'anonymous')} from {request.remote or 'unknown'}"


def _name(request: web.Request) -> str:
    name = request.query.get("name", "")
    if not name:
        raise BadRequest("the query needs name=<runner name>")
    if not valid_name(name):
        raise BadRequest("name is not a valid runner name")
    return name


# --- pages ---------------------------------------------------------------------------------

async def index(request: web.Request) -> web.Response:
    page = resources.files(WEB_PACKAGE).joinpath(WEB_FOLDER + "index.html").read_bytes()
    return web.Response(body=page, content_type="text/html", charset="utf-8",
                        headers={"Content-Security-Policy": UI_CSP, "Cache-Control": "no-cache"})


async def public(request: web.Request) -> web.Response:
    return static_file(WEB_PACKAGE, WEB_FOLDER + request.match_info["path"])


# --- read routes ---------------------------------------------------------------------------

async def state(request: web.Request) -> web.Response:
    payload = engine(request).hub.latest or b"{}"
    return web.Response(body=payload, content_type="application/json")


async def stream(request: web.Request) -> web.StreamResponse:
    hub = engine(request).hub
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no", **SECURITY_HEADERS})
    await response.prepare(request)
    hub.clients += 1
    try:
        if hub.latest is not None:
            await response.write(sse_event(hub.latest))
        while not hub.closed:
            payload = await hub.wait(KEEP_ALIVE_S)
            if payload is not None:
                await response.write(sse_event(payload))
            elif not hub.closed:
                await response.write(KEEP_ALIVE)
    except (ConnectionResetError, ConnectionError):
        pass  # the client went away; nothing to tell it
    finally:
        hub.clients -= 1
    return response


async def get_metrics(request: web.Request) -> web.Response:
    return metrics_response(request.app[METRICS].render())


async def runner_detail(request: web.Request) -> web.Response:
    return json_response(await engine(request).runner_detail(_name(request)))


async def queue_causes(request: web.Request) -> web.Response:
    snapshot = engine(request).snapshot
    return json_response({"generated_at": snapshot.get("generated_at"),
                          "queue_causes": snapshot.get("queue_causes", [])})


async def action_catalogue(request: web.Request) -> web.Response:
    return json_response(actions.catalogue(bool(engine(request).cfg.read_only)))


async def settings_list(request: web.Request) -> web.Response:
    return json_response({"settings": engine(request).live.listing()})


async def hosts(request: web.Request) -> web.Response:
    return json_response(await engine(request).hosts_report())


def _strict_int(request: web.Request, name: str, default: int, high: int) -> int:
    """A query integer from 1 to high; anything else (empty, signs, spaces, 0) is a 400."""
    raw = request.query.get(name)
    if raw is None:
        return default
    if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= high:
        raise BadRequest(f"{name} must be a whole number from 1 to {high} (default {default})")
    return int(raw)


async def analytics(request: web.Request) -> web.Response:
    days = _strict_int(request, "days", 30, 365)
    return json_response(await engine(request).analysis.analytics(days))


async def repo_detail(request: web.Request) -> web.Response:
    name = check_repo(request.query.get("name"))
    return json_response(await engine(request).analysis.repo(name))


async def concurrency(request: web.Request) -> web.Response:
    return json_response(await engine(request).analysis.concurrency())


async def simulate(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    return json_response(await engine(request).analysis.simulate(body))


async def forecast(request: web.Request) -> web.Response:
    return json_response(await engine(request).analysis.forecast())


async def autoscale(request: web.Request) -> web.Response:
    return json_response(await engine(request).analysis.autoscale_report())


async def admission(request: web.Request) -> web.Response:
    limit = _strict_int(request, "limit", 60, 500)
    return json_response(await engine(request).analysis.admission(limit))


async def billing(request: web.Request) -> web.Response:
    return json_response(await engine(request).analysis.billing())


# --- mutating routes -----------------------------------------------------------------------

async def action(request: web.Request) -> web.Response:
    cp, who = engine(request), _who(request)
    body: object = None
    try:
        body = await read_json_object(request)
        action_id, args = actions.parse_request(body)
    except Refused as exc:
        await actions.audit_refusal(cp, who, body, exc.message)
        return json_response({"ok": False, "error": exc.message}, status=exc.status)
    try:
        reply = await actions.run_action(cp, action_id, args, who)
    except Refused as exc:
        return json_response({"ok": False, "error": exc.message}, status=exc.status)
    return json_response(reply)


async def settings_change(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    reset = body.get("reset", False)
    if reset is not False and reset is not True:
        raise BadRequest("reset must be true or left out")
    if not reset and "value" not in body:
        raise BadRequest("the body needs key and value (or key and reset: true)")
    cp = engine(request)
    reply = await cp.change_setting(body.get("key"), body.get("value"), reset)
    await cp.db.write(store.add_audit, _who(request), "settings", {"key": reply["key"],
                      "value": reply["value"], "reset": reset}, True, None, 0, None)
    return json_response(reply)


async def bundle(request: web.Request) -> web.Response:
    cp = engine(request)
    name = _name(request)
    view = cp.view(name)
    runner, _ = cp.find(name)
    events = await store.recent_events(cp.db, name, 100)
    jobs = await store.recent_jobs(cp.db, name, 50)
    host = {"host": cp.snapshot["host"], "vitals": cp.snapshot["vitals"],
            "capacity": cp.snapshot["capacity"]}
    text = await asyncio.to_thread(build_bundle, view, host, runner.path, events, jobs,
                                   iso(now()) or "")
    return web.Response(text=text, content_type="text/plain", charset="utf-8", headers={
        "Content-Disposition": f'attachment; filename="runner-{name}-bundle.txt"',
        "Cache-Control": "no-store"})


async def heartbeat(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    cp = engine(request)
    host = check_host(body.get("host"))
    if host == cp.host_name:
        raise Conflict(f"{host} is this coordinator's own name; give the agent its own "
                       "(FLEET_HOST_NAME)")
    queue, commands = await cp.hosts.heartbeat(host, clean_report(body), wait_of(body),
                                               applied_of(body))
    return json_response({"ok": True, "queue": queue, "commands": commands})


async def host_results(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    host, results = check_host(body.get("host")), body.get("results")
    if not isinstance(results, list) or not all(
            isinstance(r, dict) and isinstance(r.get("id"), str) for r in results):
        raise BadRequest("results must be a list of objects, each with a string id")
    cp = engine(request)
    received = await cp.hosts.results(host, results)
    for result in results:
        await cp.db.write(store.add_audit, _who(request), f"host.result:{host}",
                          {"id": result["id"]}, bool(result.get("ok")), None, 0,
                          str(result.get("error"))[:500] if result.get("error") else None)
    return json_response({"ok": True, "received": len(results), "matched": received})


# --- the table -----------------------------------------------------------------------------

ROUTES: list[tuple[str, str, Handler, Need]] = [
    ("GET", "/", index, Need.NONE),
    ("GET", "/public/{path:.+}", public, Need.NONE),
    ("GET", "/openapi.json", openapi.document, Need.NONE),
    ("GET", "/api/state", state, Need.NONE),
    ("GET", "/api/stream", stream, Need.NONE),
    ("GET", "/metrics", get_metrics, Need.NONE),
    ("GET", "/api/runner", runner_detail, Need.NONE),
    ("GET", "/api/queue-causes", queue_causes, Need.NONE),
    ("GET", "/api/actions", action_catalogue, Need.NONE),
    ("GET", "/api/settings", settings_list, Need.NONE),
    ("GET", "/api/hosts", hosts, Need.NONE),
    ("GET", "/api/analytics", analytics, Need.NONE),
    ("GET", "/api/repo", repo_detail, Need.NONE),
    ("GET", "/api/concurrency", concurrency, Need.NONE),
    ("POST", "/api/simulate", simulate, Need.SAME_ORIGIN),
    ("GET", "/api/forecast", forecast, Need.NONE),
    ("GET", "/api/autoscale", autoscale, Need.NONE),
    ("GET", "/api/admission", admission, Need.NONE),
    ("GET", "/api/billing", billing, Need.NONE),
    ("POST", "/api/action", action, Need.CONTROL),
    ("POST", "/api/settings", settings_change, Need.CONTROL),
    ("GET", "/api/runner/bundle", bundle, Need.CONTROL),
    ("POST", "/api/host/heartbeat", heartbeat, Need.AGENT),
    ("POST", "/api/host/results", host_results, Need.AGENT),
]
NEEDS = {(method, path): need for method, path, _, need in ROUTES}


def request_check(gate: origin.HostGate) -> RequestCheck:
    """The boundary (Host; for a change also Origin and body type), then who is asking; run by
    base_middleware_with before every handler (refusing raises)."""

    def boundary_and_auth(request: web.Request) -> None:
        gate.check(request.headers.get("Host"))
        origin.check_request(request.method.upper(), request.headers, "control plane",
                             auth.CROSS_ORIGIN)
        authorize_request(request)

    return boundary_and_auth


def authorize_request(request: web.Request) -> None:
    """Who is asking, checked against what the route needs."""
    route = request.match_info.route
    path = route.resource.canonical if route.resource is not None else ""
    need = NEEDS.get((request.method, path), Need.NONE)
    cp = engine(request)
    request["who"] = auth.authorize(need, request.headers, read_only=bool(cp.cfg.read_only),
                                    control=cp.control_token, agent=cp.agent_token)


def create_app(cfg: Config, environ: dict[str, str] | None = None) -> web.Application:
    # client_max_size is a backstop above the JSON limit; read_json answers 413 itself.
    gate = origin.HostGate("control plane", cfg.allowed_hosts, origin.own_names())
    app = web.Application(middlewares=[base_middleware_with(request_check(gate))],
                          client_max_size=cfg.max_json_bytes + 1024)
    app[MAX_JSON_KEY] = cfg.max_json_bytes
    cp = ControlPlane(cfg, environ)
    app[ENGINE] = cp
    app[METRICS] = ControlPlaneMetrics(lambda: cp.snapshot, cp.github, cp.hosts, cp.hub,
                                       lambda: cp.setting("stale_after_s"), cp.clock, now())
    for method, path, handler, _ in ROUTES:
        app.router.add_route(method, path, handler)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await cp.open()
        yield
        await cp.close()

    async def release_streams(app: web.Application) -> None:
        # Every open /api/stream and held heartbeat ends now, so shutdown waits on none.
        cp.hub.close()
        cp.hosts.close()

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(release_streams)
    return app

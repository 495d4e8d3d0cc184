"""Access: dashboard token guard, mesh allowlist, peers, mDNS, CI status (HTTP wiring only)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.typedefs import Middleware

from fleet_min import origin
from fleet_min.collector.access import ci_status, guard, mdns, mesh, peers
from fleet_min.collector.jobs.specs import JobSpec
from fleet_min.collector.service import Service
from fleet_min.config import CollectorConfig
from fleet_min.errors import Forbidden, UnsupportedMediaType
from fleet_min.http import CleanupContext, Handler, RequestCheck, json_response, read_json_object

PEERS = web.AppKey("peers", peers.Peers)
CI = web.AppKey("ci_status", ci_status.CiReporter)
MESH = web.AppKey("mesh", mesh.MeshGate)
UPLOAD_TEMPLATE = "/artifacts"  # the routes whose body is bytes, not JSON: an upload
MIRROR_TEMPLATE = "/api/jobs/{job_id}/mirror"  # and a live-mirror frame
# The routes an agent acts through for a device or an executor name: with FLEET_MESH_ALLOW set,
# a mesh peer must be a listed node, and the node is handed on so the transaction can check it
# may act for the device or executor the request names (fleet_min.collector.jobs.authority).
AGENT_ROUTES = frozenset({
    ("POST", "/devices/register"), ("GET", "/devices/{device_id}/next-job"),
    ("POST", "/executors/register"), ("GET", "/executor/next-job"), ("POST", "/results"),
    ("POST", "/jobs/{job_id}/release"), ("POST", "/locks/acquire"), ("POST", "/locks/release"),
    ("POST", MIRROR_TEMPLATE)})
MESH_NODE = "fleet_mesh_node"  # request key: the caller's mesh node, None off the mesh
HOST_GATE = web.AppKey("host_gate", origin.HostGate)
BODY_TYPES = {UPLOAD_TEMPLATE: origin.BINARY_TYPE, MIRROR_TEMPLATE: "image/jpeg"}
HEALTH_PATH = "/api/health"  # the one API read another site's page may still make
# GET routes that change state: a poll claims a job (and an executor's poll records its slots).
CLAIMING_READS = frozenset({"/devices/{device_id}/next-job", "/executor/next-job"})
# The original's JSON reads outside /api/, held to the rule of the /api/ reads; its topic long
# poll above all, which a page elsewhere could otherwise keep waiting from every visitor.
ORIGINAL_READS = frozenset({"/events/{topic}/poll", "/jobs/{job_id}", "/schedules",
                            "/status-reports"})
NOT_FOR_OTHER_PAGES = CLAIMING_READS | ORIGINAL_READS


def _template(request: web.Request) -> str | None:
    """The route template the router matched (e.g. /api/jobs/{job_id}/cancel), if any."""
    route = request.match_info.route
    resource = route.resource if route is not None else None
    return resource.canonical if resource is not None else None


def host_gate(config: CollectorConfig) -> origin.HostGate:
    """The names this collector answers to (the mDNS name joins once the id is known)."""
    return origin.HostGate("collector", config.allowed_hosts, origin.own_names())


def request_check(config: CollectorConfig, gate: origin.HostGate) -> RequestCheck:
    """The boundary (Host; for a change also Origin and body type; for a claim, which is a GET,
    the page that asked for it) and the dashboard guard, run by the collector's one middleware
    before every handler."""
    token = guard.dash_token(config)

    def boundary_and_guard(request: web.Request) -> None:
        headers = request.headers
        gate.check(headers.get("Host"))
        method = request.method.upper()
        if method in guard.MUTATING:  # reads never need the route template
            template = _template(request)
            wanted = BODY_TYPES.get(template or "", origin.JSON_TYPE)
            origin.check_request(method, headers, "collector", guard.CROSS_SITE, wanted)
            if template in BODY_TYPES and "Content-Encoding" in headers:
                # Every value: aiohttp's parser inflates by the last of several lines.
                _check_plain_bytes(headers.getall("Content-Encoding"))
            guard.check(method, template, request.path, headers, token)
        elif origin.from_a_page(headers) and (
                (method in ("GET", "HEAD") and request.path.startswith("/api/")
                 and request.path != HEALTH_PATH)
                or _template(request) in NOT_FOR_OTHER_PAGES):
            # A claim changes state. An API read does not, but a page on another site cannot
            # read the answer (no CORS) while it can still make every visitor's browser ask
            # for listings, long waits and streams: only the collector's own pages, an
            # address typed, and clients that are no browser may. Health stays open: it is
            # cheap, and a status page elsewhere may ping it to show the collector is up.
            origin.check_page_read(headers, guard.CROSS_SITE)

    return boundary_and_guard


def _check_plain_bytes(encodings: list[str]) -> None:
    """An upload or a mirror frame is stored or relayed as the bytes that arrive, so it comes
    without a Content-Encoding: inflated on the way in, one gzip megabyte stored a gigabyte
    (the artifact cap counts what is stored), and the inflating ran on the event loop. Each
    coding of each Content-Encoding line must be identity."""
    said = ", ".join(encodings)
    if any(coding.strip().lower() not in ("", "identity") for coding in said.split(",")):
        raise UnsupportedMediaType(
            f"send the bytes as they are: this route takes no Content-Encoding "
            f"({said[:40]!r}); compress the file itself if it should be stored compressed")


def mesh_middleware(gate: mesh.MeshGate) -> Middleware:
    @web.middleware
    async def mesh_allowlist(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (request.method, _template(request)) in AGENT_ROUTES:
            # Several X-Forwarded-For lines are one list (RFC 9110); the last entry is nearest.
            forwarded = request.headers.getall("X-Forwarded-For", None)
            request[MESH_NODE] = await gate.identify(
                request.remote, ",".join(forwarded) if forwarded else None)
        return await handler(request)

    return mesh_allowlist


def mesh_caller(request: web.Request) -> str | None:
    """The mesh node an agent request came from; None off the mesh or with no allowlist."""
    node: str | None = request.get(MESH_NODE)
    return node


def check_signing_jobs(request: web.Request, specs: list[JobSpec],
                       config: CollectorConfig) -> None:
    """Refuse (401/403) jobs that sign with an executor's release key without the dashboard
    token, when one is set (see guard.SIGNING_WORKLOADS)."""
    token = guard.dash_token(config)
    if token:  # an open collector, the usual case, looks at no spec
        guard.check_signing_jobs([str(spec.get("workload")) for spec in specs],
                                 request.headers, token)


def check_ci_target(request: web.Request, spec: JobSpec) -> None:
    """Refuse (400) a spec whose report_to.ci_status is outside FLEET_CI_STATUS_REPOS."""
    ci_status.check_spec(request.app[CI].settings, spec)


async def api_peers(request: web.Request) -> web.Response:
    known = request.app[PEERS]
    if request.query.get("refresh", "").lower() in ("1", "true", "yes"):
        await known.refresh(started_after=True)
    return json_response(known.listing())


async def api_forget_peer(request: web.Request) -> web.Response:
    url = peers.check_forget(await read_json_object(request))
    return json_response(await request.app[PEERS].forget(url))


async def api_peer_proxy(request: web.Request) -> web.Response:
    if request.method != "GET":
        raise Forbidden("the peer proxy only reads: it forwards GET requests and never a change")
    # The raw (still percent-encoded) path, so an encoded slash cannot change the endpoint.
    rest = request.rel_url.raw_path[len("/api/peers/"):]
    _raw_id, _, raw_tail = rest.partition("/")
    status, body = await request.app[PEERS].read(request.match_info["peer_id"], raw_tail,
                                                 request.rel_url.raw_query_string)
    return web.Response(body=body, status=status, content_type="application/json",
                        headers={"X-Fleet-Peer": request.match_info["peer_id"],
                                 "Cache-Control": "no-store"})


async def status_reports(request: web.Request) -> web.Response:
    return json_response(await ci_status.recent_reports(request.app[CI].db))


async def api_job_ci_status(request: web.Request) -> web.Response:
    reporter = request.app[CI]
    return json_response(await ci_status.statuses(reporter.db, request.match_info["job_id"],
                                                  reporter.settings.armed))


def setup(app: web.Application, service: Service) -> None:
    """Wire this feature: its middlewares, routes, hooks, and its loops as a cleanup context."""
    _guards(app, service)
    known = peers.Peers(peers.settings(service.config))
    app[PEERS] = known
    reporter = ci_status.CiReporter(service.db, ci_status.settings(service.config), service.spawn)
    app[CI] = reporter
    service.on_applied.append(reporter.on_applied)
    service.listeners.append(reporter.on_event)
    service.health_extras.append(reporter.health)
    advertiser = _advertiser(service)
    service.health_extras.append(lambda: {"mdns": advertiser.state if advertiser else "off"})

    app.router.add_get("/api/peers", api_peers)
    app.router.add_post("/api/peers/forget", api_forget_peer)
    app.router.add_route("*", "/api/peers/{peer_id}/{tail:.*}", api_peer_proxy)
    app.router.add_get("/api/jobs/{job_id}/ci-status", api_job_ci_status)
    app.router.add_get("/status-reports", status_reports)
    app.cleanup_ctx.append(_running(service, known, reporter, advertiser))


def _guards(app: web.Application, service: Service) -> None:
    """Middlewares may still be appended here: the app is not frozen until it starts. (The
    dashboard guard is not one: create_app runs request_check inside base_middleware_with.)"""
    service.guarded = guard.dash_token(service.config) is not None
    gate = mesh.MeshGate(mesh.settings(service.config))
    app[MESH] = gate
    if gate.enabled:
        app.middlewares.append(mesh_middleware(gate))


def _running(service: Service, known: peers.Peers, reporter: ci_status.CiReporter,
             advertiser: mdns.Advertiser | None) -> CleanupContext:
    async def running(app: web.Application) -> AsyncIterator[None]:
        # Entered once the service has its id and its database.
        reporter.announce()
        await known.attach(service.db)  # the stored pins, before any peer is asked again
        refresher = [service.spawn(known.loop(), "peers")] if known.peers else []
        if advertiser is not None:
            advertiser.advert = advertiser.advert.with_id(service.collector_id)
            app[HOST_GATE].admit(advertiser.advert.host)  # peers may use the advertised name
            await advertiser.start()
        yield
        if advertiser is not None:
            await advertiser.stop()
        await reporter.close()
        await app[MESH].close()
        await service.stop_tasks(refresher)  # stopped before its HTTP session closes under it
        await known.close()

    return running


def _advertiser(service: Service) -> mdns.Advertiser | None:
    if not mdns.enabled(service.config):
        return None
    return mdns.Advertiser(mdns.Advert(service.name, "", service.config.port,
                                       mdns.advertised_addresses(service.config.bind)))

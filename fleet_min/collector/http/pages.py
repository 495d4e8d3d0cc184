"""The collector's pages: the dashboard (/dash), the legacy pages (/dash/legacy), /runner.

The dashboard and the runner are static ES modules from the package's `web/` folder (also inside
fleet.pyz). Their files are served under `/static/<build>/...`, where `<build>` is a digest of
every served file: a page always asks for the files of the build it was rendered with, so they can
be cached as immutable and an upgrade can never mix old and new modules. The two HTML shells are
revalidated on every load (`no-cache` with an ETag).
"""

from __future__ import annotations

import hashlib
import html
from importlib import resources
from importlib.resources.abc import Traversable

from aiohttp import web

from fleet_min.collector.artifacts import store as artifacts
from fleet_min.collector.automation import alerts, schedules
from fleet_min.collector.http import legacy
from fleet_min.collector.http.automation import load_settings as automation_settings
from fleet_min.collector.insight import result_views
from fleet_min.collector.jobs import views
from fleet_min.collector.service import Service
from fleet_min.errors import Refused
from fleet_min.http import Handler, static_file
from fleet_min.timeutil import iso, now

PACKAGE = "fleet_min"
SERVED = ("dash", "runner", "vendor", "common")  # folders of web/ reachable under /static
IMMUTABLE = "public, max-age=31536000, immutable"
REVALIDATE = "no-cache"
# A plain page is one HTML table: past this many devices it shows the ones seen last.
PAGE_DEVICES = 1000
RECENT_JOBS = 20  # newest jobs on the legacy overview
RECENT_BENCH_S = 7 * 86400  # benchmark runs the legacy overview summarises


def _walk(node: Traversable) -> list[Traversable]:
    if node.is_file():
        return [node]
    if not node.is_dir():
        return []
    found: list[Traversable] = []
    for child in sorted(node.iterdir(), key=lambda n: n.name):
        if not child.name.startswith("."):
            found += _walk(child)
    return found


def build_id() -> str:
    """A digest of every served file: changes whenever any of them does."""
    digest = hashlib.sha256()
    web_root = resources.files(PACKAGE).joinpath("web")
    for folder in SERVED:
        for node in _walk(web_root.joinpath(folder)):
            digest.update(node.name.encode() + b"\0" + node.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def with_etag(request: web.Request, response: web.Response, cache: str) -> web.Response:
    """Add a strong ETag of the body; answer 304 when the client already holds it."""
    body = response.body if isinstance(response.body, bytes) else b""
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    if etag in [tag.strip() for tag in request.headers.get("If-None-Match", "").split(",")]:
        return web.Response(status=304, headers={"ETag": etag, "Cache-Control": cache})
    response.headers["ETag"] = etag
    response.headers["Cache-Control"] = cache
    return response


# A tail of any characters: a route's pattern is a regular expression, whose `.` stops at a line
# break, so `.*` would leave a tail holding one (%0A) to the JSON "no such route" of no page.
ANY_TAIL = r"[\s\S]*"


class Pages:
    def __init__(self, service: Service) -> None:
        self.service = service
        self.build = build_id()

    def shell(self, request: web.Request, relative: str) -> web.Response:
        """An HTML shell from web/, with its static prefix and the collector's name filled in."""
        text = static_file(PACKAGE, relative).text or ""
        text = (text.replace("{{static}}", f"/static/{self.build}")
                .replace("{{name}}", html.escape(self.service.name)))
        response = web.Response(text=text, content_type="text/html", charset="utf-8")
        return with_etag(request, response, REVALIDATE)

    async def dash(self, request: web.Request) -> web.Response:
        return self.shell(request, "web/dash/index.html")

    async def runner(self, request: web.Request) -> web.Response:
        return self.shell(request, "web/runner/index.html")

    async def asset(self, request: web.Request) -> web.Response:
        path = request.match_info["path"]
        if path.split("/", 1)[0] not in SERVED or path.endswith(".html"):
            raise web.HTTPNotFound()
        response = static_file(PACKAGE, "web/" + path)
        # A page rendered by another build (before an upgrade) still gets a file, uncached.
        current = request.match_info["build"] == self.build
        return with_etag(request, response, IMMUTABLE if current else REVALIDATE)

    async def root(self, request: web.Request) -> web.Response:
        raise web.HTTPFound("/dash")

    async def icon(self, request: web.Request) -> web.Response:
        return with_etag(request, static_file(PACKAGE, "web/dash/icon.svg"), REVALIDATE)


class Legacy:
    """Handlers of /dash/legacy: the same reads as the /api routes, rendered on the server."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.db = service.db

    def schedule_view(self) -> schedules.View:
        return schedules.View(now(), automation_settings(self.service.config).tz)

    def page(self, title: str, active: str, content: str, refresh_s: int | None = None,
             status: int = 200) -> web.Response:
        text = legacy.page(title, active, content, self.service.name, refresh_s)
        return web.Response(text=text, status=status, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def overview(self, request: web.Request) -> web.Response:
        data = await views.overview(self.db, now())
        listed = await schedules.list_schedules(self.db, self.schedule_view())
        opened = await alerts.list_alerts(self.db, alerts.AlertState.OPEN, None, 50, now())
        recent = await views.list_jobs(self.db, {})
        # The last week only: this page reloads every 30 s, the bench page reads everything.
        since = iso(now() - RECENT_BENCH_S) or ""
        benches = await result_views.bench(self.db, {"from": since})
        content = legacy.overview(data, listed["schedules"], opened["alerts"],
                                  recent["jobs"][:RECENT_JOBS], benches)
        return self.page("Overview", "", content, refresh_s=30)

    async def devices(self, request: web.Request) -> web.Response:
        listing = await views.list_devices(self.db, now(), views.DeviceQuery(limit=PAGE_DEVICES))
        content = legacy.device_table(listing["devices"])
        if listing["cut"]:
            content = legacy.tag("p", f"The {PAGE_DEVICES} seen most recently of "
                                 f"{listing['devices_total']} devices.") + content
        return self.page("Devices", "/devices", content)

    async def device(self, request: web.Request) -> web.Response:
        device_id = request.match_info["device_id"]
        record = await views.get_device(self.db, device_id, now())
        recent = await views.list_jobs(self.db, {"device": device_id})
        return self.page(f"Device {device_id}", "/devices",
                         legacy.device(record, recent["jobs"]))

    async def jobs(self, request: web.Request) -> web.Response:
        query = {k: v for k, v in request.query.items() if k in ("status", "q", "page") and v}
        listing = await views.list_jobs(self.db, query)
        return self.page("Jobs", "/jobs", legacy.jobs(listing, query))

    async def job(self, request: web.Request) -> web.Response:
        job_id = request.match_info["job_id"]
        detail = await views.job_detail(self.db, job_id)
        return self.page(f"Job {job_id}", "/jobs", legacy.job(detail))

    async def results(self, request: web.Request) -> web.Response:
        data = await result_views.bench(self.db, {})
        ui = await result_views.ui(self.db, {})
        return self.page("Results", "/results", legacy.bench(data, ui))

    async def bench(self, request: web.Request) -> web.Response:
        """The original's benchmark page: every configuration's newest run per device."""
        data = await result_views.bench(self.db, {})
        return self.page("Fleet Benchmarks", "/results",
                         legacy.bench_summary(data, limit=legacy.BENCH_PAGE_ROWS))

    async def schedules(self, request: web.Request) -> web.Response:
        listed = await schedules.list_schedules(self.db, self.schedule_view())
        return self.page("Schedules", "/schedules", legacy.schedules(listed["schedules"]))

    async def alerts(self, request: web.Request) -> web.Response:
        listed = await alerts.list_alerts(self.db, None, None, 200, now())
        return self.page("Alerts", "/alerts", legacy.alert_table(listed["alerts"]))

    async def artifacts(self, request: web.Request) -> web.Response:
        query = {"page": request.query["page"]} if request.query.get("page") else {}
        listing = await artifacts.list_artifacts(self.db, query)
        return self.page("Artifacts", "/artifacts", legacy.artifacts(listing)
                         + legacy.pager("/artifacts", listing, query))

    async def style(self, request: web.Request) -> web.Response:
        response = web.Response(text=legacy.STYLE, content_type="text/css", charset="utf-8")
        return with_etag(request, response, REVALIDATE)

    async def missing(self, request: web.Request) -> web.Response:
        return self.page("Not found", "", legacy.not_found(
            f"There is no legacy page at {request.path}."), status=404)

    def as_page(self, handler: Handler) -> Handler:
        """A 4xx from a read (unknown id, bad filter) as a page, not JSON, under /dash/legacy.

        A wrapper on the legacy handlers rather than a middleware, so no other request pays.
        """
        async def page_or_refusal(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except Refused as exc:
                return self.page("Not shown", "", legacy.not_found(exc.message),
                                 status=exc.status)

        return page_or_refusal

    def routes(self) -> list[web.RouteDef]:
        base, page = legacy.BASE, self.as_page
        return [
            web.get(base, page(self.overview)),
            web.get(base + "/", page(self.overview)),
            web.get(base + "/style.css", page(self.style)),
            web.get(base + "/devices", page(self.devices)),
            web.get(base + "/devices/{device_id}", page(self.device)),
            web.get(base + "/jobs", page(self.jobs)),
            web.get(base + "/jobs/{job_id}", page(self.job)),
            web.get(base + "/results", page(self.results)),
            web.get(base + "/bench", page(self.bench)),
            web.get(base + "/schedules", page(self.schedules)),
            web.get(base + "/alerts", page(self.alerts)),
            web.get(base + "/artifacts", page(self.artifacts)),
            web.get(base + "/{tail:" + ANY_TAIL + "}", page(self.missing)),
        ]


def setup(app: web.Application, service: Service) -> None:
    """Register the page routes and their static files."""
    pages = Pages(service)
    old = Legacy(service)
    app.router.add_routes(old.routes())  # before /dash/{tail}, which would match them
    app.router.add_routes([
        web.get("/", pages.root),
        web.get("/favicon.svg", pages.icon),
        web.get("/dash", pages.dash),
        web.get("/dash/{tail:" + ANY_TAIL + "}", pages.dash),
        web.get("/runner", pages.runner),
        web.get("/static/{build:[0-9a-zA-Z_-]{1,64}}/{path:.+}", pages.asset),
    ])

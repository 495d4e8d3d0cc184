"""The control-plane UI (GET /, its files under /public/) and the OpenAPI document
(GET /openapi.json, fleet_min/openapi/controlplane.json).

The UI's front-end libraries and the pages' shared helpers are the collector's too:
/public/vendor/... and /public/common/... are served from their one copy, fleet_min/web/vendor/
and fleet_min/web/common/, so fleet.pyz carries them once."""

from __future__ import annotations

from importlib import resources

from aiohttp import web

from fleet_min.controlplane.http import routes
from fleet_min.http import static_file
from fleet_min.openapi import document_bytes

WEB_PACKAGE = "fleet_min"
WEB_FOLDER = "web/controlplane/"
SHARED = ("vendor/", "common/")  # /public/vendor/... -> fleet_min/web/vendor/..., and common/
# Stricter than the shared page policy: the control-plane UI has no inline style or script.
UI_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
          "connect-src 'self'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'")


async def index(request: web.Request) -> web.Response:
    page = resources.files(WEB_PACKAGE).joinpath(WEB_FOLDER + "index.html").read_bytes()
    return web.Response(body=page, content_type="text/html", charset="utf-8",
                        headers={"Content-Security-Policy": UI_CSP, "Cache-Control": "no-cache"})


async def public(request: web.Request) -> web.Response:
    path = request.match_info["path"]
    if path.startswith(SHARED):
        return static_file(WEB_PACKAGE, "web/" + path)  # static_file refuses any ".." in it
    return static_file(WEB_PACKAGE, WEB_FOLDER + path)


async def openapi_document(request: web.Request) -> web.Response:
    return web.Response(body=document_bytes("controlplane"), content_type="application/json",
                        headers={"Cache-Control": "no-cache"})


def setup(app: web.Application) -> None:
    routes.add(app, "GET", "/", index)
    routes.add(app, "GET", "/public/{path:.+}", public)
    routes.add(app, "GET", "/openapi.json", openapi_document)

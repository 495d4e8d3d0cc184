"""GET /openapi.json: the control plane's OpenAPI 3.1 document
(fleet_min/openapi/controlplane.json). Listed in app.ROUTES with Need.NONE."""

from __future__ import annotations

from aiohttp import web

from fleet_min.openapi import document_bytes


async def document(request: web.Request) -> web.Response:
    return web.Response(body=document_bytes("controlplane"), content_type="application/json",
                        headers={"Cache-Control": "no-cache"})

"""GET /openapi.json: the collector's OpenAPI 3.1 document (fleet_min/openapi/collector.json)."""

from __future__ import annotations

from aiohttp import web

from fleet_min.collector.service import Service
from fleet_min.openapi import document_bytes


async def openapi_document(request: web.Request) -> web.Response:
    return web.Response(body=document_bytes("collector"), content_type="application/json",
                        headers={"Cache-Control": "no-cache"})


def setup(app: web.Application, service: Service) -> None:
    """Register the document's route."""
    app.router.add_get("/openapi.json", openapi_document)

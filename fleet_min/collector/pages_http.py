"""The collector's pages: the dashboard (/dash), the legacy pages (/dash/legacy), /runner."""

from __future__ import annotations

from aiohttp import web

from fleet_min.collector.service import Service


def setup(app: web.Application, service: Service) -> None:
    """Register the page routes and their static files."""

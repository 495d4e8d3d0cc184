"""Schedules (cron) and alerts (rules, ack, snooze, webhook)."""

from __future__ import annotations

from aiohttp import web

from fleet_min.collector.service import Service


def setup(app: web.Application, service: Service) -> None:
    """Register this feature's routes, middlewares, listeners and background loops."""

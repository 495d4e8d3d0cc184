"""GET /metrics: the collector's figures in the Prometheus text format (fleet_min.collector.
telemetry says what each one measures). A read, open like every collector read."""

from __future__ import annotations

from aiohttp import web

from fleet_min.collector.insight.telemetry import CollectorMetrics
from fleet_min.collector.service import Service
from fleet_min.http import metrics_response

METRICS = web.AppKey("metrics", CollectorMetrics)


async def get_metrics(request: web.Request) -> web.Response:
    return metrics_response(await request.app[METRICS].render())


def setup(app: web.Application, service: Service) -> None:
    """Register the route and the hooks that count as things happen."""
    figures = CollectorMetrics(service.db, service.hub, lambda: service.dispatcher.waiting,
                               service.started_at)
    app[METRICS] = figures
    service.on_applied.append(figures.on_applied)
    service.listeners.append(figures.on_event)
    app.router.add_get("/metrics", get_metrics)

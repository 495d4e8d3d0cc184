"""GET /metrics: the control plane's metrics in Prometheus text format (telemetry.py)."""

from __future__ import annotations

from aiohttp import web

from fleet_min.controlplane.http import routes
from fleet_min.controlplane.telemetry import ControlPlaneMetrics
from fleet_min.http import metrics_response

METRICS = web.AppKey("metrics", ControlPlaneMetrics)


async def get_metrics(request: web.Request) -> web.Response:
    return metrics_response(request.app[METRICS].render())


def setup(app: web.Application, metrics: ControlPlaneMetrics) -> None:
    app[METRICS] = metrics
    routes.add(app, "GET", "/metrics", get_metrics)

"""The analysis feature on the app: its routes (analytics, repository detail, concurrency,
simulate, forecast, autoscale, admission, billing), its round loop, the admission log read after
each tick and autoscale after each GitHub refresh."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from fleet_min.controlplane.analysis.admission import AdmissionLog
from fleet_min.controlplane.analysis.autoscaler import Autoscaler
from fleet_min.controlplane.analysis.billing import Billing
from fleet_min.controlplane.analysis.forecaster import Forecaster
from fleet_min.controlplane.analysis.reports import Reports, check_repo
from fleet_min.controlplane.analysis.rounds import AnalysisRounds
from fleet_min.controlplane.github.client import GitHub
from fleet_min.controlplane.github.sync import GitHubSync
from fleet_min.controlplane.github.workflow_files import WorkflowFiles
from fleet_min.controlplane.http import routes
from fleet_min.controlplane.http.auth import Need
from fleet_min.controlplane.runners.actions import Actions
from fleet_min.controlplane.snapshot import Snapshots
from fleet_min.controlplane.state import Plane
from fleet_min.http import json_response, read_json_object


@dataclass
class Analysis:
    reports: Reports
    forecaster: Forecaster
    autoscaler: Autoscaler
    rounds: AnalysisRounds


ANALYSIS = web.AppKey("analysis", Analysis)


async def analytics(request: web.Request) -> web.Response:
    days = routes.strict_int(request, "days", 30, 365)
    return json_response(await request.app[ANALYSIS].reports.analytics(days))


async def repo_detail(request: web.Request) -> web.Response:
    name = check_repo(request.query.get("name"))
    return json_response(await request.app[ANALYSIS].reports.repo(name))


async def concurrency(request: web.Request) -> web.Response:
    return json_response(await request.app[ANALYSIS].reports.concurrency())


async def simulate(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    return json_response(await request.app[ANALYSIS].reports.simulate(body))


async def forecast(request: web.Request) -> web.Response:
    return json_response(await request.app[ANALYSIS].forecaster.forecast())


async def autoscale(request: web.Request) -> web.Response:
    return json_response(await request.app[ANALYSIS].autoscaler.report())


async def admission(request: web.Request) -> web.Response:
    limit = routes.strict_int(request, "limit", 60, 500)
    return json_response(await request.app[ANALYSIS].reports.admission(limit))


async def billing(request: web.Request) -> web.Response:
    return json_response(await request.app[ANALYSIS].reports.billing())


def admission_path(plane: Plane) -> Path:
    if plane.cfg.admission_log:
        return Path(plane.cfg.admission_log).expanduser()
    return plane.state_dir / "admission.log"


def build(plane: Plane, github: GitHub, actions: Actions) -> Analysis:
    files = WorkflowFiles(github, plane.db, plane.clock)
    forecaster = Forecaster(plane, files)
    admission_log = AdmissionLog(admission_path(plane), plane.db)
    return Analysis(
        reports=Reports(plane, files, Billing(github, plane.clock), admission_log),
        forecaster=forecaster, autoscaler=Autoscaler(plane, actions, forecaster),
        rounds=AnalysisRounds(plane, github, files, forecaster))


def setup(app: web.Application, plane: Plane, analysis: Analysis, snapshots: Snapshots,
          sync: GitHubSync) -> Analysis:
    app[ANALYSIS] = analysis
    for method, path, handler, need in (
            ("GET", "/api/analytics", analytics, Need.NONE),
            ("GET", "/api/repo", repo_detail, Need.NONE),
            ("GET", "/api/concurrency", concurrency, Need.NONE),
            ("POST", "/api/simulate", simulate, Need.SAME_ORIGIN),
            ("GET", "/api/forecast", forecast, Need.NONE),
            ("GET", "/api/autoscale", autoscale, Need.NONE),
            ("GET", "/api/admission", admission, Need.NONE),
            ("GET", "/api/billing", billing, Need.NONE)):
        routes.add(app, method, path, handler, need)
    app.cleanup_ctx.append(analysis.rounds.running)
    admission_log = analysis.reports.admission_log
    snapshots.after_tick(lambda: admission_log.ingest(plane.clock()))
    sync.after_refresh(analysis.autoscaler.evaluate)
    return analysis

"""Visual review over HTTP: the suites, the matrix of one suite, its baselines, and accepting a
capture as the baseline of its slot (fleet_min/collector/artifacts/visual.py has the rules).

Routes:
    GET  /api/visual/suites                        suites with baselines or recent captures
    GET  /api/visual/matrix?suite=&runs=&threshold= the latest run's cells, judged, with history
    GET  /api/visual/baselines?suite=              the slots' pointers
    POST /api/visual/baselines/accept              {suite, page, profile, sha256, job_id?} (201)
"""

from __future__ import annotations

from aiohttp import web

from fleet_min.collector.artifacts import visual
from fleet_min.collector.http.artifacts import STORE
from fleet_min.collector.service import Service
from fleet_min.http import json_response, read_json_object
from fleet_min.timeutil import now

REVIEW = web.AppKey("visual_review", visual.Review)


def setup(app: web.Application, service: Service) -> None:
    """Wire this feature: its routes (after the artifact store's, whose store it reads)."""
    review = visual.Review(app[STORE])
    app[REVIEW] = review

    async def api_suites(request: web.Request) -> web.Response:
        return json_response(await visual.suites(service.db))

    async def api_matrix(request: web.Request) -> web.Response:
        suite, runs, threshold = visual.matrix_query(request.query)
        return json_response(await review.matrix(suite, runs, threshold, now()))

    async def api_baselines(request: web.Request) -> web.Response:
        return json_response(await visual.baselines(service.db,
                                                    request.query.get("suite") or None))

    async def api_accept(request: web.Request) -> web.Response:
        slot = visual.check_accept(await read_json_object(request))
        return json_response(await service.transact(visual.accept, slot, now()), status=201)

    app.router.add_routes([
        web.get("/api/visual/suites", api_suites),
        web.get("/api/visual/matrix", api_matrix),
        web.get("/api/visual/baselines", api_baselines),
        web.post("/api/visual/baselines/accept", api_accept),
    ])

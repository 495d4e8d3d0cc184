"""The ceiling: a bare aiohttp server answering the collector's three lifecycle requests with no
work at all (no validation, no database). Same framework, same event loop choice."""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable

from aiohttp import web

SPEC = json.dumps({"schema": 1, "job_id": "x", "workload": "benchmark", "executor": "device",
                   "backend": "synthetic"})


async def enqueue(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"ok": True, "job_id": "x", "status": "queued"}, status=201)


async def next_job(request: web.Request) -> web.Response:
    return web.Response(text=SPEC, content_type="application/json")


async def results(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"ok": True})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def serve(app: web.Application, port: int) -> None:
    """Run a ceiling's app on loopback with the event loop the collector would use."""
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def lifecycle_app(enqueue: Handler, next_job: Handler, results: Handler,
                  register: Handler) -> web.Application:
    """An app answering the lifecycle's requests (and GET /api/health) with these handlers: the
    three ceilings answer the same routes and differ only in their work."""
    app = web.Application()
    app.router.add_post("/jobs", enqueue)
    app.router.add_get("/devices/{device_id}/next-job", next_job)
    app.router.add_post("/results", results)
    app.router.add_post("/devices/register", register)
    app.router.add_get("/api/health", health)
    return app


def main() -> None:
    serve(lifecycle_app(enqueue, next_job, results, results), int(sys.argv[1]))


if __name__ == "__main__":
    main()

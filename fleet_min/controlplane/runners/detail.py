"""One runner of this host in depth: its view, events, recent jobs, utilization, log summary and
versions (GET /api/runner), and its diagnostic bundle (GET /api/runner/bundle, written by
bundle.py). Domain only: no aiohttp.web here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleet_min.controlplane import store
from fleet_min.controlplane.runners import diag
from fleet_min.controlplane.runners.bundle import build_bundle
from fleet_min.controlplane.state import Plane
from fleet_min.timeutil import iso, now

DAY = 86400


async def runner_detail(plane: Plane, name: str) -> dict[str, Any]:
    view = plane.view(name)
    runner, _ = plane.find(name)
    at = now()
    day = await store.busy_seconds(plane.db, name, at - DAY, at)
    week = await store.busy_seconds(plane.db, name, at - 7 * DAY, at)
    return {
        "runner": view,
        "events": await store.recent_events(plane.db, name),
        "jobs": await store.recent_jobs(plane.db, name),
        "utilization": {"busy_24h_pct": round(100 * day / DAY, 2),
                        "busy_7d_pct": round(100 * week / (7 * DAY), 2),
                        "busy_now": view["busy"]},
        "diag": await asyncio.to_thread(diag.summary_and_tail, runner.path),
        "version": {"active": runner.version, "staged": runner.staged},
    }


async def runner_bundle(plane: Plane, name: str) -> str:
    """The runner's bundle as text, redacted, for a person to read or paste."""
    view = plane.view(name)
    runner, _ = plane.find(name)
    events = await store.recent_events(plane.db, name, 100)
    jobs = await store.recent_jobs(plane.db, name, 50)
    snap = plane.snapshot
    host = {"host": snap["host"], "vitals": snap["vitals"], "capacity": snap["capacity"]}
    return await asyncio.to_thread(build_bundle, view, host, runner.path, events, jobs,
                                   iso(now()) or "")

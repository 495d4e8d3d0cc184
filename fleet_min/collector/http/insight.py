"""Topics, shaped result views, system figures and retention over HTTP.

Routes:
    POST /api/events/{topic}, POST /events/{topic}   publish a JSON payload (201)
    GET  /api/events                                 topics with counts and recent payloads
    GET  /api/events/{topic}?limit=&before=          newest events of a topic
    GET  /api/events/{topic}/next?after=&wait_s=     long poll: 200 with events, or 204
    GET  /events/{topic}/poll?after=&wait_s=         the original's poll: one event, or 204
    GET  /api/results/bench | ui | drain | soak      shaped result views
    GET  /api/results/vision                         the original's vision runs
    GET  /api/system                                 what the collector holds on disk
    POST /api/system/retention {"apply": bool}       dry run by default
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from fleet_min.collector.access import ci_status
from fleet_min.collector.insight import result_views, system, topics
from fleet_min.collector.service import Service
from fleet_min.config import CollectorConfig
from fleet_min.errors import BadRequest
from fleet_min.http import json_response, query_int, read_json, read_json_object
from fleet_min.timeutil import now


def insight_settings(config: CollectorConfig) -> system.Settings:
    """This feature's settings, taken from the collector's resolved configuration."""
    return system.Settings(
        retain_beacons_days=config.retain_beacons_days,
        retain_events_days=config.retain_events_days,
        retain_alerts_days=config.retain_alerts_days,
        retention_auto=config.retention_auto, log_file=config.log_file or None,
        ci_status=ci_status.settings(config).describe())


class Handlers:
    """The route handlers, bound to one service and this feature's state."""

    def __init__(self, service: Service, settings: system.Settings) -> None:
        self.service = service
        self.db = service.db
        self.waiters = topics.TopicWaiters()
        self.retention = system.Retention(service.db, settings)

    # -- topics --------------------------------------------------------------------------------

    async def publish_topic(self, request: web.Request) -> web.Response:
        topic = topics.check_topic(request.match_info["topic"])
        source = topics.check_source(request.query.get("source"))
        payload = await read_json(request, limit=topics.MAX_PAYLOAD_BYTES)
        text = topics.encode_payload(payload)
        reply = await self.service.transact(topics.publish, topic, text, source, now())
        return json_response(reply, status=201)

    async def list_topics(self, request: web.Request) -> web.Response:
        return json_response(await topics.list_topics(self.db))

    async def recent_events(self, request: web.Request) -> web.Response:
        topic = topics.check_topic(request.match_info["topic"])
        limit = query_int(request, "limit", topics.RECENT_DEFAULT, 1, topics.RECENT_MAX)
        before = (query_int(request, "before", 0, 1, 2**62) if request.query.get("before")
                  else None)
        return json_response(await topics.recent(self.db, topic, limit, before))

    async def next_events(self, request: web.Request) -> web.Response:
        topic = topics.check_topic(request.match_info["topic"])
        after = query_int(request, "after", 0, 0, 2**62)
        limit = query_int(request, "limit", topics.NEXT_DEFAULT, 1, topics.NEXT_MAX)
        wait_s = _wait_s(request, self.service.config.long_poll_s)
        events = await topics.next_events(self.db, self.waiters, topic, after, limit, wait_s)
        if not events:
            return web.Response(status=204)
        return json_response({"topic": topic, "events": events, "cursor": events[-1]["seq"]})

    async def poll_event(self, request: web.Request) -> web.Response:
        """The original's cursor poll: the one event after ?after=<id> (200, the event with
        its `id`), waiting up to wait_s for it, or 204 when none came."""
        topic = topics.check_topic(request.match_info["topic"])
        after = query_int(request, "after", 0, 0, 2**62)
        wait_s = _wait_s(request, self.service.config.long_poll_s)
        events = await topics.next_events(self.db, self.waiters, topic, after, 1, wait_s)
        if not events:
            return web.Response(status=204)
        return json_response({"topic": topic, "id": events[0]["seq"], **events[0]})

    # -- result views and system ---------------------------------------------------------------

    async def results_bench(self, request: web.Request) -> web.Response:
        return json_response(await result_views.bench(self.db, request.query))

    async def results_ui(self, request: web.Request) -> web.Response:
        return json_response(await result_views.ui(self.db, request.query))

    async def results_drain(self, request: web.Request) -> web.Response:
        return json_response(await result_views.drain(self.db, request.query, now()))

    async def results_soak(self, request: web.Request) -> web.Response:
        return json_response(await result_views.soak(self.db, request.query))

    async def results_vision(self, request: web.Request) -> web.Response:
        return json_response(await result_views.vision(self.db, request.query))

    async def get_system(self, request: web.Request) -> web.Response:
        return json_response(await system.system_info(
            self.db, self.service.data_dir, self.service.started_at, now(), self.retention))

    async def post_retention(self, request: web.Request) -> web.Response:
        body = await read_json_object(request) if request.body_exists else {}
        apply_changes, settings = system.retention_request(body, self.retention.settings)
        return json_response(await self.retention.run(apply_changes, now(), settings))


def _wait_s(request: web.Request, default: float) -> float:
    raw = request.query.get("wait_s")
    if raw is None or raw == "":
        return min(default, topics.MAX_WAIT_S)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= topics.MAX_WAIT_S:  # also refuses nan
        raise BadRequest(f"wait_s must be a number of seconds from 0 to {topics.MAX_WAIT_S:g}")
    return value


def setup(app: web.Application, service: Service) -> None:
    """Wire this feature: its routes, hooks and health fields, and the daily retention as a
    cleanup context."""
    settings = insight_settings(service.config)
    h = Handlers(service, settings)
    service.listeners.append(h.waiters.on_event)
    service.health_extras.append(lambda: {"topic_polls": h.waiters.waiting,
                                          "stream_dropped_clients": service.hub.dropped_clients})
    app.router.add_routes([
        web.get("/api/events", h.list_topics),
        web.post("/api/events/{topic}", h.publish_topic),
        web.post("/events/{topic}", h.publish_topic),
        web.get("/api/events/{topic}", h.recent_events),
        web.get("/api/events/{topic}/next", h.next_events),
        web.get("/events/{topic}/poll", h.poll_event),
        web.get("/api/results/bench", h.results_bench),
        web.get("/api/results/ui", h.results_ui),
        web.get("/api/results/drain", h.results_drain),
        web.get("/api/results/soak", h.results_soak),
        web.get("/api/results/vision", h.results_vision),
        web.get("/api/system", h.get_system),
        web.post("/api/system/retention", h.post_retention),
    ])

    async def running(_app: web.Application) -> AsyncIterator[None]:
        daily = [service.spawn(h.retention.daily(), "retention")] if settings.retention_auto \
            else []
        yield
        await service.stop_tasks(daily)

    async def answer_waiting(_app: web.Application) -> None:
        h.waiters.close()  # waiting topic polls answer 204 now rather than hold shutdown

    app.cleanup_ctx.append(running)
    app.on_shutdown.append(answer_waiting)

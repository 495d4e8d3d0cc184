"""Schedules (cron) and alerts (rules, ack, snooze, webhook): routes and background loops.

Handlers are thin: domain logic lives in schedules, alerts and webhook. The loops (scheduler
tick on 20-second marks, alert tick every FLEET_ALERT_TICK_S, webhook sender) run for the app's
life in this feature's cleanup context: started after the start-up tick, cancelled before the
service stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import tzinfo
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from aiohttp import web

from fleet_min.collector.access import ci_status
from fleet_min.collector.automation import alerts, job_templates, schedules
from fleet_min.collector.automation.webhook import WebhookConfig, WebhookSender
from fleet_min.collector.jobs import views
from fleet_min.collector.service import Service
from fleet_min.config import CollectorConfig
from fleet_min.db import Periodic
from fleet_min.errors import BadRequest, NotFound
from fleet_min.http import json_body_response, json_response, query_int, read_json_object
from fleet_min.timeutil import now

log = logging.getLogger("fleet_min.collector.automation")


@dataclass(frozen=True)
class AutomationSettings:
    thresholds: alerts.Thresholds
    alert_tick_s: float
    schedule_tick_s: float
    tz: tzinfo | None            # None: the host's local time
    tz_name: str
    webhook: WebhookConfig | None
    log_paths: tuple[Path, ...]


def load_settings(config: CollectorConfig) -> AutomationSettings:
    """This feature's settings, taken from the collector's resolved configuration."""
    thresholds = alerts.Thresholds(
        offline_s=config.alert_offline_s,
        beacon_fresh_s=config.alert_beacon_fresh_s,
        stuck_factor=config.alert_stuck_factor,
        failed_window_s=config.alert_job_failed_window_s,
        battery_pct=config.alert_battery_pct,
        thermal_states=frozenset(s.lower() for s in config.alert_thermal_states),
        schedule_late_s=config.alert_schedule_late_s,
        regression_pct=config.alert_regression_pct,
        data_bytes=config.alert_data_bytes,
        log_bytes=config.alert_log_bytes,
        free_bytes=config.alert_free_bytes)
    webhook = WebhookConfig(
        url=config.alert_webhook, attempts=config.alert_webhook_attempts,
        backoff_s=config.alert_webhook_backoff_s,
        timeout_s=config.alert_webhook_timeout_s) if config.alert_webhook else None
    log_paths = [Path(p) for p in config.alert_log_paths]
    if config.log_file:
        log_paths.append(Path(config.log_file))
    return AutomationSettings(
        thresholds=thresholds, alert_tick_s=config.alert_tick_s,
        schedule_tick_s=config.schedule_tick_s,
        tz=ZoneInfo(config.schedule_tz) if config.schedule_tz else None,
        tz_name=config.schedule_tz, webhook=webhook, log_paths=tuple(log_paths))


class Automation:
    """The feature's state for one app: its settings, the webhook sender, the ticks."""

    def __init__(self, service: Service, settings: AutomationSettings) -> None:
        self.service = service
        self.settings = settings
        self.sender = (WebhookSender(service.db, settings.webhook, self._identity)
                       if settings.webhook else None)

    def _identity(self) -> dict[str, str]:
        return {"collector": self.service.collector_id, "name": self.service.name}

    def view(self) -> schedules.View:
        """What schedule records are read against now."""
        return schedules.View(now(), self.settings.tz, self.settings.thresholds.schedule_late_s)

    async def schedule_tick(self) -> schedules.TickReport:
        report: schedules.TickReport = await self.service.transact(
            schedules.tick, now(), tz=self.settings.tz)
        if report.unread:
            # Runs whose workload needs more of the registry read than a transaction on the
            # event loop's thread may: read on a worker thread, then tick again with it.
            prepared = await views.prepare_enqueue(self.service.db, report.unread, now(),
                                                   separately=True)
            again: schedules.TickReport = await self.service.transact(
                schedules.tick, now(), tz=self.settings.tz, prepared=prepared)
            for name in ("fired", "skipped", "failed", "deferred"):
                getattr(report, name).extend(getattr(again, name))
            report.missed += again.missed
            report.unread = again.unread  # left to the next tick
        return report

    async def alert_tick(self) -> alerts.TickResult:
        await self.service.check_clock()  # a stepped clock must not make every device silent
        sizes = await asyncio.to_thread(alerts.measure, self.service.data_dir,
                                        self.settings.log_paths)
        at = now()
        findings = await self.service.db.read_in_thread(
            alerts.findings_now, at, self.settings.thresholds, sizes, named=True)
        result: alerts.TickResult = await self.service.transact(
            alerts.record, findings, at, webhook_armed=self.sender is not None)
        if result.opened and self.sender is not None:
            self.sender.wake()
        return result

    # -- loops ------------------------------------------------------------------------------

    async def schedule_loop(self) -> None:
        """Ticks after the start-up one: on the period's marks (plus a breath), so a due minute
        fires within a second of coming."""
        period = self.settings.schedule_tick_s
        periodic = Periodic("the scheduler tick", log)
        while True:
            await asyncio.sleep(period - now() % period + 0.2)
            await periodic.run(self.schedule_tick)

    async def alert_loop(self) -> None:
        # The first tick waits one period: after a restart devices need a moment to beacon
        # before their silence means anything.
        await Periodic("the alert tick", log).every(self.settings.alert_tick_s, self.alert_tick)

    async def webhook_loop(self) -> None:
        assert self.sender is not None
        await self.sender.run()


# ---------------------------------------------------------------------------------------------
# handlers


def _alert_id(request: web.Request) -> int:
    raw = request.match_info["alert_id"]
    if not raw.isascii() or not raw.isdigit() or len(raw) > 18:
        raise NotFound(f"no alert {raw[:40]!r}")
    return int(raw)


def _check_ci_target(ci: ci_status.CiSettings, body: dict[str, Any]) -> None:
    """A template's report_to.ci_status must be allowed as POST /jobs would require."""
    template = body.get("template")
    if isinstance(template, dict) and isinstance(template.get("report_to"), dict):
        try:
            ci_status.check_spec(ci, template)
        except BadRequest as exc:
            raise BadRequest(f"template: {exc.message}") from None


def _routes(automation: Automation) -> list[web.RouteDef]:
    service = automation.service
    ci = ci_status.settings(service.config)

    async def create(request: web.Request) -> web.Response:
        body = await read_json_object(request)
        _check_ci_target(ci, body)
        view = automation.view()
        return json_response(await service.transact(schedules.create, body, view.now, view=view),
                             status=201)

    async def put(request: web.Request) -> web.Response:
        """The original's POST /schedules: create or replace, `{"ok": true, ...record}`."""
        body = await read_json_object(request)
        _check_ci_target(ci, body)
        view = automation.view()
        created, record = await service.transact(schedules.put, body, view.now, view=view)
        return json_response({"ok": True, **record}, status=201 if created else 200)

    async def listing(request: web.Request) -> web.Response:
        return json_body_response(await schedules.listing_body(service.db, automation.view()))

    async def bare_listing(request: web.Request) -> web.Response:
        """The original's GET /schedules: the records as a bare array."""
        return json_body_response(await schedules.listing_body(service.db, automation.view(),
                                                               bare=True))

    async def get_one(request: web.Request) -> web.Response:
        return json_response(await schedules.get_schedule(service.db, request.match_info["id"],
                                                          automation.view()))

    async def patched(request: web.Request) -> dict[str, Any]:
        body = await read_json_object(request)
        _check_ci_target(ci, body)
        view = automation.view()
        record: dict[str, Any] = await service.transact(
            schedules.update, request.match_info["id"], body, view.now, view=view)
        return record

    async def patch(request: web.Request) -> web.Response:
        return json_response(await patched(request))

    async def patch_ok(request: web.Request) -> web.Response:
        """The original's PATCH /schedules/{id}: the record with `"ok": true`."""
        return json_response({"ok": True, **await patched(request)})

    async def delete(request: web.Request) -> web.Response:
        return json_response(await service.transact(schedules.delete, request.match_info["id"]))

    async def run_now(request: web.Request) -> web.Response:
        schedule_id = request.match_info["id"]
        reply = await views.transact_reading_first(
            service.transact, schedules.run_now, schedule_id, now(),
            prepare=lambda: schedules.prepare_run(service.db, schedule_id, now()))
        return json_response(reply, status=201 if reply["outcome"] == "enqueued" else 200)

    async def history(request: web.Request) -> web.Response:
        limit = query_int(request, "limit", schedules.HISTORY_LIMIT, 1, 500)
        return json_response(await schedules.history(service.db, request.match_info["id"],
                                                     limit))

    async def schedule_tick(request: web.Request) -> web.Response:
        return json_response((await automation.schedule_tick()).reply())

    async def alert_list(request: web.Request) -> web.Response:
        limit = query_int(request, "limit", 200, 1, 1000)
        listing = await alerts.list_alerts(
            service.db, request.query.get("state") or None, request.query.get("rule") or None,
            limit, now())
        # The original's listing also says whether a webhook is set and what the rules read.
        listing["webhook"] = automation.settings.webhook is not None
        listing["thresholds"] = alerts.thresholds_record(automation.settings.thresholds)
        return json_response(listing)

    async def alert_ack(request: web.Request) -> web.Response:
        return json_response(await service.transact(alerts.ack, _alert_id(request), now()))

    async def alert_snooze(request: web.Request) -> web.Response:
        alert_id = _alert_id(request)
        seconds = alerts.snooze_seconds(await read_json_object(request))
        return json_response(await service.transact(alerts.snooze, alert_id, seconds, now()))

    async def alert_tick(request: web.Request) -> web.Response:
        return json_response((await automation.alert_tick()).reply())

    return [
        web.post("/api/schedules", create),
        web.get("/api/schedules", listing),
        web.get("/api/schedules/{id}", get_one),
        web.patch("/api/schedules/{id}", patch),
        web.delete("/api/schedules/{id}", delete),
        web.post("/api/schedules/{id}/run", run_now),
        web.get("/api/schedules/{id}/history", history),
        web.post("/schedules/tick", schedule_tick),
        # The original collector's routes, used by its scripts: the same records and rules.
        web.post("/schedules", put),
        web.get("/schedules", bare_listing),
        web.patch("/schedules/{id}", patch_ok),
        web.delete("/schedules/{id}", delete),
        web.get("/api/alerts", alert_list),
        web.post("/api/alerts/tick", alert_tick),
        web.post("/api/alerts/{alert_id}/ack", alert_ack),
        web.post("/api/alerts/{alert_id}/snooze", alert_snooze),
    ]


def _template_routes(service: Service) -> list[web.RouteDef]:
    """Job templates: the enqueue form's saved specs."""
    ci = ci_status.settings(service.config)

    def check_ci(spec: Any) -> None:
        _check_ci_target(ci, {"template": spec})

    async def listing(request: web.Request) -> web.Response:
        return json_body_response(await job_templates.listing_body(service.db))

    async def get_one(request: web.Request) -> web.Response:
        return json_response(await job_templates.get_template(service.db,
                                                              request.match_info["id"]))

    async def put(request: web.Request) -> web.Response:
        body = await read_json_object(request)
        check_ci(body.get("spec"))
        created, record = await service.transact(job_templates.put, body, now())
        return json_response({"ok": True, **record}, status=201 if created else 200)

    async def patch(request: web.Request) -> web.Response:
        body = await read_json_object(request)
        check_ci(body.get("spec"))
        return json_response(await service.transact(
            job_templates.update, request.match_info["id"], body, now()))

    async def delete(request: web.Request) -> web.Response:
        return json_response(await service.transact(job_templates.delete,
                                                    request.match_info["id"]))

    async def enqueue(request: web.Request) -> web.Response:
        body = await read_json_object(request) if request.can_read_body else {}
        template_id = request.match_info["id"]
        reply = await views.transact_reading_first(
            service.transact, job_templates.enqueue, template_id, body, now(),
            prepare=lambda: job_templates.prepare(service.db, template_id, now()))
        return json_response(reply, status=201)

    return [
        web.get("/api/templates", listing),
        web.post("/api/templates", put),
        web.get("/api/templates/{id}", get_one),
        web.patch("/api/templates/{id}", patch),
        web.delete("/api/templates/{id}", delete),
        web.post("/api/templates/{id}/enqueue", enqueue),
    ]


def setup(app: web.Application, service: Service) -> None:
    """Wire this feature: its routes and health fields, and its loops as a cleanup context."""
    automation = Automation(service, load_settings(service.config))
    app.router.add_routes(_routes(automation))
    app.router.add_routes(_template_routes(service))
    service.health_extras.append(lambda: {
        "scheduler_tz": automation.settings.tz_name or "local",
        "alert_webhook": automation.sender is not None})

    async def running(_app: web.Application) -> AsyncIterator[None]:
        # The start-up tick runs before the collector serves its first request.
        await Periodic("the scheduler tick", log).run(automation.schedule_tick)
        loops = [service.spawn(automation.schedule_loop(), "scheduler"),
                 service.spawn(automation.alert_loop(), "alerts")]
        if automation.sender is not None:
            loops.append(service.spawn(automation.webhook_loop(), "alert-webhook"))
        yield
        await service.stop_tasks(loops)

    app.cleanup_ctx.append(running)

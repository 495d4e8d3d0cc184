"""The collector's HTTP surface: create_app and the route table. Handlers stay thin: parse,
validate, call one domain function, shape the reply."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Any, cast

from aiohttp import web

from fleet_min import heap, validate
from fleet_min.collector.access import ci_status
from fleet_min.collector.automation import alerts
from fleet_min.collector.http import (
    access,
    artifacts,
    automation,
    enrolment,
    insight,
    metrics,
    mirror,
    openapi,
    pages,
    visual,
)
from fleet_min.collector.jobs import (
    compat,
    devices,
    executors,
    locks,
    queue,
    results,
    rules,
    specs,
    views,
)
from fleet_min.collector.jobs.claims import Claimant
from fleet_min.collector.jobs.kinds import Executor, ResultKind
from fleet_min.collector.jobs.specs import JobSpec
from fleet_min.collector.service import Service
from fleet_min.config import CollectorConfig
from fleet_min.errors import BadRequest, NotFound
from fleet_min.http import (
    CHECK_KEY,
    MAX_JSON_KEY,
    WRITE_STALL_KEY,
    base_middleware_with,
    json_body_response,
    json_response,
    read_json,
    read_json_object,
)
from fleet_min.query import int_param
from fleet_min.serving import CONNECTIONS
from fleet_min.sse import stream
from fleet_min.timeutil import now

SERVICE = web.AppKey("service", Service)

# Each feature module wires itself in setup(app, service): its routes, middlewares and hooks,
# and its loops as a cleanup context (started after the service's, stopped before it). Access
# control comes first: it may add a middleware.
FEATURES = (access, artifacts, visual, automation, enrolment, insight, metrics, mirror, pages,
            openapi)
MAX_BATCH = 1000  # jobs in one POST /jobs array, rows in one POST /results array


def service_of(request: web.Request) -> Service:
    return request.app[SERVICE]


def _refuse_invalid(errors: list[str]) -> None:
    if errors:
        raise BadRequest(specs.first_problem(errors))


def check_job_spec(spec: Any) -> JobSpec:
    """Everything about a job spec that can be checked without the database."""
    return specs.check_spec(spec)


# -- agents ------------------------------------------------------------------------------------


async def register(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    _refuse_invalid(validate.validate_register(body))
    service = service_of(request)
    reply = await service.transact(devices.register, body, now(), request.remote,
                                   caller=access.mesh_caller(request),
                                   max_devices=service.config.max_devices)
    return json_response(reply)


async def register_executor(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    registration = executors.check_registration(body)
    reply = await service_of(request).transact(executors.register, registration, now(),
                                               caller=access.mesh_caller(request))
    return json_response(reply)


async def acquire_locks(request: web.Request) -> web.Response:
    job_id, device_ids, executor = locks.check_acquire(await read_json_object(request))
    return json_response(await service_of(request).transact(
        locks.acquire, job_id, device_ids, executor, now(), caller=access.mesh_caller(request)))


async def release_locks(request: web.Request) -> web.Response:
    job_id, executor = locks.check_release(await read_json_object(request))
    return json_response(await service_of(request).transact(
        locks.release, job_id, executor, now(), caller=access.mesh_caller(request)))


async def device_next_job(request: web.Request) -> web.StreamResponse:
    return await _poll(request, Claimant(Executor.DEVICE, request.match_info["device_id"]))


async def _poll(request: web.Request, claimant: Claimant) -> web.StreamResponse:
    """A long poll: 200 with the claimed job, or 204. A client that goes away cancels the
    handler (handler_cancellation), and Dispatcher.wait then hands back any job claimed for
    it; from its return to aiohttp writing the reply nothing waits."""
    service = service_of(request)
    job = await service.dispatcher.wait(claimant, service.config.long_poll_s,
                                        access.mesh_caller(request))
    return json_response(job) if job is not None else web.Response(status=204)


async def executor_next_job(request: web.Request) -> web.StreamResponse:
    name = executors.check_name(request.query.get("name"))
    # How many claimed jobs the executor may hold at once; it is offered none beyond them.
    # Omitted (0): the last value it said, by a poll or its registration, else 1.
    slots = int_param(request.query, "slots", 0, 1, rules.MAX_SLOTS)
    return await _poll(request, Claimant(Executor.HOST, name, slots))


async def post_results(request: web.Request) -> web.Response:
    body = await read_json(request)
    service = service_of(request)
    caller = access.mesh_caller(request)
    if isinstance(body, list):
        rows = _checked_rows(body)
        replies = await service.transact(results.post_rows, rows, now(), caller=caller)
        return json_response({"ok": True, "results": replies})
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object (a result row or a beacon) "
                         "or an array of result rows")
    _refuse_invalid(validate.validate_post_results(body))
    if body["kind"] == ResultKind.BEACON:
        return json_response(await service.transact(results.post_beacon, body, now(),
                                                    caller=caller))
    return json_response(await service.transact(results.post_result, compat.neutral_row(body),
                                                now(), caller=caller))


def _checked_rows(body: list[Any]) -> list[dict[str, Any]]:
    """An array body of POST /results: result rows only (a beacon is a live signal, not
    something to queue up), every one valid before any is stored."""
    if not body:
        raise BadRequest("the array of result rows is empty")
    if len(body) > MAX_BATCH:
        raise BadRequest(f"at most {MAX_BATCH} result rows can be posted in one request")
    for index, row in enumerate(body):
        if not isinstance(row, dict) or row.get("kind") != ResultKind.RESULT:
            raise BadRequest(f"row {index}: an array holds result rows (kind \"result\") only; "
                             "post a beacon on its own")
        errors = validate.validate_result(row)
        if errors:
            raise BadRequest(f"row {index}: {specs.first_problem(errors)}")
    return [compat.neutral_row(row) for row in body]


async def release(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    device_id = body.get("device_id")
    if not isinstance(device_id, str) or not device_id:
        raise BadRequest("device_id is required: the claimant handing the job back")
    reply = await service_of(request).transact(queue.release, request.match_info["job_id"],
                                               device_id, now(),
                                               caller=access.mesh_caller(request))
    return json_response(reply)


# -- jobs --------------------------------------------------------------------------------------


async def post_jobs(request: web.Request) -> web.Response:
    body = await read_json(request)
    service = service_of(request)
    if isinstance(body, list):
        if not body:
            raise BadRequest("the array of job specs is empty")
        if len(body) > MAX_BATCH:
            raise BadRequest(f"at most {MAX_BATCH} jobs can be enqueued in one request")
        specs = []
        for index, spec in enumerate(body):
            try:
                checked = check_job_spec(spec)  # the neutral form: report_to aliases resolved
                access.check_ci_target(request, checked)
                specs.append(checked)
            except BadRequest as exc:
                raise BadRequest(f"job {index}: {exc.message}") from None
        access.check_signing_jobs(request, specs, service.config)
        enqueued = await _enqueue(service, specs)
        return json_response({"ok": True, "jobs": enqueued.replies}, status=201)
    spec = check_job_spec(body)
    access.check_ci_target(request, spec)
    access.check_signing_jobs(request, [spec], service.config)
    enqueued = await _enqueue(service, [spec])
    return json_response({"ok": True, **enqueued.replies[0]}, status=201)


async def _enqueue(service: Service, specs: list[JobSpec]) -> queue.Enqueued:
    """queue.enqueue of a request's specs. What it would read of the registry that a
    transaction on the event loop's thread should not (a fan-out's targets; a registry too
    large to find a workload's declarer in at once) is read on a worker thread first."""
    def prepare() -> Awaitable[queue.Prepared]:
        return views.prepare_enqueue(service.db, specs, now())

    return cast(queue.Enqueued, await views.transact_reading_first(
        service.transact, queue.enqueue, specs, now(), prepare=prepare,
        prepared=await prepare() if any(spec.get("fanout") for spec in specs) else None))


async def get_job(request: web.Request) -> web.Response:
    return json_response(await views.get_job(service_of(request).db,
                                             request.match_info["job_id"]))


async def sweep(request: web.Request) -> web.Response:
    swept = await service_of(request).sweep()
    return json_response({"ok": True, "requeued": swept.requeued, "failed": swept.failed})


async def api_jobs(request: web.Request) -> web.Response:
    return json_response(await views.list_jobs(service_of(request).db, request.query))


async def api_job_detail(request: web.Request) -> web.Response:
    service = service_of(request)
    job_id = request.match_info["job_id"]
    record = await views.job_detail(service.db, job_id)
    if (record["spec"].get("report_to") or {}).get("ci_status"):
        record["ci_status"] = await ci_status.statuses(
            service.db, job_id, ci_status.settings(service.config).armed)
    return json_response(record)


async def api_cancel(request: web.Request) -> web.Response:
    reason = cancel_reason(await read_json(request) if request.can_read_body else {})
    return json_response(await service_of(request).transact(
        queue.cancel, request.match_info["job_id"], now(), reason=reason))


def cancel_reason(body: Any) -> str | None:
    """The optional body of a cancel: {"reason": "<why>"} (the original's clients send one),
    kept as the job's last_error; no body, {} or a null reason keep the default sentence."""
    if body == {}:
        return None
    if not isinstance(body, dict) or set(body) - {"reason"}:
        raise BadRequest('a cancel takes no body or {"reason": "<why, up to 500 characters>"}')
    reason = body.get("reason")
    if reason is None:
        return None
    if not isinstance(reason, str) or not reason.strip() or len(reason) > 500:
        raise BadRequest("reason must be a sentence of 1 to 500 characters")
    return reason.strip()


async def api_retry(request: web.Request) -> web.Response:
    reply = await service_of(request).transact(queue.retry, request.match_info["job_id"], now())
    return json_response(reply, status=201)


async def api_patch_job(request: web.Request) -> web.Response:
    priority = queue.check_priority_change(await read_json_object(request))
    row = await service_of(request).transact(queue.set_priority, request.match_info["job_id"],
                                             priority, now())
    return json_response(queue.job_record(row))


async def api_preview_targets(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    preview: dict[str, Any] = {
        "schema": 1, "job_id": "preview", "executor": body.get("executor", Executor.DEVICE),
        **{k: body[k] for k in ("workload", "backend", "params", "targets", "fanout")
           if k in body}}
    # Without a workload the preview counts what the targets reach, whatever the devices
    # declare (the original's form); the placeholder only lets the rest of the spec be checked.
    any_workload = "workload" not in preview
    if any_workload:
        preview["workload"] = "preview"
    spec = check_job_spec(preview)
    return json_response(await views.preview_targets(service_of(request).db, spec, now(),
                                                     any_workload=any_workload))


# -- devices, results, health ------------------------------------------------------------------


async def api_devices(request: web.Request) -> web.Response:
    asked = views.device_query(request.query)
    return json_body_response(await views.list_devices_body(service_of(request).db, now(), asked))


async def api_device(request: web.Request) -> web.Response:
    return json_response(await views.get_device(service_of(request).db,
                                                request.match_info["device_id"], now()))


async def api_patch_device(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    device_id = request.match_info["device_id"]
    service = service_of(request)
    await service.transact(devices.edit, device_id, body)
    return json_response(await views.get_device(service.db, device_id, now()))


async def api_delete_device(request: web.Request) -> web.Response:
    device_id = request.match_info["device_id"]
    await service_of(request).transact(devices.forget, device_id)
    return json_response({"ok": True, "device_id": device_id, "forgotten": True})


async def api_forget_devices(request: web.Request) -> web.Response:
    device_ids, silent_for_s = devices.check_forget_many(await read_json_object(request))
    return json_response(await service_of(request).transact(
        devices.forget_many, device_ids, silent_for_s, now()))


async def api_device_beacons(request: web.Request) -> web.Response:
    return json_response(await views.device_beacons(
        service_of(request).db, request.match_info["device_id"], request.query, now()))


async def api_results(request: web.Request) -> web.Response:
    return json_response(await views.list_results(service_of(request).db, request.query))


async def api_result(request: web.Request) -> web.Response:
    return json_response(await views.get_result(service_of(request).db,
                                                request.match_info["result_id"]))


async def api_delete_executor(request: web.Request) -> web.Response:
    name = executors.check_name(request.match_info["name"])
    service = service_of(request)
    polling = name in service.dispatcher.waiting_for(Executor.HOST)
    await service.transact(executors.forget, name, polling, now())
    return json_response({"ok": True, "name": name, "forgotten": True})


async def api_executors(request: web.Request) -> web.Response:
    service = service_of(request)
    return json_response(await views.list_executors(
        service.db, service.dispatcher.waiting_for(Executor.HOST), service.config.long_poll_s,
        now()))


async def api_locks(request: web.Request) -> web.Response:
    return json_response(await views.list_locks(service_of(request).db))


async def api_overview(request: web.Request) -> web.Response:
    service = service_of(request)
    threshold = alerts.Thresholds(battery_pct=service.config.alert_battery_pct)

    def low_battery(devices: list[dict[str, Any]], at: float) -> list[str]:
        return [found.subject for found in alerts.low_battery(alerts.device_rows(devices), at,
                                                             threshold)]

    return json_response(await views.overview(service.db, now(), low_battery,
                                              alerts.DEVICES_SQL))


async def api_health(request: web.Request) -> web.Response:
    return json_response(service_of(request).health())


async def api_stream(request: web.Request) -> web.StreamResponse:
    service = service_of(request)
    return await stream(request, service.hub, lambda: {
        "collector": service.collector_id, "instance": service.instance},
        keepalive_s=service.config.sse_keepalive_s)


async def api_not_found(request: web.Request) -> web.Response:
    """The /api fallback: 405 (with Allow) for a known path asked with the wrong method, else
    404. Only refusals come here, so looking through the routes costs nothing on the hot path."""
    allowed: set[str] = set()
    fallback = request.match_info.route.resource
    for resource in request.app.router.resources():
        if resource is not fallback:
            match, methods = await resource.resolve(request)
            if match is None:
                allowed |= methods
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, sorted(allowed))
    raise NotFound(f"no such route: {request.method} {request.path}")


def add_routes(app: web.Application) -> None:
    app.router.add_routes([
        web.post("/devices/register", register),
        # A poll claims a job: HEAD (which aiohttp otherwise answers with the GET handler)
        # would claim one and drop the body carrying it, and it bypassed the mesh check, which
        # keys agent routes by their method. HEAD gets 405.
        web.get("/devices/{device_id}/next-job", device_next_job, allow_head=False),
        web.post("/executors/register", register_executor),
        web.get("/executor/next-job", executor_next_job, allow_head=False),
        web.post("/results", post_results),
        web.post("/locks/acquire", acquire_locks),
        web.post("/locks/release", release_locks),
        web.post("/jobs", post_jobs),
        web.post("/jobs/sweep", sweep),
        web.post("/api/system/sweep", sweep),  # the original's guarded route for the same
        web.get("/jobs/{job_id}", get_job),
        web.post("/jobs/{job_id}/release", release),
        web.get("/api/health", api_health),
        web.get("/api/overview", api_overview),
        web.get("/api/stream", api_stream),
        web.get("/api/executors", api_executors),
        web.delete("/api/executors/{name}", api_delete_executor),
        web.get("/api/locks", api_locks),
        web.get("/api/devices", api_devices),
        web.post("/api/devices/forget", api_forget_devices),
        web.get("/api/devices/{device_id}", api_device),
        web.patch("/api/devices/{device_id}", api_patch_device),
        web.delete("/api/devices/{device_id}", api_delete_device),
        web.get("/api/devices/{device_id}/beacons", api_device_beacons),
        web.get("/api/results", api_results),
        # [0-9], not \d: Python's \d takes every script's digits, and int() reads them too.
        web.get(r"/api/results/{result_id:[0-9]{1,18}}", api_result),
        web.get("/api/jobs", api_jobs),
        web.post("/api/jobs", post_jobs),  # the original's clients enqueue here
        web.post("/api/jobs/preview-targets", api_preview_targets),
        web.get("/api/jobs/{job_id}", api_job_detail),
        web.patch("/api/jobs/{job_id}", api_patch_job),
        web.post("/api/jobs/{job_id}/cancel", api_cancel),
        web.post("/api/jobs/{job_id}/retry", api_retry),
    ])


def create_app(config: CollectorConfig) -> web.Application:
    # Artifact uploads stream with their own limit, so aiohttp's whole-body cap is lifted here;
    # every JSON handler reads through fleet_min.http.read_json with its own limit.
    gate = access.host_gate(config)
    check = access.request_check(config, gate)
    app = web.Application(middlewares=[base_middleware_with(check)], client_max_size=1 << 62)
    app[access.HOST_GATE] = gate
    app[CHECK_KEY] = check
    app[MAX_JSON_KEY] = config.max_json_bytes
    app[WRITE_STALL_KEY] = config.write_stall_s
    service = Service(config)
    app[SERVICE] = service
    _setup_service(app, service)
    for feature in FEATURES:
        feature.setup(app, service)
    add_routes(app)
    app.router.add_route("*", "/api/{tail:.*}", api_not_found)
    return app


def _setup_service(app: web.Application, service: Service) -> None:
    """The service's own wiring: its database, dispatcher and loops run for the app's life, the
    first cleanup context, so every feature starts after it and stops before it."""

    async def running(_app: web.Application) -> AsyncIterator[None]:
        await service.start()  # stops itself if it fails
        yield
        await service.stop()

    async def settle(_app: web.Application) -> None:
        heap.settle_after_start()  # after every cleanup context entered: aiohttp runs them first

    async def answer_waiting(_app: web.Application) -> None:
        # Open long polls and streams answer now, so they do not hold up the shutdown's grace.
        await service.dispatcher.close()
        service.hub.close()

    def connections() -> dict[str, Any]:
        cap = app.get(CONNECTIONS)  # set by fleet_min.serving; absent under a test client
        return {"connections": cap.report()} if cap is not None else {}

    app.cleanup_ctx.append(running)
    app.on_startup.append(settle)
    app.on_shutdown.append(answer_waiting)
    service.health_extras.append(connections)

"""The collector's HTTP API, route by route, for its OpenAPI document
(fleet_min/openapi/collector.json).

Sources: shared/spec/collector-api.md, shared/spec/decisions.md and docs/collector*.md for the
shapes; the route registrations (collector/http/app.py and each feature's setup()) for the routes
and the statuses they really return. tests/contract/test_routes_documented.py fails when this
table and the router disagree; the schemathesis run checks every reply against it.
"""

from __future__ import annotations

from typing import Any

from fleet_min import metrics
from fleet_min.openapi.dsl import (
    ANY,
    BOOL,
    INT,
    NUM,
    STR,
    TIME,
    Body,
    Param,
    Reply,
    Route,
    Schema,
    Service,
    arr,
    binary_reply,
    embed_schema,
    empty_reply,
    enum,
    header,
    html_reply,
    integer,
    json_reply,
    map_of,
    null,
    obj,
    query,
    ref,
    sse_reply,
    string,
    text_reply,
)

JOB_STATUS = enum("queued", "waiting", "claimed", "done", "failed", "cancelled")
HEX64 = string(pattern="^[0-9a-f]{64}$")
SCHEDULE_ID = string(pattern="^(?!\\.\\.?$)[A-Za-z0-9._:@][A-Za-z0-9._:@-]{0,99}$")
TOPIC = string(pattern="^[A-Za-z0-9._:-]{1,100}$")

# -- status sentences shared by many routes ---------------------------------------------------

BAD_JSON = "the body is not valid JSON, has the wrong types, or breaks a rule (the sentence says)"
TOO_LARGE = "the JSON body is larger than FLEET_MAX_JSON_BYTES (1 MiB by default)"
STORAGE = "the database cannot be written (disk full, read-only file); nothing changed"
BAD_QUERY = "a query parameter is malformed (the sentence names it)"
NO_JOB = "no job with that id"
NO_DEVICE = "no device with that id"
EXECUTORS_FULL = ("a new executor name, and the collector keeps 1,000 host executors, none "
                  "silent for a day")
GUARD_401 = "FLEET_DASH_TOKEN is set and X-Fleet-Token is missing"
GUARD_403 = "X-Fleet-Token is wrong, or the request comes from another site's page"
SIGNING_401 = ("FLEET_DASH_TOKEN is set and an archive job (it signs with an executor's release "
               "key) came without X-Fleet-Token")
SIGNING_403 = ("the request comes from another site's page, or an archive job came with a wrong "
               "X-Fleet-Token")
MESH_403 = ("FLEET_MESH_ALLOW is set and the mesh peer is unidentified or not listed, or is "
            "not the mesh node the device registered from (or its executor name is bound to)")
# A claim is a GET (the agents' protocol), so the boundary's Origin check for changes does not
# see it; the page behind it is read from the headers browsers send (fleet_min.origin).
CLAIM_403 = (f"{MESH_403}; or another page asked for it: Sec-Fetch-Site other than "
             "same-origin or none, or an Origin or Referer of another origin (a claim changes "
             "the queue, and a page elsewhere can send a GET with an <img>)")
JSON_ERRORS = {400: BAD_JSON, 413: TOO_LARGE, 503: STORAGE}

PATH_PARAMS = {
    "job_id": Param("job_id", ref("jobId"), "a job id", "path"),
    "device_id": Param("device_id", ref("jobId"), "a device id (the agent's choice)", "path"),
    "sha256": Param("sha256", HEX64, "the artifact's SHA-256, 64 lowercase hex digits", "path"),
    "id": Param("id", SCHEDULE_ID, "a schedule id", "path"),
    "alert_id": Param("alert_id", integer(1, 10**18 - 1), "an alert id", "path"),
    "result_id": Param("result_id", integer(0, 10**18 - 1),
                       "a result row's id (listings and GET /api/jobs/{job_id} give it)", "path"),
    "topic": Param("topic", TOPIC, "a topic name", "path"),
    "peer_id": Param("peer_id", string(minLength=1, maxLength=200),
                     "a peer collector's stable id (GET /api/peers lists them)", "path"),
    "name": Param("name", string(minLength=1, maxLength=200),
                  "a host executor's name (GET /api/executors lists them)", "path"),
    "tail": Param("tail", STR, "the rest of the path (may contain slashes)", "path"),
    "build": Param("build", string(pattern="^[0-9a-zA-Z_-]{1,64}$"),
                   "the build digest the page was rendered with", "path"),
    "path": Param("path", string(minLength=1),
                  "a file under web/dash, web/runner, web/vendor or web/common", "path"),
}

# -- components --------------------------------------------------------------------------------


def paged(key: str, item: Schema, **more: Schema) -> Schema:
    return obj({"page": integer(1), "per_page": INT, "total": integer(0), "pages": integer(1),
                key: arr(item), **more})


JOB_FIELDS: dict[str, Schema] = {
    "job_id": STR, "workload": STR, "executor": STR, "backend": null(STR), "status": JOB_STATUS,
    "priority": INT, "claimed_by": null(STR), "attempts": integer(0), "max_attempts": INT,
    "lease_ttl_s": INT, "lease_deadline": null(TIME), "last_error": null(STR),
    "parent_job_id": null(STR), "template_id": null(STR), "fanout_parent": BOOL,
    "created_at": TIME, "updated_at": TIME, "claimed_at": null(TIME), "finished_at": null(TIME),
    "warnings": arr(STR), "spec": obj(),
    "wants_executor": null(STR),  # a host job's targets.executor (the original's field)
    "pool?": null(STR)}  # targets.pool; GET /jobs/{id} and the /api/jobs listings
JOB_RECORD = obj(JOB_FIELDS)

JOB_LINK = obj({"job_id": STR, "status": null(JOB_STATUS)})

RESULT_RECORD = obj({
    "id": INT, "job_id": STR, "device_id": STR, "iter": integer(0), "attempt": integer(1),
    "workload": STR,
    "ok": null(BOOL), "final": BOOL, "preempted": BOOL, "error": null(STR), "metrics": obj(),
    "artifacts": arr(STR), "device": null(obj()), "created_at": TIME},
    description="A stored result row; unknown fields the agent sent ride along at the top level.")

DEVICE = obj({
    "device_id": STR, "name": null(STR), "notes": null(STR), "descriptor": obj(),
    "platform": null(STR), "kind": null(STR), "simulator": BOOL, "pools": arr(STR),
    "reported_pools": arr(STR),
    "pools_override": null(arr(STR)), "capabilities": null(arr(STR)),
    "status": enum("online", "stale", "offline"), "temporary": BOOL, "ttl_s": null(INT),
    "expired": BOOL, "first_seen": TIME, "last_seen": TIME, "last_seen_age_s": NUM,
    "last_beacon": null(obj()), "last_beacon_at": null(TIME),
    "busy": null(obj({"job_id": STR, "collector": null(STR), "at": null(TIME)})),
    "address": null(STR),
    "beacon": null(obj()), "last_net": null(enum("lan", "mesh", "loopback", "name", "other"))})

ARTIFACT = obj({
    "sha256": HEX64, "size": integer(0), "created_at": TIME, "name": null(STR), "app": null(STR),
    "build": null(STR), "platform": null(STR), "pinned": BOOL, "pinned_reason": null(STR),
    "baseline": BOOL, "url": STR})

SCHEDULE = obj({
    "id": STR, "cron": STR, "enabled": BOOL, "last_run": null(TIME), "next_run": null(TIME),
    "missed": BOOL, "missed_detail": null(STR),
    "template": obj(), "last_skip": null(STR), "last_slot": null(TIME), "created_at": TIME,
    "updated_at": TIME})

JOB_TEMPLATE = obj({
    "id": STR, "name": null(STR), "workload": STR, "executor": STR, "spec": obj(),
    "created_at": TIME, "updated_at": TIME})

ALERT = obj({
    "id": INT, "rule": STR, "subject": STR, "state": enum("open", "resolved"),
    "seen_count": integer(1), "first_seen": TIME, "last_seen": TIME, "resolved_at": null(TIME),
    "acked_at": null(TIME), "snoozed_until": null(TIME), "muted": BOOL, "detail": null(STR),
    "status": enum("open", "acked", "snoozed", "resolved"),
    "webhook_state": null(enum("pending", "delivered", "failed", "folded"))})

TOPIC_EVENT = obj({"seq": INT, "at": TIME, "source": null(STR), "payload": ANY})

STATS = obj({"median": null(NUM), "min": null(NUM), "max": null(NUM), "n": integer(0)})


def _components() -> dict[str, Schema]:
    schemas: dict[str, Schema] = {
        "Error": obj({"error": string(minLength=1)},
                     description='Every refusal: {"error": "<one sentence a person can act '
                                 'on>"}.'),
        "JobRecord": JOB_RECORD,
        # The job row's fields, with `attempts` the list of attempts instead of their count.
        "JobDetail": obj({**JOB_FIELDS, **{
            "results": arr({"allOf": [ref("ResultListed"), obj({"payload": obj(
                description="the row as posted (rebuilt from what is stored, cut down as "
                            "the row is), for the clients already in the field")})]},
                description="every final row and the newest 1,000 others, ordered by "
                            "attempt, device and iteration"),
            "results_total": integer(0),
            "parent": null(STR),
            "artifacts": arr(obj({"sha256": HEX64, "role": enum("input", "output"),
                                  "in_store": BOOL, "name": null(STR), "size": null(INT),
                                  "url": STR})),
            "derived_timeline": arr(obj({"at": TIME, "event": STR, "detail": null(STR)})),
            "children": arr(obj({"job_id": STR, "status": JOB_STATUS, "claimed_by": null(STR),
                                 "last_error": null(STR), "target_device": null(STR)})),
            "attempts": arr(obj({"attempt": INT, "claimed_by": null(STR), "claimed_at": null(TIME),
                                 "ended_at": null(TIME), "outcome": null(STR),
                                 "error": null(STR)})),
            "depends_on": arr(ref("jobId")), "dependencies": arr(JOB_LINK),
            "dependents": arr(JOB_LINK),
            "ci_status?": ref("CiStatus")}}),
        # Not allOf JobSpec: the spec refuses fields of its own it does not know (attempt).
        "ClaimedJob": obj({
            "schema": enum(1), "job_id": ref("jobId"), "workload": STR,
            "executor": enum("device", "host"),
            "lease": obj({"ttl_s": INT, "max_attempts": INT}), "attempt": integer(1),
            "lease_deadline": TIME},
            description="The stored spec of the claimed job (the fields of JobSpec, in the "
                        "neutral form) with its lease, attempt and lease_deadline."),
        "ResultRecord": RESULT_RECORD,
        "Device": DEVICE,
        "DeviceDetail": {"allOf": [ref("Device"), obj({"running": arr(obj({
            "job_id": STR, "workload": STR, "lease_deadline": null(TIME)})),
            "jobs": arr(ref("JobListed")), "benchmarks": arr(ref("ResultListed"))})]},
        "JobListed": {"allOf": [ref("JobRecord"), obj({"trimmed": arr(enum("spec"))},
            description="a job as a listing carries it: a spec past 8,192 characters of JSON "
                        "keeps only its first 64 fields that are plain, or text, objects or "
                        "arrays of at most 1,024 characters (`trimmed` then names it); "
                        "GET /api/jobs/{job_id} has it whole")]},
        "ResultListed": {"allOf": [ref("ResultRecord"), obj({"trimmed": arr(enum(
            "metrics", "device", "extra"))}, description=(
                "a result row as a listing carries it: metrics, device and the extra fields "
                "an agent added, each past 8,192 characters of JSON (2,048 for device), keep "
                "only their first fields that are plain, or short text, objects or arrays "
                "(`trimmed` then names them); GET /api/results/{result_id} has the row "
                "whole"))]},
        "Artifact": ARTIFACT,
        "Schedule": SCHEDULE,
        "ScheduleOk": {"allOf": [SCHEDULE, obj({"ok": OK_TRUE})]},
        "JobTemplate": JOB_TEMPLATE,
        "JobTemplateOk": {"allOf": [JOB_TEMPLATE, obj({"ok": OK_TRUE})]},
        "Alert": ALERT,
        "TopicEvent": TOPIC_EVENT,
        "Stats": STATS,
        "CiStatus": obj({"job_id": STR, "target": null(STR), "armed": BOOL, "statuses": arr(obj({
            "id": INT, "state": enum("pending", "success", "failure", "error"),
            "description": STR, "at": TIME, "dry_run": BOOL, "http_status": null(INT),
            "error": null(STR)}))}),
        "TickReport": obj({"ok": BOOL, "missed": integer(0),
                           "fired": arr(obj({"schedule_id": STR, "slot": STR, "job_id": STR,
                                             "status": JOB_STATUS})),
                           "skipped": arr(obj({"schedule_id": STR, "slot": STR, "reason": STR})),
                           "failed": arr(obj({"schedule_id": STR, "slot": STR, "error": STR})),
                           "deferred": arr(obj({"schedule_id": STR, "slot": STR,
                                                "reason": STR}))}),
        "Retention": obj({"ok": BOOL, "apply": BOOL, "dry_run": BOOL, "policy": obj(),
                          "tables": map_of(obj()), "reclaim?": obj(),
                          "would_delete?": map_of(integer(0))}),
    }
    embed_schema("job", "JobSpec", schemas)
    embed_schema("result", "ResultRow", schemas)
    embed_schema("beacon", "Beacon", schemas)
    embed_schema("register", "Registration", schemas)
    return schemas


# -- routes ------------------------------------------------------------------------------------


def guarded(method: str, path: str, summary: str, replies: dict[int, Reply],
            errors: dict[int, str], **more: Any) -> Route:
    """A dashboard change: X-Fleet-Token when FLEET_DASH_TOKEN is set; cross-site refused."""
    return Route(method, path, summary, replies, {**errors, 401: GUARD_401, 403: GUARD_403},
                 security=("dashToken",), security_optional=True, **more)


OK_TRUE = enum(True)


def _agents() -> list[Route]:
    tag = "agents"
    next_job = {200: json_reply(ref("ClaimedJob"), "a job was claimed; its lease is running"),
                204: empty_reply("the long poll (FLEET_LONG_POLL_S, 25 s) ended with nothing "
                                 "to do")}
    # A final row that closed its job adds promoted and failed; one that handed it back,
    # preempted and resume_from (the original's clients read them).
    stored_row = obj({"ok": OK_TRUE, "duplicate": BOOL, "job_id": STR, "status": JOB_STATUS,
                      "attempt": integer(1), "promoted?": arr(STR), "failed?": arr(STR),
                      "preempted?": BOOL, "resume_from?": null(STR)})
    return [
        Route("POST", "/devices/register", "Register (upsert) a device", {200: json_reply(obj({
            "ok": OK_TRUE, "device_id": STR, "capabilities": null(arr(STR)),
            "pools": arr(STR)}), "the effective capabilities and pools")},
            {**JSON_ERRORS, 403: MESH_403,
             413: f"{TOO_LARGE}, or its descriptor is over 16 KiB of JSON",
             507: "a new device, and the registry holds FLEET_MAX_DEVICES devices none of "
                  "which is a temporary device that has left the shelf"},
            body=Body(ref("Registration"), "the registration body"), tag=tag),
        Route("POST", "/executors/register", "Register (upsert) a host executor",
              {200: json_reply(obj({"ok": OK_TRUE, "name": STR,
                                    "capabilities": null(arr(STR)), "slots": integer(1, 64)}),
                               "what the executor is offered now: its capabilities (null: "
                               "every host job) and slots")},
              {**JSON_ERRORS, 403: MESH_403, 507: EXECUTORS_FULL},
              body=Body(obj({"name": string(minLength=1, maxLength=200),
                             "capabilities?": arr(string(minLength=1, maxLength=200),
                                                  maxItems=100),
                             "slots?": integer(1, 64),
                             "agent?": string(maxLength=200)}),
                        "capabilities omitted: no opinion at the first registration, the "
                        "previous list after it; an empty list: nothing"), tag=tag),
        Route("GET", "/devices/{device_id}/next-job", "Long-poll for a device job", next_job,
              {403: CLAIM_403, 404: "the device is not registered; register first",
               503: STORAGE}, tag=tag),
        Route("GET", "/executor/next-job", "Long-poll for a host job", next_job,
              {400: "name is missing or longer than 200 characters, or slots is not an "
                    "integer from 1 to 64", 403: CLAIM_403, 503: STORAGE,
               507: EXECUTORS_FULL},
              params=(query("name", string(minLength=1, maxLength=200),
                            "the executor's label", required=True),
                      query("slots", integer(1, 64),
                            "claimed jobs the executor may hold at once (default 1)")),
              tag=tag),
        Route("POST", "/results", "Post a result row, an array of result rows, or a beacon",
              {200: json_reply({"anyOf": [
                  obj({"lease_renewed": BOOL, "preempt": BOOL}), stored_row,
                  obj({"ok": OK_TRUE, "results": arr(stored_row)})]},
                  "beacon: {lease_renewed, preempt}; result: the row was stored (or was a "
                  "repeat); array: one such reply per row, in order")},
              {**JSON_ERRORS, 403: MESH_403,
               413: f"{TOO_LARGE}, or a beacon's `beacon` is over 16 KiB of JSON",
               404: "the job is unknown (result; in an array the sentence names the row and "
                    "nothing is stored), or the device is not registered (beacon; a host "
                    "executor may beacon under its name for the job it holds)",
               409: "the row is not the current claimant's and its poster did not hold the "
                    "attempt it reports for (named in `attempt`, else the poster's last), or it "
                    "differs from a stored row of an earlier attempt under the same key (an "
                    "exact repeat of a stored row is still a duplicate); a beacon from an "
                    "unregistered id names a host job it never held"},
              body=Body({"oneOf": [ref("ResultRow"), ref("Beacon"),
                                   {"type": "array", "items": ref("ResultRow"), "minItems": 1,
                                    "maxItems": 1000}]},
                        "a result row, a beacon, or an array of 1 to 1000 result rows applied "
                        "in order in one transaction (all or none)"),
              tag=tag),
        Route("POST", "/jobs/{job_id}/release", "Hand a claimed job back", {200: json_reply(obj({
            "ok": OK_TRUE, "job_id": STR, "status": enum("queued")}))},
            {**JSON_ERRORS, 403: MESH_403, 404: NO_JOB,
             409: "the caller is not the claimant, or a result row exists"},
            body=Body(obj({"device_id": string(minLength=1)}), "the claimant"), tag=tag),
        Route("POST", "/locks/acquire", "Lock devices for a running host job",
              {200: json_reply(obj({"ok": OK_TRUE, "job_id": STR, "granted": arr(STR),
                                    "refused": arr(STR)}),
                               "granted: the devices the job holds now (those it held already "
                               "among them); refused: those another job holds")},
              {**JSON_ERRORS, 403: MESH_403, 404: NO_JOB,
               409: "the job is not a claimed host job, or the executor named is not its "
                    "claimant"},
              body=Body(obj({"job_id": string(minLength=1, maxLength=200),
                             "device_ids": arr(string(minLength=1, maxLength=200),
                                               minItems=1, maxItems=100),
                             "executor?": string(minLength=1, maxLength=200)}),
                        "the job, the devices, and the executor speaking (omitted: the job's "
                        "claimant)"), tag=tag),
        Route("POST", "/locks/release", "Give back every device lock a host job holds",
              {200: json_reply(obj({"ok": OK_TRUE, "job_id": STR, "released": integer(0)}),
                               "how many locks were released (0 for a job no longer claimed)")},
              {**JSON_ERRORS, 403: MESH_403, 404: NO_JOB,
               409: "the executor named is not the job's claimant"},
              body=Body(obj({"job_id": string(minLength=1, maxLength=200),
                             "executor?": string(minLength=1, maxLength=200)}),
                        "the job, and the executor speaking (omitted: the job's claimant)"),
              tag=tag),
    ]


def _jobs() -> list[Route]:
    tag = "jobs"
    enqueued = obj({"ok": OK_TRUE, "job_id": STR, "status": JOB_STATUS,
                    "fanout?": arr(STR), "warnings?": arr(STR)})
    batch = obj({"ok": OK_TRUE, "jobs": arr(obj({"job_id": STR, "status": JOB_STATUS,
                                                 "fanout?": arr(STR), "warnings?": arr(STR)}))})
    return [
        Route("POST", "/jobs", "Enqueue a job, or an array of jobs (all or none)",
              {201: json_reply({"anyOf": [enqueued, batch]}, "stored")},
              {**JSON_ERRORS, 401: SIGNING_401, 403: SIGNING_403,
               409: "a job_id exists already (or repeats in the array)",
               422: "no registered agent declares the workload (the sentence names it), or a "
                    "fan-out matches no device (no executor, for a host job)"},
              body=Body({"anyOf": [ref("JobSpec"), arr(ref("JobSpec"), minItems=1,
                                                        maxItems=1000)]},
                        "one job spec, or an array of up to 1000"), tag=tag),
        Route("POST", "/api/jobs", "POST /jobs under the name the original's clients use",
              {201: json_reply({"anyOf": [enqueued, batch]}, "stored")},
              {**JSON_ERRORS, 401: SIGNING_401, 403: SIGNING_403,
               409: "a job_id exists already (or repeats in the array)",
               422: "no registered agent declares the workload, or a fan-out matches nothing"},
              body=Body({"anyOf": [ref("JobSpec"), arr(ref("JobSpec"), minItems=1,
                                                        maxItems=1000)]},
                        "one job spec, or an array of up to 1000"), tag=tag),
        Route("POST", "/jobs/sweep", "Run the lease sweep now", {200: json_reply(obj({
            "ok": OK_TRUE, "requeued": arr(STR), "failed": arr(STR)}))}, {503: STORAGE},
              tag=tag),
        guarded("POST", "/api/system/sweep", "Run the lease sweep now (the original's route)",
                {200: json_reply(obj({"ok": OK_TRUE, "requeued": arr(STR),
                                      "failed": arr(STR)}))}, {503: STORAGE}, tag=tag),
        Route("GET", "/jobs/{job_id}", "A job row with its spec",
              {200: json_reply(ref("JobRecord"))}, {404: NO_JOB}, tag=tag),
        Route("GET", "/api/jobs", "List jobs, newest first, 50 a page",
              {200: json_reply(paged("jobs", ref("JobListed"), status_counts=map_of(
                  integer(0)), workloads=arr(STR), pools=arr(STR)))}, {400: BAD_QUERY},
              params=(query("status", STR, "comma-separated statuses"),
                      query("workload", STR, "exact workload"),
                      query("executor", STR, "device or host"),
                      query("pool", STR, "exact pool"),
                      query("device", STR, "claimant or pinned device"),
                      query("q", STR, "text in the job id or last error"),
                      query("from", STR, "ISO-8601 time: created at or after"),
                      query("to", STR, "ISO-8601 time: created at or before"),
                      query("page", integer(1, 1_000_000), "page number")), tag=tag),
        Route("GET", "/api/jobs/{job_id}", "Job detail: results, artifacts, children, attempts",
              {200: json_reply(ref("JobDetail"))}, {404: NO_JOB}, tag=tag),
        guarded("PATCH", "/api/jobs/{job_id}", "Change an open job's priority",
                {200: json_reply(ref("JobRecord"))},
                {**JSON_ERRORS, 404: NO_JOB, 409: "the job is closed"},
                body=Body(obj({"priority": integer(-1000, 1000)}, closed=True), "the priority"),
                tag=tag),
        guarded("POST", "/api/jobs/{job_id}/cancel", "Cancel a queued, waiting or claimed job",
                {200: json_reply(obj({"ok": OK_TRUE, "job_id": STR, "was": JOB_STATUS,
                                      "cascaded": arr(STR), "locks_released": integer(0)}))},
                {**JSON_ERRORS, 404: NO_JOB, 409: "the job is closed already",
                 503: STORAGE},
                body=Body(obj({"reason?": null(string(minLength=1, maxLength=500))},
                              closed=True),
                          "optional: the operator's reason, kept as the job's last_error",
                          required=False),
                tag=tag),
        Route("POST", "/api/jobs/{job_id}/mirror", "Post a live-mirror frame of a running "
              "host job (kept in memory, newest only)",
              {204: empty_reply("kept: viewers get it as their next frame")},
              {400: "the frame is empty or not a whole JPEG (FF D8 FF ... FF D9)", 403: MESH_403,
               404: NO_JOB, 413: "larger than FLEET_MAX_MIRROR_BYTES (1 MiB by default)",
               409: "the job is not a claimed host job, or the poster is not its claimant (or "
                    "names no executor and no attached device)"},
              params=(query("executor", string(minLength=1, maxLength=200),
                            "the executor posting (or the X-Fleet-Executor header)"),
                      query("device_id", string(minLength=1, maxLength=200),
                            "naming no executor: the attached device the frame shows"),
                      header("X-Fleet-Executor", string(maxLength=200),
                             "the executor posting")),
              body=Body({"type": "string", "format": "binary"}, "one JPEG image",
                        media="image/jpeg"), tag=tag),
        Route("GET", "/api/jobs/{job_id}/mirror", "Watch a running host job's live mirror",
              {200: Reply("the frames as they come, newest only, as "
                          "multipart/x-mixed-replace parts (an <img> shows it); it ends when "
                          "the job leaves its claim",
                          {"multipart/x-mixed-replace": {"type": "string",
                                                         "format": "binary"}})},
              {404: "no such job, or it is not running (its mirror ended with its run)"},
              tag=tag),
        Route("GET", "/api/jobs/{job_id}/mirror/status", "Whether a job's live mirror has a "
              "frame to show",
              {200: json_reply(obj({"streaming": BOOL, "frame_at": null(TIME),
                                    "viewers": integer(0)}))}, {404: NO_JOB}, tag=tag),
        guarded("POST", "/api/jobs/{job_id}/retry", "Clone a failed or cancelled job as <id>-rN",
                {201: json_reply(obj({"ok": OK_TRUE, "job_id": STR, "retry_of": STR,
                                      "status": JOB_STATUS, "fanout?": arr(STR)}))},
                {404: NO_JOB, 409: "the job is not failed or cancelled",
                 422: "the workload is no longer declared by any agent", 503: STORAGE},
                tag=tag),
        Route("POST", "/api/jobs/preview-targets",
              "Count the devices (executors, for a host job) a target would reach",
              {200: json_reply(obj({"count": integer(0), "devices": arr(obj({
                  "device_id": STR, "platform": ANY, "model": ANY, "pools": arr(STR)})),
                  "executors?": arr(STR)}))},
              JSON_ERRORS,
              body=Body(obj({"workload?": ref("name"), "executor?": enum("device", "host"),
                             "backend?": ref("name"), "params?": obj(), "targets?": ANY,
                             "fanout?": ANY}),
                        "a spec, or its workload, executor, backend, params (a build's kind), "
                        "targets and fanout; without a workload, every device the targets "
                        "reach, whatever it declares"),
              tag=tag),
        Route("GET", "/api/jobs/{job_id}/ci-status", "Commit statuses posted for a job",
              {200: json_reply(ref("CiStatus"))}, {404: NO_JOB}, tag=tag),
        Route("GET", "/status-reports", "Recorded commit statuses, newest first (the original's)",
              {200: json_reply(arr(obj({
                  "id": INT, "job_id": STR, "target": STR,
                  "state": enum("pending", "success", "failure", "error"),
                  "description": null(STR), "at": TIME, "posted": enum(0, 1), "detail": STR,
                  "dry_run": BOOL})))}, tag=tag),
    ]


def _devices() -> list[Route]:
    tag = "devices"
    return [
        Route("GET", "/api/executors", "List host executors: status, capabilities, attached "
              "devices, the jobs they hold",
              {200: json_reply(obj({"executors": arr(obj({
                  "name": STR, "status": enum("polling", "busy", "idle", "offline"),
                  "capabilities": null(arr(STR)), "slots": INT, "agent": null(STR),
                  "attached": arr(obj({"device_id": STR, "status": STR})),
                  "jobs": arr(obj({"job_id": STR, "workload": STR})),
                  "first_seen": TIME, "last_seen": TIME,
                  "registered_at": null(TIME)}))}))}, tag=tag),
        Route("GET", "/api/locks", "List device locks: the job, its holder, when it expires",
              {200: json_reply(obj({"locks": arr(obj({
                  "device_id": STR, "job_id": STR, "holder": null(STR),
                  "executor": null(enum("device", "host")), "acquired_at": TIME,
                  "expires_at": null(TIME)}))}))}, tag=tag),
        Route("GET", "/api/devices", "List devices (expired temporary ones on request)",
              {200: json_reply(obj({"devices": arr({"allOf": [ref("Device"), obj({
                  "trimmed": arr(enum("descriptor", "last_beacon", "pools", "pools_override",
                                      "capabilities"))}, description=(
                  "which parts a listing carries cut down: the descriptor and last beacon "
                  "past 2,048 characters of JSON keep only their first 32 plain fields (text "
                  "up to 200 characters); pools, pools_override and capabilities past 1,024 "
                  "characters only their first 32 names of up to 64 characters (the "
                  "effective `pools` and `reported_pools` follow); "
                  "GET /api/devices/{device_id} has them whole"))]}),
                  "pools": arr(STR),
                  "expired_hidden": {**integer(0), "description": "expired temporary devices "
                                     "left out of this listing (0 with ?expired=1)"},
                  "devices_total?": {**integer(0), "description": "with ?limit=: the devices "
                                     "the listing would hold without it"},
                  "cut?": {**BOOL, "description": "with ?limit=: true when "
                           "devices_total is more than the devices listed"}}))},
              {400: BAD_QUERY},
              params=(query("expired", STR, "true, 1 or yes also lists expired temporary "
                                            "devices"),
                      query("first_seen_after", STR, "ISO-8601 time: only the devices first "
                            "seen after it"),
                      query("limit", INT, "at most this many devices (1 to 1,000,000), those "
                            "seen last")), tag=tag),
        Route("GET", "/api/devices/{device_id}", "One device, expired or not",
              {200: json_reply(ref("DeviceDetail"))}, {404: NO_DEVICE}, tag=tag),
        guarded("PATCH", "/api/devices/{device_id}", "Edit name, notes, pools override",
                {200: json_reply(ref("DeviceDetail"))},
                {**JSON_ERRORS, 404: NO_DEVICE},
                body=Body(obj({"name?": null(string(maxLength=2000)),
                               "notes?": null(string(maxLength=2000)),
                               "pools?": null(arr(string(minLength=1, maxLength=100),
                                                  maxItems=64))}, closed=True, minProperties=1),
                          "fields to change; null clears"),
                tag=tag),
        guarded("DELETE", "/api/executors/{name}", "Forget a host executor (its jobs stay)",
                {200: json_reply(obj({"ok": OK_TRUE, "name": STR, "forgotten": enum(True)}))},
                {400: "not an executor name", 404: "no such executor",
                 409: "it is not offline (heard within 3 minutes, or a poll of its waits), "
                      "or it holds a claimed job (named)", 503: STORAGE},
                tag=tag),
        guarded("POST", "/api/devices/forget", "Forget many devices at once (results stay)",
                {200: json_reply(obj({
                    "ok": OK_TRUE, "forgotten": arr(STR),
                    "kept": arr(obj({"device_id": STR, "locked_by": STR})),
                    "unknown": arr(STR)}))},
                {**JSON_ERRORS},
                body=Body(obj({"device_ids?": arr(STR), "silent_for_s?": NUM}, closed=True,
                              minProperties=1, maxProperties=1),
                          "the ids to forget (at most 1,000), or silent_for_s: every device "
                          "not seen for that many seconds (3600 at least); a device a running "
                          "job holds locked is kept"),
                tag=tag),
        guarded("DELETE", "/api/devices/{device_id}", "Forget a device (its results stay)",
                {200: json_reply(obj({"ok": OK_TRUE, "device_id": STR, "forgotten": enum(True)}))},
                {404: NO_DEVICE, 409: "a running job holds the device locked (named)",
                 503: STORAGE},
                tag=tag),
        Route("GET", "/api/devices/{device_id}/beacons", "A device's beacon history",
              {200: json_reply(obj({"device_id": STR, "truncated": BOOL,
                                    "beacons": arr(obj({"at": TIME,
                                                        "job_id": null(STR)})),
                                    "samples": arr(obj({"at": TIME, "ts": TIME,
                                                        "job_id": null(STR)}))}))},
              {400: BAD_QUERY, 404: "no such device and no beacon history under its id"},
              params=(query("since", STR, "ISO-8601 time"),
                      query("hours", integer(1, 8760), "the last hours (when since is not "
                            "given)")), tag=tag),
    ]


def _reads() -> list[Route]:
    tag = "reads"
    return [
        Route("GET", "/api/health", "Health", {200: json_reply(obj({
            "ok": BOOL, "collector": STR, "name": STR, "instance": STR, "started_at": TIME,
            "uptime_s": NUM, "now": TIME, "node": STR, "pid": INT, "stream_clients": integer(0),
            "guard": BOOL,
            # A served collector's connections: open, the cap, refused past it; the most one
            # peer group may hold (0: no such rule) and how many it refused.
            "connections?": obj({"held": integer(0), "cap": integer(0), "refused": integer(0),
                                 "peer_cap": integer(0), "peer_refused": integer(0)})}))},
              tag=tag),
        Route("GET", "/api/overview", "Fleet overview in one call", {200: json_reply(obj({
            "devices": obj({"total": INT, "online": INT, "stale": INT, "offline": INT,
                            "low_battery_devices": arr(STR)}),
            "queue": map_of(integer(0)),
            "schedules": obj({"total": integer(0), "enabled": integer(0)}),
            "generated_at": TIME,
            "running": arr(obj({"job_id": STR, "workload": STR, "claimed_by": null(STR),
                                "claimed_at": null(TIME), "lease_deadline": null(TIME),
                                "progress": obj({"rows": INT, "last_iter": null(INT)})})),
            "recent_failures": arr(obj({"job_id": STR, "workload": STR,
                                        "last_error": null(STR), "finished_at": null(TIME),
                                        "attempts": integer(0), "max_attempts": integer(1)})),
            "now": TIME}))}, tag=tag),
        Route("GET", "/api/stream", "Live events (server-sent events)",
              {200: sse_reply("a hello event, then job, device, result, beacon, topic, alert, "
                              "schedule and artifact events", obj({"type": STR, "at": TIME}),
                              enum("hello", "job", "device", "result", "beacon", "topic",
                                   "alert", "schedule", "artifact"))},
              params=(query("last_event_id", STR, "resume after this event id"),
                      header("Last-Event-ID", STR, "resume after this event id")), tag=tag),
        Route("GET", "/metrics", "Metrics in the Prometheus text format (version 0.0.4)",
              {200: text_reply("jobs, claim waits, lease expiries, devices, beacon ages, "
                               "ingestion, artifacts, database and process figures "
                               "(docs/metrics.md)", metrics.CONTENT_TYPE)}, tag=tag),
        Route("GET", "/api/results", "Result rows, newest first, 50 a page",
              {200: json_reply(paged("results", ref("ResultListed")))}, {400: BAD_QUERY},
              params=(query("job", STR, "job id"), query("device", STR, "device id"),
                      query("workload", STR, "workload"),
                      query("from", STR, "ISO-8601 time"), query("to", STR, "ISO-8601 time"),
                      query("page", integer(1, 1_000_000), "page number")), tag=tag),
        Route("GET", "/api/results/{result_id}", "One result row whole, as stored",
              {200: json_reply({"allOf": [ref("ResultRecord"), obj({"payload": obj(
                  description="the row as posted (rebuilt from what is stored)")})]})},
              {404: "no result row with this id"}, tag=tag),
        *_result_views(tag),
        Route("GET", "/api/system", "What the collector holds on disk", {200: json_reply(obj({
            "uptime_s": NUM, "started_at": TIME, "now": TIME, "data_dir": STR,
            "database": obj(), "tables": map_of(integer(0)), "artifacts": obj(),
            "log": null(obj()), "ci_status": obj({"armed": BOOL, "repos": null(arr(STR)),
                                                  "posting": BOOL, "problem": null(STR)}),
            "retention": obj(),
            "db": obj({"path": STR, "size_bytes": null(INT), "counts": map_of(integer(0))}),
            "ci": obj({"armed": BOOL})}))},
              tag=tag),
        guarded("POST", "/api/system/retention", "Prune old beacons, topic events, alerts",
                {200: json_reply(ref("Retention"), "a dry run, or what was deleted")},
                JSON_ERRORS,
                body=Body(obj({"apply?": BOOL,
                               "beacon_days?": {"type": "number", "minimum": 1,
                                                "maximum": 36500},
                               "event_days?": {"type": "number", "minimum": 1,
                                               "maximum": 36500},
                               "alert_days?": {"type": "number", "minimum": 1,
                                               "maximum": 36500}}, closed=True),
                          "{} or {\"apply\": false} is a dry run; the windows in days apply "
                          "to this run only", required=False),
                tag=tag),
    ]


UI_RUN = obj({"job_id": STR, "device_id": STR, "build": STR, "ok": null(BOOL),
              "passed": null(integer(0)), "failed": null(integer(0)), "at": TIME})


# A soak or vision run's device: its newest row, the metrics cut down past 2,048 characters.
RUN_ROW = obj({"device_id": STR, "rows": integer(1), "result_id": INT, "ok": null(BOOL),
               "error": null(STR), "metrics": obj(), "at": TIME,
               "trimmed": arr(enum("metrics"))},
              description="metrics past 2,048 characters of JSON keep only their first 32 "
                          "fields whose name and value fit 64 characters (numbers a double "
                          "holds, booleans, null, text, short arrays and objects); `trimmed` "
                          "then names them, and GET /api/results/{result_id} has the row whole")


def job_run(device: dict[str, Any]) -> dict[str, Any]:
    """A job of the original's per-run views, with a row per device."""
    return obj({"job_id": STR, "workload": STR, "status": JOB_STATUS, "created_at": TIME,
                "finished_at": null(TIME), "devices": arr(device), "truncated": BOOL},
               description="a run lists its first 1,000 devices in device order, an answer "
                           "10,000 across its runs; `truncated` says the run had more")


def _result_views(tag: str) -> list[Route]:
    common = (query("device", STR, "device id"), query("job", STR, "job id"))
    times = (query("from", STR, "ISO-8601 time"), query("to", STR, "ISO-8601 time"))
    bench_row = obj({"device_id": STR, "device_name": null(STR), "model": null(STR),
                     "backends": arr(STR), "mem_method": null(STR), "runs": integer(1),
                     "last_at": TIME}, additionalProperties=ANY)
    return [
        Route("GET", "/api/results/bench", "Benchmark figures per device, model, mem_method",
              {200: json_reply(obj({"workload": STR, "metrics": arr(STR), "truncated": BOOL,
                                    "rows": arr(bench_row), "configs": arr(obj({
                                        "config": STR, "model": null(STR), "quant": null(STR),
                                        "backend": null(STR), "devices": arr(obj({
                                            "device_id": STR, "runs": integer(1),
                                            "latest": obj({"job_id": STR, "at": TIME})}))}))}))},
              {400: BAD_QUERY},
              params=(*common, query("model", STR, "model name"),
                      query("workload", STR, "default benchmark"), *times), tag=tag),
        Route("GET", "/api/results/ui", "UI-test jobs with their flows",
              {200: json_reply(paged("jobs", obj({
                  "job_id": STR, "status": JOB_STATUS, "app": ANY, "last_error": null(STR),
                  "created_at": TIME, "finished_at": null(TIME), "pass": integer(0),
                  "fail": integer(0), "flows": arr(obj()), "truncated": BOOL},
                  description="a job's flows and runs are read from its newest 5,000 rows; "
                              "`truncated` says it had more"), workload=STR,
                  runs=arr(UI_RUN), devices=arr(STR), matrix=arr(obj({
                      "build": STR, "cells": arr(obj({"device": STR,
                                                      "latest": null(UI_RUN)}))}))))},
              {400: BAD_QUERY},
              params=(*common, query("workload", STR, "default ui-test"), *times,
                      query("page", integer(1, 1_000_000), "page number")), tag=tag),
        Route("GET", "/api/results/drain", "Battery drain per hour from beacons",
              {200: json_reply(obj({"metric": enum("drain_pct_per_h"), "hours": INT,
                                    "from": TIME, "to": TIME, "max_gap_s": NUM,
                                    "devices": arr(obj({"device_id": STR,
                                                        "drain_pct_per_h": null(NUM),
                                                        "series": arr(obj())}),
                                                   maxItems=200),
                                    "devices_total": integer(0), "cut": BOOL,
                                    "runs": arr(job_run(obj({
                                        "device_id": STR, "pct_per_h": null(NUM),
                                        "pct_per_h_inferred": BOOL})))}))},
              {400: BAD_QUERY},
              params=(*common, query("hours", integer(1, 168), "window, default 24")), tag=tag),
        Route("GET", "/api/results/soak", "Memory and errors over a soak",
              {200: json_reply(obj({"workloads": arr(STR), "truncated": BOOL,
                                    "series": arr(obj({"device_id": STR, "mem_method": null(STR),
                                                       "points": arr(obj())})),
                                    "runs": arr(job_run(RUN_ROW))}))},
              {400: BAD_QUERY},
              params=(*common, query("workload", enum("app-soak", "soak"), "default both"),
                      *times, query("limit", integer(1, 10_000), "points, default 2000")),
              tag=tag),
        Route("GET", "/api/results/vision", "Vision jobs with each device's newest row",
              {200: json_reply(obj({"workload": enum("vision"), "runs": arr(job_run(
                  RUN_ROW))}))}, {400: BAD_QUERY},
              params=(query("limit", integer(1, 200), "jobs, default 50"),), tag=tag),
    ]


def _artifacts() -> list[Route]:
    tag = "artifacts"
    headers = {"ETag": STR, "Cache-Control": STR, "Accept-Ranges": STR}
    return [
        Route("POST", "/artifacts", "Upload bytes (streamed, hashed, stored by SHA-256)",
              {201: json_reply(obj({"sha256": HEX64, "size": integer(0), "existed": BOOL,
                                    "artifact": ref("Artifact")}),
                               "stored, now or before (`existed` says which)")},
              {400: "a header is malformed, the body hashes otherwise than x-artifact-sha256, "
                    "or the upload was cut off",
               413: "larger than FLEET_MAX_ARTIFACT_BYTES",
               417: "an Expect header other than 100-continue",
               503: STORAGE, 507: "the disk is full"},
              params=tuple(header(h, string(maxLength=200), what) for h, what in (
                  ("x-artifact-name", "display name"), ("x-artifact-app", "publishes a build "
                                                                          "of this app"),
                  ("x-artifact-build", "build label"), ("x-artifact-platform", "platform"),
                  ("x-artifact-sha256", "the hash the sender expects"))),
              body=Body({"type": "string", "format": "binary"}, "the raw bytes",
                        media="application/octet-stream"), tag=tag),
        Route("GET", "/artifacts/{sha256}", "Download bytes (Range, If-None-Match)", {
            200: Reply("the bytes", {"application/octet-stream": {"type": "string",
                                                                  "format": "binary"}}, headers),
            206: Reply("the requested range", {"application/octet-stream": {
                "type": "string", "format": "binary"}}, {**headers, "Content-Range": STR}),
            304: empty_reply("the client holds these bytes already")},
              {400: "not a SHA-256", 404: "no such artifact",
               416: "the range lies outside the artifact"},
              params=(header("Range", STR, "bytes=a-b, bytes=a-, bytes=-n"),
                      query("filename", STR, "a name for Content-Disposition: attachment "
                                             "(letters, digits, . - _ kept)"),
                      header("If-None-Match", STR, "an ETag list"),
                      header("If-Range", STR, "an ETag")), tag=tag),
        Route("HEAD", "/artifacts/{sha256}", "The headers of a download, without the bytes", {
            200: Reply("the artifact exists", None, headers),
            206: Reply("the range is satisfiable"), 304: empty_reply("not modified")},
              {400: "not a SHA-256", 404: "no such artifact", 416: "range not satisfiable"},
              params=(header("Range", STR, "a byte range"),), tag=tag),
        Route("GET", "/api/artifacts", "List artifacts, newest first",
              {200: json_reply(paged("artifacts", {"allOf": [ref("Artifact"), obj({
                  "on_disk": BOOL, "references": integer(0)})]}, bytes=integer(0)))},
              {400: BAD_QUERY},
              params=(query("app", STR, "exact app"), query("platform", STR, "exact platform"),
                      query("name", STR, "substring of the name"),
                      query("pinned", enum("true", "false", "1", "0", "yes", "no"), "pinned"),
                      query("baseline", enum("true", "false", "1", "0", "yes", "no"),
                            "accepted baseline"),
                      query("page", integer(1, 1_000_000), "page number")), tag=tag),
        Route("GET", "/api/artifacts/gc-candidates", "Unreferenced, unpinned artifacts",
              {200: json_reply(paged("artifacts", ref("Artifact"), bytes=integer(0),
                                     candidates=arr(ref("Artifact")), count=integer(0)))},
              {400: BAD_QUERY, 503: STORAGE},
              params=(query("page", integer(1, 1_000_000), "page number"),), tag=tag),
        Route("GET", "/api/artifacts/{sha256}", "One artifact with what holds it",
              {200: json_reply({"allOf": [ref("Artifact"), obj({
                  "stored": BOOL, "deletable": BOOL, "holds": arr(STR),
                  "referenced_by": obj({"jobs": arr(obj()), "schedules": arr(STR)}),
                  "produced_by": arr(obj())})]})},
              {400: "not a SHA-256", 404: "no such artifact", 503: STORAGE}, tag=tag),
        guarded("DELETE", "/api/artifacts/{sha256}", "Delete an unheld artifact",
                {200: json_reply(obj({"ok": OK_TRUE, "sha256": HEX64, "deleted": enum(True),
                                      "size": integer(0)}))},
                {400: "not a SHA-256", 404: "no such artifact",
                 409: "it is held (pinned, a baseline, or referenced); the sentence says which",
                 503: STORAGE}, tag=tag),
        guarded("POST", "/api/artifacts/{sha256}/pin", "Pin an artifact with a reason",
                {200: json_reply(ref("Artifact"))},
                {**JSON_ERRORS, 404: "no such artifact"},
                body=Body({"oneOf": [
                    obj({"reason": string(minLength=1, maxLength=500), "pinned?": enum(True)}),
                    obj({"pinned": enum(False)})]},
                    "why it is kept; the original's {\"pinned\": false} unpins"),
                tag=tag),
        guarded("DELETE", "/api/artifacts/{sha256}/pin", "Unpin an artifact",
                {200: json_reply(ref("Artifact"))},
                {400: "not a SHA-256", 404: "no such artifact", 503: STORAGE},
                tag=tag),
        guarded("POST", "/api/artifacts/{sha256}/baseline", "Accept or drop a visual baseline",
                {200: json_reply(ref("Artifact"))},
                {**JSON_ERRORS, 404: "no such artifact"},
                body=Body(obj({"accepted": BOOL}), "true accepts, false drops"), tag=tag),
    ]


def _templates(tag: str) -> list[Route]:
    no_template = "no job template with that id"
    body = obj({"id": SCHEDULE_ID, "name?": null(STR), "spec": obj()}, closed=True)
    return [
        Route("GET", "/api/templates", "Job templates, ordered by id",
              {200: json_reply(obj({"templates": arr(ref("JobTemplate"))}))}, tag=tag),
        guarded("POST", "/api/templates", "Save a job template (create, or replace by id)",
                {201: json_reply(ref("JobTemplateOk"), "created"),
                 200: json_reply(ref("JobTemplateOk"), "replaced")}, JSON_ERRORS,
                body=Body(body, "an id, a name and a job spec without job_id"), tag=tag),
        Route("GET", "/api/templates/{id}", "One job template",
              {200: json_reply(ref("JobTemplate"))}, {404: no_template}, tag=tag),
        guarded("PATCH", "/api/templates/{id}", "Change a template's name or spec",
                {200: json_reply(ref("JobTemplate"))}, {**JSON_ERRORS, 404: no_template},
                body=Body(obj({"name?": null(STR), "spec?": obj()}, closed=True,
                              minProperties=1), "fields to change"), tag=tag),
        guarded("DELETE", "/api/templates/{id}", "Delete a job template (its jobs stay)",
                {200: json_reply(obj({"ok": OK_TRUE, "id": STR, "deleted": enum(True)}))},
                {404: no_template, 503: STORAGE}, tag=tag),
        guarded("POST", "/api/templates/{id}/enqueue", "Enqueue a job from a template",
                {201: json_reply(obj({"ok": OK_TRUE, "template_id": STR, "job_id": STR,
                                      "status": JOB_STATUS}))},
                {**JSON_ERRORS, 404: no_template, 409: "the job id exists",
                 422: "no agent declares the workload", 503: STORAGE},
                body=Body(obj({"job_id?": STR}, closed=True),
                          "optional: the job id (default <id>-<YYYYMMDDHHMMSS>)",
                          required=False), tag=tag),
    ]


def _visual() -> list[Route]:
    tag = "visual"
    name = string(minLength=1, maxLength=200)
    baseline = obj({"suite": STR, "page": STR, "profile": STR, "sha256": HEX64,
                    "accepted_at": TIME, "accepted_from_job": null(STR)})
    history = obj({"job_id": STR, "created_at": null(TIME), "sha256": null(STR),
                   "ok": null(BOOL), "diff_pct": null(NUM)})
    cell = obj({"page": STR, "profile": STR,
                "status": enum("missing", "new", "pass", "diverged", "error", "pending"),
                "ok": null(BOOL), "diff_pct": null(NUM), "note": null(STR),
                "sha256": null(STR), "diff_sha256": null(STR), "baseline_sha256": null(HEX64),
                "history": arr(history)})
    run = obj({"job_id": STR, "status": JOB_STATUS, "created_at": null(TIME)})
    return [
        Route("GET", "/api/visual/suites", "Suites with baselines or recent screenshots",
              {200: json_reply(obj({"suites": arr(STR), "truncated": BOOL}, description=(
                  "read from the newest 200 screenshot jobs, 5,000 rows of each and 50,000 of "
                  "them all; `truncated` says some rows were left unread")))}, {}, tag=tag),
        Route("GET", "/api/visual/matrix", "A suite's latest run, page x profile, judged",
              {200: json_reply(obj({"suite": STR, "threshold_pct": NUM, "latest": null(run),
                                    "runs": arr(run), "pages": arr(STR),
                                    "profiles": arr(STR), "cells": arr(cell),
                                    "truncated": BOOL}))},
              {400: BAD_QUERY},
              params=(query("suite", name, "the suite (required)"),
                      query("runs", integer(1, 25), "runs to read, history included (10)"),
                      query("threshold", NUM, "percent of pixels that may differ (0.1)")),
              tag=tag),
        Route("GET", "/api/visual/baselines", "The baselines' pointers",
              {200: json_reply(obj({"baselines": arr(baseline)}))}, {},
              params=(query("suite", STR, "only this suite"),), tag=tag),
        guarded("POST", "/api/visual/baselines/accept", "Accept a capture as its slot's baseline",
                {201: json_reply({"allOf": [baseline, obj({"ok": OK_TRUE,
                                                           "replaced": null(HEX64)})]})},
                {**JSON_ERRORS, 404: "no artifact with that hash is stored"},
                body=Body(obj({"suite": name, "page": name, "profile": name, "sha256": HEX64,
                               "job_id?": null(name)}, closed=True),
                          "the slot and the capture"), tag=tag),
    ]


def _automation() -> list[Route]:
    tag = "automation"
    no_schedule = "no schedule with that id"
    return [
        guarded("POST", "/api/schedules", "Create a schedule (disabled unless enabled is true)",
                {201: json_reply(ref("Schedule"))},
                {**JSON_ERRORS, 409: "the id exists, or the collector holds the most "
                 "schedules it keeps (1,000)"},
                body=Body(obj({"id": SCHEDULE_ID, "cron": STR, "template": obj(),
                               "enabled?": BOOL}, closed=True),
                          "a cron expression and a job spec without job_id"), tag=tag),
        guarded("POST", "/schedules", "Create or replace a schedule (the original's route)",
                {201: json_reply(ref("ScheduleOk"), "created"),
                 200: json_reply(ref("ScheduleOk"), "replaced")},
                {**JSON_ERRORS, 409: "a new id while the collector holds the most schedules "
                 "it keeps (1,000)"},
                body=Body(obj({"id": SCHEDULE_ID, "cron": STR, "template": obj(),
                               "enabled?": BOOL}, closed=True),
                          "a cron expression and a job spec without job_id"), tag=tag),
        Route("GET", "/schedules", "Schedules as a bare array (the original's route)",
              {200: json_reply(arr(ref("Schedule")))}, tag=tag),
        guarded("PATCH", "/schedules/{id}", "Change cron, enabled or template (the original's "
                "route)", {200: json_reply(ref("ScheduleOk"))},
                {**JSON_ERRORS, 404: no_schedule},
                body=Body(obj({"cron?": STR, "enabled?": BOOL, "template?": obj()}, closed=True,
                              minProperties=1), "fields to change"), tag=tag),
        guarded("DELETE", "/schedules/{id}", "Delete a schedule (the original's route)",
                {200: json_reply(obj({"ok": OK_TRUE, "id": STR, "deleted": enum(True)}))},
                {404: no_schedule, 503: STORAGE}, tag=tag),
        Route("GET", "/api/schedules", "List schedules",
              {200: json_reply(obj({"schedules": arr(ref("Schedule"))}))}, tag=tag),
        Route("GET", "/api/schedules/{id}", "One schedule", {200: json_reply(ref("Schedule"))},
              {404: no_schedule}, tag=tag),
        guarded("PATCH", "/api/schedules/{id}", "Change cron, enabled or template",
                {200: json_reply(ref("Schedule"))},
                {**JSON_ERRORS, 404: no_schedule},
                body=Body(obj({"cron?": STR, "enabled?": BOOL, "template?": obj()}, closed=True,
                              minProperties=1), "fields to change"), tag=tag),
        guarded("DELETE", "/api/schedules/{id}", "Delete a schedule and its run records",
                {200: json_reply(obj({"ok": OK_TRUE, "id": STR, "deleted": enum(True)}))},
                {404: no_schedule, 503: STORAGE}, tag=tag),
        guarded("POST", "/api/schedules/{id}/run", "Enqueue one run now", {
              201: json_reply(obj({"ok": OK_TRUE, "schedule_id": STR, "outcome": enum("enqueued"),
                                   "job_id": STR, "status": JOB_STATUS})),
              200: json_reply(obj({"ok": OK_TRUE, "schedule_id": STR, "outcome": enum("skipped"),
                                   "job_id": {"type": "null"}, "reason": STR}),
                              "skipped: no published build for `latest`")},
                {400: "the job is refused (the sentence says why)",
                 404: no_schedule, 409: "run twice in the same second, or the job id exists",
                 422: "no agent declares the workload", 503: STORAGE}, tag=tag),
        Route("GET", "/api/schedules/{id}/history", "Runs and jobs of a schedule",
              {200: json_reply(obj({"schedule_id": STR, "runs": arr(obj({
                  "slot": STR, "due": null(TIME), "at": TIME, "outcome": STR,
                  "job_id": null(STR), "job_status": null(JOB_STATUS), "detail": null(STR)})),
                  "jobs": arr(obj())}))},
              {400: BAD_QUERY, 404: no_schedule},
              params=(query("limit", integer(1, 500), "default 50"),), tag=tag),
        Route("POST", "/schedules/tick", "Fire due schedules now",
              {200: json_reply(ref("TickReport"))}, {503: STORAGE}, tag=tag),
        *_templates(tag),
        Route("GET", "/api/alerts", "Alerts: open, then newest",
              {200: json_reply(obj({"alerts": arr(ref("Alert")), "webhook": BOOL,
                                    "thresholds": obj({"scheduleLateS": NUM})}))},
              {400: BAD_QUERY},
              params=(query("state", STR, "open, resolved or all; or a comma-separated list of "
                            "open, acked, snoozed, resolved (the original's statuses)"),
                      query("rule", STR, "rule name"),
                      query("limit", integer(1, 1000), "default 200")), tag=tag),
        Route("POST", "/api/alerts/tick", "Evaluate the alert rules now",
              {200: json_reply(obj({"ok": OK_TRUE, "opened": arr(INT), "resolved": arr(INT),
                                    "open": integer(0)}))}, {503: STORAGE}, tag=tag),
        guarded("POST", "/api/alerts/{alert_id}/ack", "Acknowledge an alert",
                {200: json_reply(ref("Alert"))},
                {404: "no such alert", 503: STORAGE}, tag=tag),
        guarded("POST", "/api/alerts/{alert_id}/snooze", "Snooze an open alert",
                {200: json_reply(ref("Alert"))},
                {**JSON_ERRORS, 404: "no such alert",
                 409: "the alert is resolved"},
                body=Body({"oneOf": [obj({"duration_s": {"type": "number", "minimum": 0,
                                                         "maximum": 2_592_000}}, closed=True),
                                     obj({"minutes": {"type": "number", "minimum": 0,
                                                      "maximum": 43_200}}, closed=True)]},
                          "how long; 0 lifts the snooze"), tag=tag),
    ]


def _topics() -> list[Route]:
    tag = "topics"
    published = {201: json_reply(obj({"ok": OK_TRUE, "topic": STR, "seq": INT, "id": INT,
                                      "at": TIME}))}
    errors = {400: "the topic name or source is malformed, or the body is not JSON",
              413: "the payload is over 64 KiB", 503: STORAGE}
    source = query("source", string(maxLength=200), "the device or job publishing")
    body = Body(ANY, "any JSON value: the payload")
    topic_view = obj({"topic": STR, "count": integer(0), "last_seq": null(INT),
                      "last_at": null(TIME)})
    return [
        Route("GET", "/api/events", "Topics with counts and recent payloads",
              {200: json_reply(obj({"topics": arr({"allOf": [topic_view, obj({
                  "recent": arr(ref("TopicEvent"))})]})}))}, tag=tag),
        Route("POST", "/api/events/{topic}", "Publish to a topic", published, errors,
              params=(source,), body=body, tag=tag),
        Route("POST", "/events/{topic}", "Publish to a topic (agents)", published, errors,
              params=(source,), body=body, tag=tag),
        Route("GET", "/api/events/{topic}", "Newest events of a topic",
              {200: json_reply({"allOf": [topic_view, obj({
                  "events": arr(ref("TopicEvent"))})]})}, {400: BAD_QUERY},
              params=(query("limit", integer(1, 500), "default 50"),
                      query("before", integer(1, 2**62), "a seq: page back")), tag=tag),
        Route("GET", "/api/events/{topic}/next", "Long-poll for events after a cursor", {
            200: json_reply(obj({"topic": STR, "events": arr(ref("TopicEvent")),
                                 "cursor": INT})),
            204: empty_reply("nothing arrived within wait_s")}, {400: BAD_QUERY},
              params=(query("after", integer(0, 2**62), "cursor, default 0"),
                      query("wait_s", {"type": "number", "minimum": 0, "maximum": 25},
                            "seconds to wait, default the long-poll hold"),
                      query("limit", integer(1, 500), "default 100")), tag=tag),
        Route("GET", "/events/{topic}/poll", "The next event after a cursor (the original's)", {
            200: json_reply({"allOf": [ref("TopicEvent"), obj({"topic": STR, "id": INT})]}),
            204: empty_reply("nothing arrived within wait_s")}, {400: BAD_QUERY},
              params=(query("after", integer(0, 2**62), "the id of the last event read"),
                      query("wait_s", {"type": "number", "minimum": 0, "maximum": 25},
                            "seconds to wait, default the long-poll hold")), tag=tag),
    ]


def _access() -> list[Route]:
    tag = "access"
    peer = obj({"id": null(STR), "name": null(STR), "url": STR, "reachable": BOOL,
                "last_checked": null(TIME), "latency_ms": null(NUM), "instance": null(STR),
                "error": null(STR),
                "claimed": {**null(STR), "description": "the id its latest answer names, when "
                            "that is not the pinned one (POST /api/peers/forget accepts it)"}})
    return [
        Route("GET", "/api/peers", "Other collectors", {200: json_reply(obj({"peers": arr(peer)}))},
              params=(query("refresh", STR, "1, true or yes checks every peer first"),),
              tag=tag),
        guarded("POST", "/api/peers/forget",
                "Forget the id a peer's address is pinned to (a peer replaced on purpose)",
                {200: json_reply(obj({"ok": OK_TRUE, "forgotten": null(STR), "peer": peer}))},
                {**JSON_ERRORS, 404: "the address is not one of FLEET_PEERS"},
                body=Body(obj({"url": STR}, closed=True),
                          "the peer's address as FLEET_PEERS lists it (host:port or "
                          "http(s)://host:port); it is checked at once and pinned to the id it "
                          "names now"),
                tag=tag),
        *[Route(method, "/api/peers/{peer_id}/{tail}", summary, replies, errors, tag=tag)
          for method, summary, replies, errors in (
              ("GET", "Read an allow-listed path from a peer (read-only proxy)",
               {200: json_reply(ANY, "the peer's answer")},
               {403: "the path is not one the proxy reads",
                404: "no peer with that id, or the peer's own 404",
                502: "the peer is unreachable or silent, answered something not JSON (or "
                     "nested past 64 levels, or over 8 MiB) or a status outside 2xx, 4xx and "
                     "5xx; or its id is in doubt (it now names another, or two peers name it)"}),
              *[(m, "Refused: the proxy never forwards a change", {},
                 {403: "the peer proxy only reads",
                  404: "the path matches no route at all (a line break in it)"})
                for m in ("POST", "PUT", "PATCH", "DELETE")])],
    ]


def _enrolment() -> list[Route]:
    tag = "enrolment"
    base = obj({"url": STR, "address": STR, "kind": enum("lan", "mesh", "name", "loopback",
                                                          "other"),
                "via": STR, "command": STR})
    build = obj({"sha256": STR, "name": null(STR), "app": STR, "build": null(STR),
                 "platform": null(STR), "size": integer(0), "created_at": TIME,
                 "filename": STR, "download": STR})
    return [
        Route("GET", "/api/enroll", "What adding a device needs: addresses, devices, builds",
              {200: json_reply(obj({"port": INT, "hostname": STR, "bases": arr(base),
                                    "agent": obj({"path": STR, "options": STR}),
                                    "runner_app": STR, "runner_apk": null(build),
                                    "known_device_ids": arr(STR, maxItems=1000),
                                    "known_devices": integer(0), "now": TIME,
                                    "pools": arr(STR, maxItems=500), "pools_truncated": BOOL,
                                    "device_id_taken?": BOOL}))},
              {400: BAD_QUERY},
              params=(query("app", STR, "the runner's app name (default "
                            "fleet-runner-android)"),
                      query("device_id", STR, "answer device_id_taken: is a device registered "
                            "under this id")), tag=tag),
        Route("GET", "/api/enroll/qr", "A QR code as SVG (black on white, quiet zone)",
              {200: text_reply("SVG", "image/svg+xml")}, {400: "no text, or over 512 characters"},
              params=(query("text", STR, "what the code says", required=True),), tag=tag),
        Route("GET", "/agent/fleet_agent.py", "The agent, to copy onto a device",
              {200: text_reply("the agent's source", "text/x-python"),
               304: empty_reply("not modified")}, tag=tag),
    ]


def _pages() -> list[Route]:
    tag = "pages"
    page = {200: html_reply("the page"), 304: empty_reply("the client's copy is current")}
    legacy = {200: html_reply("the page")}
    missing = html_reply("an HTML page saying what was not found")
    return [
        Route("GET", "/", "Redirect to the dashboard", {302: empty_reply("to /dash")}, tag=tag),
        Route("GET", "/favicon.svg", "The icon", {200: text_reply("SVG", "image/svg+xml"),
                                                   304: empty_reply("not modified")}, tag=tag),
        Route("GET", "/dash", "The dashboard application", page, tag=tag),
        Route("GET", "/dash/{tail}", "Dashboard deep links (the same application)", page,
              tag=tag),
        Route("GET", "/runner", "The browser runner page", page, tag=tag),
        Route("GET", "/static/{build}/{path}", "Page assets (immutable under the build digest)",
              {200: binary_reply("the file (JavaScript, CSS, SVG, ...)", "*/*"),
               304: empty_reply("not modified")}, {404: "no such file"}, tag=tag),
        Route("GET", "/dash/legacy", "Legacy overview page", legacy, tag=tag),
        Route("GET", "/dash/legacy/", "Legacy overview page", legacy, tag=tag),
        Route("GET", "/dash/legacy/style.css", "Legacy style sheet",
              {200: text_reply("CSS", "text/css"), 304: empty_reply("not modified")}, tag=tag),
        Route("GET", "/dash/legacy/devices", "Legacy devices page", legacy, tag=tag),
        Route("GET", "/dash/legacy/devices/{device_id}", "Legacy device page",
              {**legacy, 404: missing}, tag=tag),
        Route("GET", "/dash/legacy/jobs", "Legacy jobs page", {**legacy, 400: html_reply(
            "a filter is malformed")}, params=(
            query("status", STR, "comma-separated statuses"), query("q", STR, "text"),
            query("page", integer(1, 1_000_000), "page number")), tag=tag),
        Route("GET", "/dash/legacy/jobs/{job_id}", "Legacy job page", {**legacy, 404: missing},
              tag=tag),
        Route("GET", "/dash/legacy/results", "Legacy results page", legacy, tag=tag),
        Route("GET", "/dash/legacy/bench", "Legacy benchmark page (by configuration)", legacy,
              tag=tag),
        Route("GET", "/dash/legacy/schedules", "Legacy schedules page", legacy, tag=tag),
        Route("GET", "/dash/legacy/alerts", "Legacy alerts page", legacy, tag=tag),
        Route("GET", "/dash/legacy/artifacts", "Legacy artifacts page",
              {**legacy, 400: html_reply("page is malformed")},
              params=(query("page", integer(1, 1_000_000), "page number"),), tag=tag),
        Route("GET", "/dash/legacy/{tail}", "Any other legacy path", {404: missing}, tag=tag),
        Route("GET", "/openapi.json", "This document", {200: json_reply(obj(
            {"openapi": STR, "paths": obj()}))}, tag=tag),
    ]


def service() -> Service:
    return Service(
        title="fleet_min collector",
        version="1",
        description=(
            "Job queue, device registry, result store, artifact store, scheduler and alerts for "
            "a shelf of devices. No authentication by design: the network is the access "
            "control; FLEET_DASH_TOKEN (header X-Fleet-Token), when set, guards dashboard "
            "changes. Errors are {\"error\": \"<sentence>\"}. Times are UTC ISO-8601 with Z. "
            "JSON bodies are limited to FLEET_MAX_JSON_BYTES (1 MiB): 413 above it. Only names "
            "it knows are answered (421 otherwise; FLEET_ALLOWED_HOSTS); changes from another "
            "site's page are 403 and text/plain, form or untyped bodies 415 (docs/security.md). "
            "Spec: shared/spec/collector-api.md; choices: docs/collector*.md."),
        path_params=PATH_PARAMS,
        schemas=_components(),
        security_schemes={"dashToken": {
            "type": "apiKey", "in": "header", "name": "X-Fleet-Token",
            "description": "Needed only when the collector runs with FLEET_DASH_TOKEN set."}},
        routes=[*_agents(), *_jobs(), *_devices(), *_reads(), *_artifacts(), *_visual(),
                *_automation(), *_topics(), *_access(), *_enrolment(), *_pages()],
        tags=[("agents", "what the agent calls"), ("jobs", "the queue"),
              ("devices", "the registry"), ("reads", "listings, views, health, stream"),
              ("artifacts", "the content-addressed store"),
              ("visual", "visual review: screenshots against baselines"),
              ("automation", "schedules and alerts"), ("topics", "pipeline topics"),
              ("access", "peers"), ("pages", "HTML pages and their files")],
        fallbacks=[{"path": "/api/{tail}", "methods": ["*"], "status": 404,
                    "description": "any other /api/... path: 404 {\"error\"}"}],
    )

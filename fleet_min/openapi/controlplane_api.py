"""The control plane's HTTP API, route by route, for its OpenAPI document
(fleet_min/openapi/controlplane.json).

Sources: shared/spec/control-plane-api.md, shared/spec/decisions.md and docs/controlplane.md for
the shapes; controlplane/app.py ROUTES for the routes, their auth and their statuses.
tests/contract/test_routes_documented.py fails when this table and the router disagree.
"""

from __future__ import annotations

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
    Route,
    Schema,
    Service,
    arr,
    binary_reply,
    enum,
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

RUNNER_NAME = string(minLength=1, maxLength=200)
HOST_NAME = string(pattern="^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")

BAD_JSON = "the body is not valid JSON, has the wrong types, or breaks a rule (the sentence says)"
TOO_LARGE = "the JSON body is larger than FLEET_MAX_JSON_BYTES (1 MiB by default)"
NO_TOKEN = "the Authorization: Bearer <token> header is missing"  # noqa: S105 - a sentence
REFUSED = ("the token is wrong, the request is cross-origin (Origin or Sec-Fetch-Site), or the "
           "daemon runs read-only (\"this daemon is running read-only\")")
NO_RUNNER = "no runner of that name on this host"
BAD_NAME = "name is missing or not a valid runner name"
AUTH_ERRORS = {401: NO_TOKEN, 403: REFUSED}

PATH_PARAMS = {
    "path": Param("path", string(minLength=1), "a file under web/controlplane", "path"),
}

PROC = null(obj({"pid": INT, "rss_kb": null(INT), "uptime_s": INT}))

# A runner of this host carries every field; one an agent reports (remote: true) the first
# line's, plus host, remote and stale, each null when the agent left it out.
RUNNER = obj({
    "name": STR, "repo": null(STR), "owner?": null(STR), "labels?": null(arr(STR)),
    "state": null(STR), "busy": null(BOOL), "draining": null(BOOL), "version?": null(STR),
    "registration": null(STR),
    "host?": null(STR), "remote?": BOOL, "stale?": BOOL,
    "dir?": STR, "url?": null(STR), "custom_labels?": null(arr(STR)),
    "staged_versions?": arr(STR), "draining_since?": null(STR), "service?": obj(),
    "listener?": PROC, "workers?": arr(PROC),
    "registered?": null(obj({"id": ANY, "status": ANY, "busy": ANY}))})
REPO = string(pattern="^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")

SNAPSHOT = obj({
    "generated_at": TIME,
    "host": obj({"name": STR, "platform": STR, "supervisor": STR, "root": STR,
                 "read_only": BOOL}),
    "runners": arr(ref("Runner")), "active_runs": arr(obj({"jobs": arr(obj())})),
    "groups": arr(obj({"key": STR, "by": STR, "runners": arr(STR),
                       "members": arr(obj({"name": STR, "host": STR})), "total": INT,
                       "busy": INT, "draining": INT})),
    "vitals": obj(), "capacity": ref("Capacity"), "drift": arr(obj()),
    "queue_causes": arr(obj()), "alerts": arr(obj({"severity": STR, "message": STR})),
    "github": obj()})

CAPACITY = obj({
    "ceiling": INT, "runners": INT, "busy": INT, "idle": INT, "headroom": integer(0),
    "busy_headroom": integer(0), "per_repo": map_of(INT), "limits": obj(), "can_add": BOOL,
    "reasons": arr(STR)})

ACTION_REPLY = obj({"ok": BOOL, "action": STR, "code": null(INT), "output": STR,
                    "durationMs": integer(0), "command": null(STR), "error?": STR,
                    "runner?": ANY, "queued?": BOOL, "host?": STR, "command_id?": STR,
                    "seq?": integer(1)},
                   description="queued: true when forwarded to the agent host that has the "
                               "runner; its result then follows in GET /api/hosts commands")

SETTING = obj({"key": STR, "type": STR, "default": ANY, "env": STR, "help": STR, "value": ANY,
               "source": enum("stored", "env", "default"), "choices?": arr(STR),
               "min?": null(NUM), "max?": null(NUM)})


def _components() -> dict[str, Schema]:
    return {
        "Error": obj({"error": string(minLength=1)},
                     description='Every refusal: {"error": "<sentence>"}; a refused action '
                                 'also carries "ok": false.'),
        "Snapshot": SNAPSHOT,
        "Runner": RUNNER,
        "Capacity": CAPACITY,
        "ActionReply": ACTION_REPLY,
        "Setting": SETTING,
    }


def _reads() -> list[Route]:
    tag = "reads"
    name = query("name", RUNNER_NAME, "runner name", required=True)
    return [
        Route("GET", "/api/state", "The snapshot: runners, runs, groups, vitals, capacity, drift",
              {200: json_reply(ref("Snapshot"))}, tag=tag),
        Route("GET", "/api/stream", "The snapshot as server-sent events, one per tick",
              {200: sse_reply("data: <snapshot> events, no event names; : keep-alive "
                              "comments between them", ref("Snapshot"))}, tag=tag),
        Route("GET", "/metrics", "Metrics in the Prometheus text format (version 0.0.4)",
              {200: text_reply("runners by state, queued jobs and their wait by label set, "
                               "GitHub requests and rate limit, agent hosts' heartbeat age, "
                               "process figures (docs/metrics.md)", metrics.CONTENT_TYPE)},
              tag=tag),
        Route("GET", "/api/runner", "Runner detail: events, jobs, utilization, redacted log tail",
              {200: json_reply(obj({"runner": ref("Runner"), "events": arr(obj()),
                                    "jobs": arr(obj()),
                                    "utilization": obj({"busy_24h_pct": NUM, "busy_7d_pct": NUM,
                                                        "busy_now": BOOL}),
                                    "diag": obj(), "version": obj({"active": null(STR),
                                                                   "staged": arr(STR)})}))},
              {400: BAD_NAME, 404: NO_RUNNER}, params=(name,), tag=tag),
        Route("GET", "/api/queue-causes", "Why each queued run waits",
              {200: json_reply(obj({"generated_at": null(TIME), "queue_causes": arr(obj())}))},
              tag=tag),
        Route("GET", "/api/actions", "The action catalogue", {200: json_reply(obj({
            "read_only": BOOL, "actions": arr(obj({"id": STR, "label": STR, "runner": BOOL,
                                                   "description": STR, "args": obj()}))}))},
              tag=tag),
        Route("GET", "/api/settings", "Live settings with value, default, range and source",
              {200: json_reply(obj({"settings": arr(ref("Setting"))}))}, tag=tag),
        Route("GET", "/api/hosts", "This host and every agent host that sent a heartbeat",
              {200: json_reply(obj({"generated_at?": TIME, "hosts": arr(obj({
                  "host": STR, "role": enum("coordinator", "agent"), "runners": ANY,
                  "capacity": ANY, "load": ANY, "heartbeat_age_s": NUM,
                  "dropped_runners?": integer(0), "unwatched_repos?": arr(STR)}))}))},
              tag=tag),
        *_analysis(),
    ]


def _analysis() -> list[Route]:
    """Figures from the recorded job history (docs/controlplane-analysis.md)."""
    tag = "analysis"
    stamped = {"generated_at": TIME}
    return [
        Route("GET", "/api/analytics", "Per-repository job figures and browser-test timings",
              {200: json_reply(obj({**stamped, "days": INT, "since": TIME, "until": TIME,
                                    "repos": arr(obj({"repo": STR, "jobs": integer(0)})),
                                    "browser_test": obj(), "history": arr(obj())}))},
              {400: "days is not a whole number from 1 to 365"},
              params=(query("days", integer(1, 365), "look-back in days, default 30",
                            allow_empty=False),), tag=tag),
        Route("GET", "/api/repo", "30 days of one repository",
              {200: json_reply(obj({**stamped, "repo": STR, "days": INT, "since": TIME,
                                    "jobs": integer(0), "runners": arr(obj()),
                                    "registered": null(arr(obj())), "history": obj()}))},
              {400: "name is not owner/project",
               404: "no recorded jobs and not a watched repository"},
              params=(query("name", REPO, "owner/project", required=True),), tag=tag),
        Route("GET", "/api/concurrency", "Concurrency findings in the workflow files",
              {200: json_reply(obj({**stamped, "repos": arr(obj({"repo": STR})),
                                    "findings": arr(obj({"kind": STR, "severity": STR,
                                                         "repo": STR}))}))}, tag=tag),
        Route("POST", "/api/simulate", "Replay a repository's jobs against runner counts",
              {200: json_reply(obj({**stamped, "repo": STR, "days": INT, "since": TIME,
                                    "results": arr(obj({"runners": integer(0)}))}))},
              {400: BAD_JSON, 403: "a cross-origin request (Origin or Sec-Fetch-Site)",
               404: "no recorded jobs of the repository in the window", 413: TOO_LARGE},
              body=Body(obj({"repo": REPO, "runnerCounts": arr(integer(0, 256), minItems=1,
                                                               maxItems=16),
                             "sloSec": integer(0, 604_800), "days?": integer(1, 365)}),
                        "{repo, runnerCounts, sloSec, days?}"), tag=tag),
        Route("GET", "/api/forecast", "Next-hour demand per repository, and past scores",
              {200: json_reply(obj({**stamped, "hour_start": TIME, "hour_end": TIME,
                                    "repos": arr(obj({"repo": STR})),
                                    "scores": arr(obj())}))}, tag=tag),
        Route("GET", "/api/autoscale", "Autoscale decisions, newest first",
              {200: json_reply(obj({**stamped, "enabled": BOOL, "mode": STR,
                                    "evaluated_at": null(TIME),
                                    "decisions": arr(obj({"repo": STR, "direction": STR,
                                                          "outcome": STR}))}))}, tag=tag),
        Route("GET", "/api/admission", "Job admission decisions of the job-started hook",
              {200: json_reply(obj({**stamped, "totals": map_of(integer(0)),
                                    "decisions": arr(obj({"decision": STR}))}))},
              {400: "limit is not a whole number from 1 to 500"},
              params=(query("limit", integer(1, 500), "newest decisions, default 60",
                            allow_empty=False),), tag=tag),
        Route("GET", "/api/billing", "GitHub Actions billing of the watched owners",
              {200: json_reply(obj({**stamped, "available": BOOL,
                                    "owners": arr(obj({"owner": STR}))}))}, tag=tag),
    ]


def _control() -> list[Route]:
    tag = "control"
    bearer = ("controlToken",)
    return [
        Route("POST", "/api/action", "Run an action (duplicate, drain, resume, deregister, "
                                     "health check)",
              {200: json_reply(ref("ActionReply"), "ran; ok says whether its commands "
                                                   "succeeded")},
              {400: "id or args is missing or of the wrong type (the sentence names it), "
                    "or the body is not valid JSON", **AUTH_ERRORS, 404: NO_RUNNER,
               409: "refused: capacity, the per-repo limit, or a busy runner",
               413: TOO_LARGE, 503: "GitHub will not give a registration token"},
              body=Body(obj({"id": enum("runner.duplicate", "runner.drain", "runner.resume",
                                        "runner.deregister", "health.check"),
                             "args": obj()}), "{id, args}; args is {} for an action that "
                                              "takes none"),
              tag=tag, security=bearer),
        Route("POST", "/api/settings", "Change (or reset) a live setting",
              {200: json_reply(obj({"ok": enum(True), "key": STR, "value": ANY,
                                    "source": enum("stored", "env", "default")}))},
              {400: BAD_JSON, **AUTH_ERRORS, 413: TOO_LARGE},
              body=Body({"anyOf": [obj({"key": STR, "value": ANY}),
                                   obj({"key": STR, "reset": enum(True)})]},
                        "{key, value} or {key, reset: true}"), tag=tag, security=bearer),
        Route("GET", "/api/runner/bundle", "A runner's redacted diagnostic bundle",
              {200: text_reply("the bundle as a text file")},
              {400: BAD_NAME, **AUTH_ERRORS, 404: NO_RUNNER},
              params=(query("name", RUNNER_NAME, "runner name", required=True),),
              tag=tag, security=bearer),
    ]


# An agent's instance id (federation/link.py instance_id); older agents send none.
INSTANCE = null(string(pattern="^[0-9a-f]{16,64}$"))  # null: as if left out


def _agents() -> list[Route]:
    tag = "federation"
    either = ("controlToken", "agentToken")
    refused = f"{REFUSED}; or a host token naming another host"
    return [
        Route("POST", "/api/host/heartbeat", "An agent host reports its state",
              {200: json_reply(obj({"ok": enum(True), "queue": STR, "commands": arr(obj({
                  "id": STR, "seq": integer(1), "action": STR, "args": obj()})),
                  "runners_kept": integer(0), "runners_dropped": integer(0),
                  "unwatched_repos": arr(STR)}),
                  "stored; the host's queue id and its unfinished commands numbered after "
                  "`applied`, in order (held up to wait_s for one); how many of its runners "
                  "were kept (2,000 across all agent hosts) and which of their repositories "
                  "the coordinator does not watch")},
              {400: BAD_JSON, **AUTH_ERRORS, 403: refused,
               409: "the host is this coordinator's own name, a new host past the 100 agent "
                    "hosts kept, or a name another agent instance has used within "
                    "stale_after_s", 413: TOO_LARGE},
              body=Body(obj({"host": HOST_NAME, "instance?": INSTANCE, "role?": ANY,
                             "wait_s?": {"type": "number", "minimum": 0, "maximum": 3600},
                             "runners?": arr(obj({"name": HOST_NAME}), maxItems=500),
                             "capacity?": ANY, "vitals?": ANY, "load?": ANY,
                             "queue?": null(string(pattern="^[0-9a-f]{16,64}$")),
                             "applied?": integer(0, 2**53 - 1)}),
                        "the agent's state"),
              tag=tag, security=either),
        Route("POST", "/api/host/results", "An agent host reports command results",
              {200: json_reply(obj({"ok": enum(True), "received": integer(0),
                                    "matched?": integer(0)}))},
              {400: BAD_JSON, **AUTH_ERRORS, 403: refused,
               409: "the host name is in use by another agent instance", 413: TOO_LARGE},
              body=Body(obj({"host": HOST_NAME, "instance?": INSTANCE, "results": arr(obj({
                  "id": STR, "seq?": ANY, "ok?": ANY, "error?": ANY, "output?": ANY,
                  "code?": ANY, "runner?": ANY}), maxItems=200)}),
                        "{host, results: [{id, seq, ok, error, output, code, runner}]}"),
              tag=tag, security=either),
    ]


def _pages() -> list[Route]:
    tag = "pages"
    return [
        Route("GET", "/", "The control-plane UI", {200: html_reply("the page")}, tag=tag),
        Route("GET", "/public/{path}", "UI files",
              {200: binary_reply("the file (JavaScript, CSS, SVG, ...)", "*/*")},
              {404: "no such file"}, tag=tag),
        Route("GET", "/openapi.json", "This document", {200: json_reply(obj(
            {"openapi": STR, "paths": obj()}))}, tag=tag),
    ]


def service() -> Service:
    return Service(
        title="fleet_min control plane",
        version="1",
        description=(
            "Supervises the self-hosted CI runners of one host and federates hosts. Reads are "
            "open; actions, settings and the bundle need Authorization: Bearer <control token>; "
            "agent routes accept the agent token too. Cross-origin changes are refused (403), "
            "text/plain, form or untyped bodies too (415), and names the daemon does not know "
            "(421; FLEET_ALLOWED_HOSTS). Errors are {\"error\": \"<sentence>\"}. Spec: "
            "shared/spec/control-plane-api.md; choices: docs/controlplane.md."),
        path_params=PATH_PARAMS,
        schemas=_components(),
        security_schemes={
            "controlToken": {"type": "http", "scheme": "bearer",
                             "description": "<state>/control-token"},
            "agentToken": {"type": "http", "scheme": "bearer",
                           "description": "<state>/agent-token (else the control token), "
                                          "or a host token (token --agent-host NAME): "
                                          "heartbeats and results for NAME only"}},
        routes=[*_reads(), *_control(), *_agents(), *_pages()],
        tags=[("reads", "open reads"), ("analysis", "figures from the job history"),
              ("control", "token-guarded changes"),
              ("federation", "agent hosts"), ("pages", "the UI and its files")],
    )

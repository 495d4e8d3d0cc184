"""Hostile input against every route of both services (live processes): each request gets a
clear 4xx (or, for a broken connection, a bounded close) and changes nothing.

Routes come from the OpenAPI documents, so a new route is attacked as soon as it is documented
(and test_routes_documented.py makes sure it is). What is tried:

- bodies: malformed and truncated JSON, the wrong JSON types, nesting 200,000 levels deep,
  integers of 5,000 digits and 1e999, non-UTF-8 bytes, bodies over the JSON limit (declared
  and actually sent), plus a per-route corpus of wrong field types, NUL bytes, SQL
  metacharacters, path traversal, oversized values and numbers past every bound;
- path parameters: traversal (raw and percent-encoded, doubly encoded), NUL, SQL, 5,000
  characters, emoji, template references, markup; the static file routes included;
- query parameters: huge, negative and non-ASCII digits, NaN, inf, NUL, SQL, LIKE wildcards;
- regular-expression bombs in targets.match (jobs, previews, schedule templates);
- artifact uploads, request lines and header lines over their limits;
- missing and wrong tokens (X-Fleet-Token on the collector; the bearer token on the control
  plane), cross-origin requests, and no CORS grant anywhere.

After each group the collector's overview, jobs, devices, artifacts and schedules (and the
control plane's settings, runners and hosts) are compared with the snapshot taken before.
Slow-loris clients are in test_slow_clients.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.support.collector import CollectorProcess, job, registration
from tests.support.live import (
    LiveCollector,
    LiveControlPlane,
    SlowProbes,
    start_collector,
    start_controlplane,
)
from tests.support.raw_http import (
    Operation,
    Reply,
    operations,
    peek_status,
    raw_exchange,
    send,
    send_json,
    status_of,
)

MIB = 1 << 20
ARTIFACT_LIMIT = MIB
COLLECTOR_OPS = operations("collector")
CONTROLPLANE_OPS = operations("controlplane")
EVIL_ORIGIN = "http://evil.example"
LEAKS = (b"root:x:0:0", b"[build-system]", b"Traceback", b'File "/')
TOPIC = re.compile(r"[A-Za-z0-9._:-]{1,100}")


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory,
              slow_probes: SlowProbes) -> Iterator[LiveCollector]:
    # slow_probes: started here, first, so that their minute-long wait overlaps the suite.
    yield from start_collector(tmp_path_factory.mktemp("hostile-collector"),
                               FLEET_MAX_ARTIFACT_BYTES=str(ARTIFACT_LIMIT))


@pytest.fixture(scope="module")
def controlplane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveControlPlane]:
    yield from start_controlplane(tmp_path_factory.mktemp("hostile-cp"))


# --------------------------------------------------------------------------------------------
# What must not change


def _get(base: str, path: str) -> Any:
    reply = send(base, "GET", path)
    assert reply.status == 200, (path, reply)
    return reply.json()


def collector_state(base: str) -> dict[str, Any]:
    """The data a refused request must leave alone; fields that move with the clock dropped."""
    overview = _get(base, "/api/overview")
    overview.pop("now")
    overview.pop("generated_at")  # the same clock under the original's name
    overview["devices"] = overview["devices"]["total"]
    jobs = _get(base, "/api/jobs")
    assert jobs["pages"] == 1, "the seed grew past one page; read every page here"
    devices = _get(base, "/api/devices?expired=true")["devices"]
    for device in devices:
        for moving in ("status", "last_seen_age_s", "expired"):
            device.pop(moving)
    schedules = [{k: s[k] for k in ("id", "cron", "enabled", "template")}
                 for s in _get(base, "/api/schedules")["schedules"]]
    topics = [{k: t[k] for k in ("topic", "count", "last_seq")}
              for t in _get(base, "/api/events")["topics"]]
    # Registrations only: a poll that was answered (not refused) records its executor.
    executors = [{k: e[k] for k in ("name", "capabilities", "agent", "registered_at")}
                 for e in _get(base, "/api/executors")["executors"] if e["registered_at"]]
    return {"overview": overview, "jobs": jobs, "devices": devices, "schedules": schedules,
            "templates": _get(base, "/api/templates")["templates"],
            "artifacts": _get(base, "/api/artifacts"), "topics": topics, "executors": executors,
            "locks": _get(base, "/api/locks")}


def controlplane_state(base: str) -> dict[str, Any]:
    state = _get(base, "/api/state")
    runners = sorted((r["name"], r["draining"], r.get("dir")) for r in state["runners"])
    settings = {s["key"]: s["value"] for s in _get(base, "/api/settings")["settings"]}
    hosts = sorted(h["host"] for h in _get(base, "/api/hosts")["hosts"])
    return {"runners": runners, "settings": settings, "hosts": hosts}


@pytest.fixture
def collector_unchanged(collector: LiveCollector) -> Iterator[None]:
    before = collector_state(collector.url)
    yield
    assert collector_state(collector.url) == before, "a refused request changed the data"


@pytest.fixture
def controlplane_unchanged(controlplane: LiveControlPlane) -> Iterator[None]:
    before = controlplane_state(controlplane.url)
    yield
    assert controlplane_state(controlplane.url) == before, "a refused request changed the data"


# --------------------------------------------------------------------------------------------
# What a refusal looks like


def refusal_problem(reply: Reply, what: str, allowed: tuple[int, ...] = ()) -> str | None:
    """None for a 4xx (one of `allowed` when given) with a one-sentence reason and nothing
    leaked; else what is wrong with the reply."""
    if not 400 <= reply.status < 500 or (allowed and reply.status not in allowed):
        return f"{what}: {reply}"
    if any(leak in reply.body for leak in LEAKS):
        return f"{what} leaked: {reply}"
    if reply.media == "text/html" or what.startswith("HEAD "):
        return None  # the legacy pages answer their refusals as pages; HEAD has no body
    if reply.media != "application/json":
        return f"{what}: not JSON: {reply}"
    error = reply.json().get("error")
    if not (isinstance(error, str) and error and "\n" not in error):
        return f"{what}: no one-sentence error: {reply}"
    return None


def assert_refused(reply: Reply, what: str, allowed: tuple[int, ...] = ()) -> None:
    problem = refusal_problem(reply, what, allowed)
    assert problem is None, problem


class Problems(list[str]):
    """Every refusal that went wrong in a loop, reported together rather than the first one."""

    def check(self, reply: Reply, what: str, allowed: tuple[int, ...] = ()) -> None:
        problem = refusal_problem(reply, what, allowed)
        if problem is not None:
            self.append(problem[:600])

    def assert_none(self) -> None:
        assert not self, f"{len(self)} problems:\n" + "\n".join(self)


def known_path_values(live: LiveCollector) -> dict[str, str]:
    """Path values naming real records, so a body is what a refusal is about."""
    alerts = _get(live.url, "/api/alerts?state=all")["alerts"]
    return {"job_id": live.seeded.jobs["queued"], "device_id": "pixel-7",
            "sha256": live.seeded.artifact, "id": "weekly-selfcheck",
            "alert_id": str(alerts[0]["id"] if alerts else 1), "topic": "build-log",
            "peer_id": "p", "tail": "api/health", "build": "b", "path": "dash/app.js",
            "name": "mac-mini"}


# --------------------------------------------------------------------------------------------
# Bodies


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# Past the documented nesting limit (64) but within what the parsers take, and text that is not
# Unicode: each refused with its own sentence on every JSON route of both services.
DEPTH_ERROR = "the JSON body is nested deeper than 64 levels"
NESTING_AND_SURROGATES: list[tuple[str, bytes, tuple[int, ...]]] = [
    ("arrays nested 65 deep", _deep(65), (400,)),
    ("objects nested 65 deep", b'{"a":' * 65 + b"1" + b"}" * 65, (400,)),
    ("arrays nested 1,000 deep", _deep(1000), (400,)),
    ("a lone surrogate in a string", b'{"device_id": "x\\ud800", "host": "\\udfff"}', (400,)),
    ("a lone surrogate in a key", b'{"\\udc00": 1}', (400,)),
]
NAMED_REFUSALS = {
    "arrays nested 65 deep": DEPTH_ERROR,
    "objects nested 65 deep": DEPTH_ERROR,
    "arrays nested 1,000 deep": DEPTH_ERROR,
    "a lone surrogate in a string":
        "device_id is not valid Unicode text (a lone surrogate \\ud800)",
    "a lone surrogate in a key":
        "a key of the body is not valid Unicode text (a lone surrogate \\udc00)",
}


def generic_bodies(limit: int, any_json: bool) -> list[tuple[str, bytes, tuple[int, ...]]]:
    """(what, body, allowed statuses) for every JSON route; `limit` is the route's body limit."""
    deep = min(200_000, limit // 2 - 8)  # deeper than any parser recursion, within the limit
    bad = [
        ("malformed JSON", b'{"device_id": ', (400,)),
        ("truncated JSON", b'{"schema": 1, "job_id": "a", "work', (400,)),
        ("an empty body", b"", (400,)),
        ("whitespace only", b"   \n", (400,)),
        (f"arrays nested {deep} deep", _deep(deep), (400,)),
        (f"objects nested {deep // 6} deep", b'{"a":' * (deep // 6) + b"1" + b"}" * (deep // 6),
         (400,)),
        *NESTING_AND_SURROGATES,
        ("an integer of 5000 digits", b'{"x": ' + b"9" * 5000 + b"}", (400,)),
        ("an integer of 400 digits (Inf to SQLite's JSON functions)",
         b'{"x": ' + b"9" * 400 + b"}", (400,)),
        ("non-UTF-8 bytes", b'{"device_id": "\xff\xfe"}', (400,)),
        ("a UTF-16 body", '{"a": 1}'.encode("utf-16"), (400,)),
        ("NaN, which is not JSON", b"NaN", (400,)),
        ("an object holding NaN", b'{"device_id": NaN, "x": NaN}', (400,)),
        ("an object holding Infinity", b'{"device_id": -Infinity}', (400,)),
        ("a number past float (1e999)", b'{"device_id": 1e999}', (400,)),
        ("a body one byte over the limit", b'{"x": "' + b"a" * (limit - 8) + b'"}', (413,)),
        ("a body of 3 MiB", b'{"x": "' + b"a" * (3 * MIB) + b'"}', (413,)),
    ]
    if not any_json:  # a topic takes any JSON value as its payload, by design
        bad += [("a JSON array", b"[1, 2]", (400,)), ("a JSON string", b'"x"', (400,)),
                ("JSON null", b"null", (400,)), ("a JSON number", b"1e999", (400,)),
                ("a JSON true", b"true", (400,))]
    return bad


JSON_LIMIT = MIB
TOPIC_LIMIT = 64 * 1024


def _limit_of(op: Operation) -> int:
    return TOPIC_LIMIT if "{topic}" in op.path else JSON_LIMIT


BODY_OPS = [op for op in COLLECTOR_OPS if op.json_body]


@pytest.mark.parametrize("op", BODY_OPS, ids=lambda op: op.label)
def test_collector_refuses_broken_bodies(op: Operation, collector: LiveCollector,
                                         collector_unchanged: None) -> None:
    problems = Problems()
    url = op.url(known_path_values(collector))
    topic = "{topic}" in op.path
    optional = not op.spec["requestBody"]["required"]  # no body at all is a valid request
    for what, body, allowed in generic_bodies(_limit_of(op), any_json=topic):
        if optional and not body:
            continue
        reply = send(collector.url, op.method, url, body, {"Content-Type": "application/json"})
        problems.check(reply, f"{op.label} with {what}", allowed)
    declared = send(collector.url, op.method, url, b"{}",
                    {"Content-Type": "application/json", "Content-Length": str(10 * MIB)})
    problems.check(declared, f"{op.label} declaring 10 MiB", (413, 400))
    problems.assert_none()


@pytest.mark.parametrize("service", ["collector", "controlplane"])
def test_nesting_and_lone_surrogates_are_refused_by_name(service: str, request: Any) -> None:
    live = request.getfixturevalue(service)
    if service == "collector":
        ops, values, headers = BODY_OPS, known_path_values(live), {}
    else:
        ops = [op for op in CONTROLPLANE_OPS if op.json_body]
        values, headers = {}, {"Authorization": f"Bearer {live.token}"}
    wrong = []
    for op in ops:
        for what, body, _ in NESTING_AND_SURROGATES:
            reply = send(live.url, op.method, op.url(values) if values else op.path, body,
                         {"Content-Type": "application/json", **headers})
            if reply.status != 400 or reply.json().get("error") != NAMED_REFUSALS[what]:
                wrong.append(f"{op.label} with {what}: {reply}"[:300])
    assert not wrong, "\n".join(wrong)


# Per-route corpus: bodies that parse but break a rule. Every one must be refused with 400.
HUGE = 10**400  # past float: float(HUGE) raises OverflowError
JOB = job("hostile-job", targets={"device_id": "pixel-7"})
SPEC = {"schema": 1, "workload": "benchmark", "executor": "device"}  # a template: no job_id
COLLECTOR_BODIES: dict[str, list[Any]] = {
    "POST /devices/register": [
        {}, {"device_id": ""}, {"device_id": "../../etc/passwd"}, {"device_id": "a\u0000b"},
        {"device_id": "x'; DROP TABLE devices; --"}, {"device_id": "-leading-dash"},
        {"device_id": "a" * 201}, {"device_id": 5}, {"device_id": ["d"]},
        {"device_id": "d1", "descriptor": "linux"}, {"device_id": "d1", "pools": "a,b"},
        {"device_id": "d1", "pools": ["x" * 101]}, {"device_id": "d1", "pools": [""] },
        {"device_id": "d1", "capabilities": [None]}, {"device_id": "d1", "ttl_s": HUGE},
        {"device_id": "d1", "ttl_s": 1}, {"device_id": "d1", "ttl_s": 1e999},
        {"device_id": "d1", "descriptor": {"ram_mb": -1}},
        {"device_id": "d1", "descriptor": {"ram_mb": 1.5}},
        {"device_id": "d1", "pools": ["p"] * 65},
    ],
    "POST /executors/register": [
        {}, {"name": ""}, {"name": "x" * 201}, {"name": 5}, {"name": ["mac"]},
        {"name": "mac", "capabilities": "web-test"}, {"name": "mac", "capabilities": [None]},
        {"name": "mac", "capabilities": [""]}, {"name": "mac", "capabilities": ["c"] * 101},
        {"name": "mac", "capabilities": {"web-test": True}}, {"name": "mac", "slots": 0},
        {"name": "mac", "slots": 65}, {"name": "mac", "slots": HUGE},
        {"name": "mac", "slots": 1e999}, {"name": "mac", "slots": True},
        {"name": "mac", "slots": "2"}, {"name": "mac", "agent": 7},
        {"name": "mac", "agent": "a" * 201}, {"name": "mac", "agent": None},
        {"name": "mac", "slots": None},
    ],
    "POST /locks/acquire": [
        {}, {"job_id": ""}, {"job_id": 5}, {"job_id": "j", "device_ids": "d1"},
        {"job_id": "j", "device_ids": []}, {"job_id": "j", "device_ids": [None]},
        {"job_id": "j", "device_ids": [""]}, {"job_id": "j", "device_ids": ["d"] * 101},
        {"job_id": "j", "device_ids": ["x" * 201]}, {"job_id": "x" * 201, "device_ids": ["d"]},
        {"job_id": "j", "device_ids": ["d"], "executor": ""},
        {"job_id": "j", "device_ids": ["d"], "executor": None},
    ],
    "POST /locks/release": [
        {}, {"job_id": ""}, {"job_id": ["j"]}, {"job_id": "j", "executor": 7},
        {"job_id": "j", "executor": "x" * 201},
    ],
    "POST /results": [
        {}, {"kind": "result"}, {"schema": 1, "kind": "verdict", "device_id": "pixel-7"},
        {"schema": 2, "kind": "beacon", "device_id": "pixel-7"},
        {"schema": 1, "kind": "beacon", "device_id": "pixel-7", "beacon": {"battery_pct": 101}},
        {"schema": 1, "kind": "beacon", "device_id": "pixel-7", "beacon": {"load": -1}},
        {"schema": 1, "kind": "beacon", "device_id": "pixel-7",
         "beacon": {"battery_pct": HUGE}},
        {"schema": 1, "kind": "beacon", "device_id": "pixel-7", "beacon": "full"},
        {"schema": 1, "kind": "beacon", "device_id": "../pixel-7"},
        {"schema": 1, "kind": "beacon", "device_id": "pixel-7",
         "beacon": {"busy": {"job_id": "j"}}},
        {"schema": 1, "kind": "result", "device_id": "pixel-7", "job_id": "bench-phone",
         "iter": HUGE},
        {"schema": 1, "kind": "result", "device_id": "pixel-7", "job_id": "bench-phone",
         "iter": -1},
        {"schema": 1, "kind": "result", "device_id": "pixel-7", "job_id": "bench-phone",
         "iter": 1.5},
        {"schema": 1, "kind": "result", "device_id": "pixel-7", "job_id": "bench-phone",
         "iter": 9, "metrics": {"ttft_ms": "fast"}},
        {"schema": 1, "kind": "result", "device_id": "pixel-7", "job_id": "bench-phone",
         "iter": 9, "artifacts": ["../../etc/passwd"]},
        {"schema": 1, "kind": "result", "device_id": "pixel-7", "job_id": "bench-phone",
         "iter": 9, "error": "x" * 4001},
        {"schema": 1, "kind": "result", "device_id": "pixel-7", "job_id": "' OR 1=1 --",
         "iter": 9},
        {"schema": 1, "kind": "result", "device_id": "pixel-7", "job_id": "bench-phone",
         "iter": 9, "final": "yes"},
    ],
    "POST /jobs/{job_id}/release": [{}, {"device_id": 5}, {"device_id": ""},
                                    {"device_id": None}],
    "POST /jobs": [
        {}, [], [None], [JOB, JOB], [JOB] * 1001, {**JOB, "schema": 2},
        {**JOB, "job_id": "x'; DROP TABLE jobs; --"}, {**JOB, "job_id": "../x"},
        {**JOB, "job_id": "a\u0000b"}, {**JOB, "executor": "root"},
        {**JOB, "lease": {"ttl_s": 0}}, {**JOB, "lease": {"ttl_s": HUGE}},
        {**JOB, "priority": "high"}, {**JOB, "priority": 1e999},
        {**JOB, "depends_on": ["missing-job"]}, {**JOB, "depends_on": "chain-make"},
        {**JOB, "params": {"api_key": "sk-123"}}, {**JOB, "password": "hunter2"},
        {**JOB, "params": {"prompt_tokens": "${jobs.other.metrics.n}"}},
        {**JOB, "targets": {"match": "model ~ '(a+)+$'"}},
        {**JOB, "targets": {"device_id": "pixel-7", "unknown": 1}},
        {**JOB, "constraints": {"window": {"from": 24, "to": 1}}},
        {**JOB, "fanout": {"distinct": 5}},
        {**JOB, "app": {"name": "a", "sha256": "latest"}},
        {**JOB, "depends_on": ["hostile-job"]},
    ],
    "POST /api/jobs/{job_id}/cancel": [{"reason": ""}, {"reason": "   "}, {"reason": 5},
                                       {"reason": "x" * 501}, {"why": "x"}, [], "smoke"],
    "PATCH /api/jobs/{job_id}": [{}, {"priority": HUGE}, {"priority": "1"}, {"priority": True},
                                 {"priority": 1, "status": "done"}, {"priority": 1.5},
                                 {"status": "done"}, {"priority": None}],
    # {} is the original's preview of every device: no longer refused.
    "POST /api/jobs/preview-targets": [{"targets": {"pool": 5}}, {"workload": 5},
                                       {"workload": ""},
                                       {"workload": "benchmark", "targets": "x"},
                                       {"workload": "benchmark", "executor": "root"},
                                       {"workload": "benchmark",
                                        "targets": {"match": "(" * 40 + "a" + ")" * 40}}],
    "POST /api/devices/forget": [
        {}, [], {"device_ids": []}, {"device_ids": "pixel-7"}, {"device_ids": [None]},
        {"device_ids": [""]}, {"device_ids": ["pixel-7"] * 1001}, {"device_ids": {"a": 1}},
        {"silent_for_s": 0}, {"silent_for_s": -HUGE}, {"silent_for_s": HUGE},
        {"silent_for_s": 1e999}, {"silent_for_s": "86400"}, {"silent_for_s": None},
        {"silent_for_s": False}, {"device_ids": ["pixel-7"], "silent_for_s": 86400},
        {"all": True}],
    "POST /api/peers/forget": [
        {}, [], {"url": 5}, {"url": ""}, {"url": " "}, {"url": None}, {"url": ["http://x:1"]},
        {"url": "ftp://x:1"}, {"url": "http://x:99999"}, {"url": "http://a@b:1"},
        {"url": "http://b:1/api"}, {"url": "http://b:1?x"}, {"url": "x" * 5000},
        {"url": "a\u0000b:1"}, {"url": "a b:1"}, {"url": "\udcff"},
        {"url": "http://127.0.0.1:1", "also": 1}, {"url": "http://127.0.0.1:1"},
        # text urlsplit raises on: a lone bracket, a host NFKC folds into '#'
        {"url": "http://]x:1"}, {"url": "[x:1"}, {"url": "http://a\uff03b:1"}],
    "PATCH /api/devices/{device_id}": [{}, {"name": 5}, {"notes": "x" * 2001},
                                       {"pools": "a"}, {"pools": [""]}, {"pools": [5]},
                                       {"device_id": "other"}, {"capabilities": []}],
    "POST /api/system/retention": [{"apply": "yes"}, {"apply": 1}, {"apply": None},
                                   {"x": 1}, []],
    "POST /api/artifacts/{sha256}/pin": [{}, {"reason": ""}, {"reason": "   "},
                                         {"reason": "x" * 501}, {"reason": 5}],
    "POST /api/artifacts/{sha256}/baseline": [{}, {"accepted": "true"}, {"accepted": 1},
                                              {"accepted": None}],
    "POST /api/visual/baselines/accept": [
        {}, {"suite": "s", "page": "p", "profile": "c"},
        {"suite": "", "page": "p", "profile": "c", "sha256": "a" * 64},
        {"suite": "s" * 201, "page": "p", "profile": "c", "sha256": "a" * 64},
        {"suite": "s", "page": "p\u0000", "profile": "c", "sha256": "a" * 64},
        {"suite": "s", "page": "p", "profile": ["c"], "sha256": "a" * 64},
        {"suite": "s", "page": "p", "profile": "c", "sha256": "../../etc/passwd"},
        {"suite": "s", "page": "p", "profile": "c", "sha256": "a" * 64, "job_id": 5}],
    "POST /api/schedules": [
        {}, {"id": "../x", "cron": "* * * * *", "template": JOB},
        {"id": "s1", "cron": "99 * * * *", "template": {"schema": 1, "workload": "benchmark",
                                                         "executor": "device"}},
        {"id": "s1", "cron": "*/0 * * * *", "template": {}},
        {"id": "s1", "cron": "x" * 10_000, "template": {}},
        {"id": "s1", "cron": "0 0 30 feb *", "template": {}},
        {"id": "s1", "cron": {}, "template": {}},
        {"id": "s1", "cron": ["* * * * *"], "template": {}},
        {"id": "s1", "cron": "\u00b2 * * * *", "template": {}},
        {"id": "s1", "cron": "@daily", "template": JOB},
        {"id": "s1", "cron": "@daily", "template": {"schema": 1, "workload": "benchmark",
                                                     "executor": "device"}, "enabled": "yes"},
        {"id": "s1", "cron": "@daily", "template": {"schema": 1, "workload": "benchmark",
                                                     "executor": "device",
                                                     "targets": {"match": "a ~ '(a|a)*'"}}},
        {"id": "weekly-selfcheck", "cron": "@daily", "template": {
            "schema": 1, "workload": "self-check", "executor": "device"}},
    ],
    "PATCH /api/schedules/{id}": [{}, {"cron": {}}, {"cron": []}, {"cron": "61 * * * *"},
                                  {"enabled": "yes"}, {"template": []},
                                  {"template": {**JOB}}, {"id": "renamed"}],
    "POST /schedules": [
        {}, {"id": "../x", "cron": "* * * * *", "template": SPEC},
        {"id": "s1", "cron": "99 * * * *", "template": SPEC},
        {"id": "s1", "cron": "@daily", "template": JOB},
        {"id": "s1", "cron": "@daily", "template": SPEC, "enabled": "yes"},
        {"id": "s1", "cron": "@daily", "template": {**SPEC, "targets": {"match": "a ~ '(a|a)*'"}}},
        # An id that exists goes to the replace path: its refusals change nothing either.
        {"id": "weekly-selfcheck", "cron": "@daily"},
        {"id": "weekly-selfcheck", "cron": "@daily", "template": []},
        {"id": "weekly-selfcheck", "cron": "61 * * * *", "template": SPEC},
        {"id": "weekly-selfcheck", "cron": "@daily", "template": SPEC, "x": 1},
    ],
    "PATCH /schedules/{id}": [{}, {"cron": {}}, {"cron": "61 * * * *"}, {"enabled": "yes"},
                              {"template": []}, {"template": {**JOB}}, {"id": "renamed"}],
    "POST /api/templates": [
        {}, {"id": "../x", "spec": SPEC}, {"id": "t1"}, {"id": "t1", "spec": JOB},
        {"id": "t1", "spec": []}, {"id": "t1", "spec": {**SPEC, "password": "hunter2"}},
        {"id": "t1", "spec": {**SPEC, "targets": {"match": "(" * 40 + "a" + ")" * 40}}},
        {"id": "t1", "spec": SPEC, "name": "x" * 201}, {"id": "t1", "spec": SPEC, "name": 5},
        {"id": "t1", "spec": SPEC, "colour": 1}, {"id": "a\u0000b", "spec": SPEC},
        {"id": "weekly-selfcheck", "spec": {**SPEC, "schema": 2}},
    ],
    "PATCH /api/templates/{id}": [{}, {"spec": []}, {"spec": JOB}, {"name": 5},
                                  {"name": "x" * 201}, {"id": "renamed"}],
    "POST /api/templates/{id}/enqueue": [{"job_id": 5}, {"job_id": "../x"},
                                         {"job_id": "x" * 5000}, {"colour": 1}, [],
                                         {"job_id": "a\u0000b"}],
    "POST /api/alerts/{alert_id}/snooze": [{}, {"duration_s": "1"}, {"minutes": -1},
                                           {"duration_s": 1, "minutes": 1},
                                           {"duration_s": 1e999}, {"duration_s": HUGE},
                                           {"minutes": HUGE}, {"duration_s": True},
                                           {"duration_s": 10**7}],
}
COLLECTOR_BODIES["POST /api/jobs"] = COLLECTOR_BODIES["POST /jobs"]  # the same route
EXPECTED_OTHER = {  # refusals that are not 400, by the API's rules
    ("POST /jobs", 3): 409, ("POST /api/jobs", 3): 409, ("POST /api/schedules", 12): 409,
    ("POST /api/peers/forget", 17): 404,  # a well-formed address this collector has no peer at
}


def test_every_collector_body_route_has_a_corpus() -> None:
    assert {op.label for op in BODY_OPS if "{topic}" not in op.path} == set(COLLECTOR_BODIES)


@pytest.mark.parametrize("label", sorted(COLLECTOR_BODIES))
def test_collector_refuses_bodies_that_break_a_rule(label: str, collector: LiveCollector,
                                                    collector_unchanged: None) -> None:
    problems = Problems()
    op = next(op for op in COLLECTOR_OPS if op.label == label)
    url = op.url(known_path_values(collector))
    for index, body in enumerate(COLLECTOR_BODIES[label]):
        reply = send_json(collector.url, op.method, url, body)
        expected = EXPECTED_OTHER.get((label, index), 400)
        problems.check(reply, f"{label} #{index} {json.dumps(body)[:200]}", (expected,))
    problems.assert_none()


CP_BODIES: dict[str, list[Any]] = {
    "POST /api/action": [
        {}, {"args": {}}, {"id": "rm -rf /"}, {"id": 5}, {"id": "runner.drain", "args": "x"},
        {"id": "runner.drain", "args": {"name": "../../etc"}},
        {"id": "runner.drain", "args": {"name": "x; reboot"}},
        {"id": "runner.drain", "args": {"name": "a\u0000b"}},
        {"id": "runner.duplicate", "args": {"name": 5}},
        {"id": "runner.drain", "args": {"name": "$(reboot)"}},
    ],
    "POST /api/settings": [
        {}, {"key": "ceiling"}, {"key": {"a": 1}, "value": 1}, {"key": "nope", "value": 1},
        {"key": "ceiling", "value": HUGE}, {"key": "ceiling", "value": 1e999},
        {"key": "ceiling", "value": 0}, {"key": "ceiling", "value": "4"},
        {"key": "ceiling", "value": True}, {"key": "ceiling", "reset": "yes"},
        {"key": "grouping", "value": ["repo"]}, {"key": "tick_s", "value": 1e999},
        {"key": "max_load_per_core", "value": HUGE},
        {"key": "min_free_disk_gb", "value": -HUGE},
    ],
    "POST /api/host/heartbeat": [
        {}, {"host": 5}, {"host": "../x"}, {"host": "a" * 101}, {"host": "a\u0000b"},
        {"host": ""}, {"host": "-x"}, {"host": "h", "wait_s": -1}, {"host": "h", "wait_s": "1"},
        {"host": "h", "runners": "r1"}, {"host": "h", "runners": [{"name": "../r"}]},
        {"host": "h", "runners": [{"name": "r"}] * 501}, {"host": "h", "queue": "../x"},
        {"host": "h", "queue": 5}, {"host": "h", "applied": -1}, {"host": "h", "applied": True},
        {"host": "h", "applied": 1.5}, {"host": "h", "applied": 2**60}],
    "POST /api/simulate": [
        {}, {"repo": "octo/app"}, {"repo": "../x", "runnerCounts": [1], "sloSec": 60},
        {"repo": "a/b/c", "runnerCounts": [1], "sloSec": 60},
        {"repo": 5, "runnerCounts": [1], "sloSec": 60},
        {"repo": "octo/app", "runnerCounts": [], "sloSec": 60},
        {"repo": "octo/app", "runnerCounts": [257], "sloSec": 60},
        {"repo": "octo/app", "runnerCounts": [1] * 17, "sloSec": 60},
        {"repo": "octo/app", "runnerCounts": ["1"], "sloSec": 60},
        {"repo": "octo/app", "runnerCounts": [HUGE], "sloSec": 60},
        {"repo": "octo/app", "runnerCounts": [1], "sloSec": -1},
        {"repo": "octo/app", "runnerCounts": [1], "sloSec": 1e999},
        {"repo": "octo/app", "runnerCounts": [1], "sloSec": HUGE},
        {"repo": "octo/app", "runnerCounts": [1], "sloSec": 60, "days": 0},
        {"repo": "octo/app", "runnerCounts": [1], "sloSec": 60, "days": 366},
        {"repo": "octo/app", "runnerCounts": [1.5], "sloSec": 60}],
    "POST /api/host/results": [{}, {"host": "h"}, {"host": "h", "results": "x"},
                               {"host": "h", "results": [{"id": 5}]},
                               {"host": "h", "results": [None]},
                               {"host": "../h", "results": []}],
}


def test_every_controlplane_body_route_has_a_corpus() -> None:
    assert {op.label for op in CONTROLPLANE_OPS if op.json_body} == set(CP_BODIES)


@pytest.mark.parametrize("label", sorted(CP_BODIES))
def test_controlplane_refuses_broken_bodies(label: str, controlplane: LiveControlPlane,
                                            controlplane_unchanged: None) -> None:
    problems = Problems()
    auth = {"Authorization": f"Bearer {controlplane.token}"}
    op = next(op for op in CONTROLPLANE_OPS if op.label == label)
    for what, body, allowed in generic_bodies(JSON_LIMIT, any_json=False):
        reply = send(controlplane.url, op.method, op.path, body,
                     {"Content-Type": "application/json", **auth})
        problems.check(reply, f"{label} with {what}", allowed)
    for index, body in enumerate(CP_BODIES[label]):
        reply = send_json(controlplane.url, op.method, op.path, body, auth)
        problems.check(reply, f"{label} #{index} {json.dumps(body)[:200]}", (400,))
    problems.assert_none()


def test_beacon_fields_do_not_overwrite_the_record(collector: LiveCollector) -> None:
    """A beacon is free-form, but its own `at` and `job_id` are the collector's to say."""
    assert send_json(collector.url, "POST", "/devices/register",
                     registration("beacon-forger")).status == 200
    forged = {"schema": 1, "kind": "beacon", "device_id": "beacon-forger",
              "beacon": {"at": "not a time", "job_id": "forged", "battery_pct": 50}}
    assert send_json(collector.url, "POST", "/results", forged).status == 200
    [kept] = _get(collector.url, "/api/devices/beacon-forger/beacons")["beacons"]
    assert kept["job_id"] is None and kept["at"].endswith("Z") and kept["battery_pct"] == 50


# --------------------------------------------------------------------------------------------
# Path parameters


PATH_ATTACKS = ["../../../../etc/passwd", "..", ".", "..%2f..%2fetc%2fpasswd",
                "%2e%2e%2f%2e%2e%2fetc%2fpasswd", "%252e%252e%252f", "..\\..\\windows\\win.ini",
                "a/../../b", "\x00", "a\x00b", "' OR '1'='1", "1; DROP TABLE jobs; --",
                "x" * 3000, "\U0001f600", "%", "${jobs.a.artifact}", "<script>x</script>",
                "/etc/passwd", "~root", "-1", "0", "9" * 40, "\u00b2", "\u0663", "1e3"]
# Raw (unencoded) forms that a client can put on a request line as they are.
RAW_ATTACKS = ["../../../../etc/passwd", "..%2f..%2fetc%2fpasswd", "a/../../b", "/etc/passwd",
               "%2e%2e/%2e%2e/etc/passwd", "....//....//etc/passwd"]


def _path_outcome_ok(op: Operation, value: str, reply: Reply) -> bool:
    """Answers that are right for a value that is valid after all: the dashboard serves its
    application shell for any deep link; a topic name such as `0` or `..` is a topic (empty)."""
    if op.path == "/dash/{tail}":
        return reply.status == 200 and b"<html" in reply.body.lower()
    if "{topic}" in op.path and op.method == "GET" and TOPIC.fullmatch(value):
        return reply.status in (200, 204)
    return False


def _path_cases(op: Operation) -> Iterator[tuple[str, str, str]]:
    for value in PATH_ATTACKS:
        yield value, repr(value[:40]), op.url(dict.fromkeys(op.path_params, value))
    for value in RAW_ATTACKS:
        yield value, f"raw {value!r}", op.url(dict.fromkeys(op.path_params, value),
                                              encode=False)


@pytest.mark.parametrize("op", [op for op in COLLECTOR_OPS if op.path_params],
                         ids=lambda op: op.label)
def test_collector_path_parameters_are_not_paths(op: Operation, collector: LiveCollector,
                                                 collector_unchanged: None) -> None:
    problems = Problems()
    for value, what, url in _path_cases(op):
        # No body: a route that needs one refuses for that, whatever its path says, and a
        # topic whose hostile name happens to be valid (`..` is a topic name) publishes nothing.
        reply = send(collector.url, op.method, url)
        if _path_outcome_ok(op, value, reply):
            continue
        problems.check(reply, f"{op.method} {url[:120]} ({what})")
    problems.assert_none()


@pytest.mark.parametrize("prefix", ["/static/", "/static/x/", "/dash/legacy/", "/favicon.svg/",
                                    "/artifacts/", "/api/peers/p/"])
def test_collector_static_paths_do_not_escape(prefix: str, collector: LiveCollector) -> None:
    build = send(collector.url, "GET", "/dash").body.decode()
    current = build.split("/static/", 1)[1].split("/", 1)[0]
    for prefix_used in {prefix, prefix.replace("/x/", f"/{current}/")}:
        for value in [*RAW_ATTACKS, "dash/../../../pyproject.toml", "dash/%2e%2e/index.html",
                      "dash/.hidden", "dash/index.html", "vendor/../../openapi/collector.json",
                      "dash\\..\\..\\pyproject.toml", "dash/app.js%00.html"]:
            reply = send(collector.url, "GET", prefix_used + value)
            assert reply.status >= 400 or b"<html" in reply.body.lower(), (prefix_used, value,
                                                                            reply)
            assert not any(leak in reply.body for leak in LEAKS), (prefix_used, value)


def test_controlplane_public_files_do_not_escape(controlplane: LiveControlPlane) -> None:
    problems = Problems()
    op = next(op for op in CONTROLPLANE_OPS if op.path == "/public/{path}")
    for _value, what, url in _path_cases(op):
        problems.check(send(controlplane.url, "GET", url), f"GET {url[:120]} ({what})")
    for value in ["../../../pyproject.toml", "%2e%2e/%2e%2e/openapi/controlplane.json",
                  "index.html/../../../../etc/passwd", ".hidden", "js/../../dash/app.js"]:
        reply = send(controlplane.url, "GET", "/public/" + value)
        problems.check(reply, f"/public/{value}", (400, 404))
    problems.assert_none()


# --------------------------------------------------------------------------------------------
# Query parameters


QUERY_ATTACKS = [quote(value, safe="") for value in (
    "9" * 5000, "-1", "\u00b2", "--5", "1e999", "nan", "inf", "\x00", "a\x00b", "' OR '1'='1",
    "%' OR 1=1 --", "\\", "x" * 3000, "\U0001f600", "0x10", " 1", "1 ", "+1", "1_000",
    "\u0661", "true", "[]", "{}", "1e-999", "-0", "0", "99999999999999999999")] + ["%FF", "%"]


@pytest.mark.parametrize("op", [op for op in COLLECTOR_OPS if op.query_params],
                         ids=lambda op: op.label)
def test_collector_query_parameters_are_checked(op: Operation, collector: LiveCollector,
                                                collector_unchanged: None) -> None:
    problems = Problems()
    url = op.url(known_path_values(collector))
    for param in op.query_params:
        for encoded in QUERY_ATTACKS:
            what = f"{op.method} {url}?{param['name']}={encoded[:40]}"
            if op.streams:  # answered with a stream that never ends: its status is enough
                status = peek_status(collector.url, f"{url}?{param['name']}={encoded}")
                if status is None or status >= 500:
                    problems.append(f"{what}: {status}")
                continue
            reply = send(collector.url, op.method, f"{url}?{param['name']}={encoded}")
            if reply.status >= 400 or reply.status < 200:  # else a filter that matched nothing
                problems.check(reply, what)
    problems.assert_none()


@pytest.mark.parametrize("op", [op for op in CONTROLPLANE_OPS if op.query_params],
                         ids=lambda op: op.label)
def test_controlplane_query_parameters_are_checked(op: Operation,
                                                   controlplane: LiveControlPlane,
                                                   controlplane_unchanged: None) -> None:
    problems = Problems()
    auth = {"Authorization": f"Bearer {controlplane.token}"}
    for param in op.query_params:
        for encoded in QUERY_ATTACKS:
            reply = send(controlplane.url, op.method, f"{op.path}?{param['name']}={encoded}",
                         headers=auth)
            problems.check(reply, f"{op.label} {param['name']}={encoded[:40]}", (400, 404))
    problems.assert_none()


@pytest.mark.parametrize("text", ["' OR '1'='1", "%", "x' UNION SELECT * FROM devices --",
                                  "\\", "%' --"])
def test_sql_metacharacters_in_filters_match_literally(text: str,
                                                       collector: LiveCollector) -> None:
    for field in ("q", "workload", "device", "pool", "executor"):
        listing = _get(collector.url, f"/api/jobs?{field}={quote(text, safe='')}")
        assert listing["total"] == 0, (field, text, listing["total"])
    assert _get(collector.url, f"/api/results?job={quote(text, safe='')}")["total"] == 0
    assert _get(collector.url, f"/api/artifacts?name={quote(text, safe='')}")["total"] == 0


# --------------------------------------------------------------------------------------------
# Regular-expression bombs


BOMBS = ["model ~ '(a+)+$'", "model ~ '(a|a)*b'", "model ~ '(a|aa)+$'", "model ~ '(.*a){12}'",
         "model ~ '(\\\\w+\\\\s?)*$'", "model ~ '(x+x+)+y'", "model ~ '(a{1,100}){1,100}'",
         "model ~ '^(([a-z])+.)+[A-Z]([a-z])+$'", "model ~ '(a*)*$'", "model ~ '(a?){30}a{30}'",
         "model ~ '(a)\\\\1'", "model ~ '" + "a" * 300 + "'",
         "model ~ '" + "(?:a|b)" * 40 + "'", "(" * 40 + "model == 'x'" + ")" * 40,
         "model == 'x' && " * 200 + "model == 'x'", "model ~ '[' ", "model ~ '(?P<n>a)(?P=n)'",
         "model ~ '.*.*.*.*.*.*.*.*.*.*=.*'"]


def test_regex_bombs_in_match_are_refused(collector: LiveCollector,
                                          collector_unchanged: None) -> None:
    template = {"schema": 1, "workload": "benchmark", "executor": "device",
                "backend": "synthetic"}
    for index, bomb in enumerate(BOMBS):
        for path, body in (
                ("/jobs", {**job(f"bomb-{index}"), "targets": {"match": bomb}}),
                ("/api/jobs/preview-targets", {"workload": "benchmark", "backend": "synthetic",
                                               "targets": {"match": bomb}}),
                ("/api/schedules", {"id": f"bomb-{index}", "cron": "@daily",
                                    "template": {**template, "targets": {"match": bomb}}})):
            reply = send_json(collector.url, "POST", path, body)
            assert_refused(reply, f"POST {path} with match {bomb[:80]!r}", (400,))
            assert "match" in reply.json()["error"], reply
    assert send(collector.url, "GET", "/api/health").status == 200


# --------------------------------------------------------------------------------------------
# Limits of the connection: uploads, request lines, headers


def test_artifact_uploads_over_the_limit_are_refused(collector: LiveCollector,
                                                     collector_unchanged: None) -> None:
    big = b"\x01" * (ARTIFACT_LIMIT + 1)
    octets = {"Content-Type": "application/octet-stream"}
    assert_refused(send(collector.url, "POST", "/artifacts", big, octets), "declared", (413,))
    chunked = hex(len(big))[2:].encode() + b"\r\n" + big + b"\r\n0\r\n\r\n"
    reply = send(collector.url, "POST", "/artifacts", chunked,
                 {**octets, "Transfer-Encoding": "chunked"})
    assert_refused(reply, "chunked without a length", (413,))
    head = (f"POST /artifacts HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {50 << 30}\r\n"
            f"Expect: 100-continue\r\n\r\n").encode()
    answer = raw_exchange(collector.url, head)
    assert status_of(answer) == 413, answer[:300]
    assert_refused(send(collector.url, "POST", "/artifacts", b"x",
                        {**octets, "x-artifact-sha256": "../../etc/passwd"}), "bad hash", (400,))
    assert_refused(send(collector.url, "POST", "/artifacts", b"x",
                        {**octets, "x-artifact-sha256": "0" * 64}), "wrong hash", (400,))
    assert_refused(send(collector.url, "POST", "/artifacts", b"x",
                        {**octets, "x-artifact-app": "a" * 201}), "long header", (400,))
    assert_refused(send(collector.url, "POST", "/artifacts", b"x",
                        {**octets, "Expect": "200-ok"}), "odd Expect", (417,))


@pytest.mark.parametrize("service", ["collector", "controlplane"])
def test_oversized_request_lines_and_headers_are_closed(service: str, request: Any) -> None:
    live = request.getfixturevalue(service)
    for raw in (b"GET /api/health?" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20_000
                + b"\r\n\r\n",
                b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                + b"".join(b"X-%d: a\r\n" % i for i in range(300)) + b"\r\n",
                b"GARBAGE\r\n\r\n", b"GET /api/health HTTP/9.9\r\n\r\n",
                b"GET /api/health HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
                b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"):
        answer = raw_exchange(live.url, raw + b"\r\n")
        status = status_of(answer)
        assert status is not None and 400 <= status < 500, (raw[:80], answer[:200])
    assert send(live.url, "GET", "/api/health" if service == "collector" else "/api/state"
                ).status == 200


# --------------------------------------------------------------------------------------------
# Tokens and origins


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectorProcess]:
    """A collector with FLEET_DASH_TOKEN set, holding a device and a queued job."""
    root: Path = tmp_path_factory.mktemp("guarded")
    proc = CollectorProcess(root / "data", env={"FLEET_DASH_TOKEN": "right-token",
                                                "FLEET_LONG_POLL_S": "0.3"}).start()
    try:
        assert proc.client.post("/devices/register", registration("g-dev"))[0] == 200
        assert proc.client.post("/jobs", job("g-job", targets={"device_id": "g-dev"}))[0] == 201
        yield proc
    finally:
        proc.stop()


GUARD_VALUES = {"job_id": "g-job", "device_id": "g-dev", "sha256": "0" * 64, "id": "g-sched",
                "alert_id": "1", "name": "g-exec"}


def _guard_state(proc: CollectorProcess) -> Any:
    jobs = _get(proc.url, "/api/jobs")["jobs"]
    devices = _get(proc.url, "/api/devices")["devices"]
    return ([(j["job_id"], j["status"], j["priority"]) for j in jobs],
            [(d["device_id"], d["name"], d["pools"]) for d in devices],
            _get(proc.url, "/api/schedules"))


def test_dashboard_changes_need_the_token(guarded: CollectorProcess) -> None:
    problems = Problems()
    before = _guard_state(guarded)
    secured = [op for op in COLLECTOR_OPS if op.secured]
    assert len(secured) >= 15, [op.label for op in secured]
    body = b'{"priority": 5, "name": "x", "reason": "r", "accepted": true, "minutes": 5}'
    json_type = {"Content-Type": "application/json"}
    for op in secured:
        url = op.url(GUARD_VALUES)
        missing = send(guarded.url, op.method, url, body, json_type)
        problems.check(missing, f"{op.label} without a token", (401,))
        assert "X-Fleet-Token" in missing.json()["error"]
        wrong = send(guarded.url, op.method, url, body, {**json_type, "X-Fleet-Token": "wrong"})
        problems.check(wrong, f"{op.label} with a wrong token", (403,))
        for evil in ({"X-Fleet-Token": "right-token", "Sec-Fetch-Site": "cross-site"},
                     {"X-Fleet-Token": "right-token\u0000"}, {"X-Fleet-Token": "right-token2"},
                     {"X-Fleet-Token": "RIGHT-TOKEN"}, {"X-Fleet-Token": ""}):
            reply = send(guarded.url, op.method, url, body,
                         {**json_type, **{k: v.replace("\u0000", "%00") for k, v in
                                          evil.items()}})
            problems.check(reply, f"{op.label} with {evil}", (401, 403))
    problems.assert_none()
    assert _guard_state(guarded) == before
    assert _get(guarded.url, "/api/health")["guard"] is True


def test_open_routes_do_not_ask_for_the_token(guarded: CollectorProcess) -> None:
    for op in COLLECTOR_OPS:
        if op.secured or op.method not in ("POST", "PATCH", "PUT", "DELETE"):
            continue
        url = op.url({**GUARD_VALUES, "topic": "t", "peer_id": "p", "tail": "x"})
        reply = send(guarded.url, op.method, url, b"not json",
                     {"Content-Type": "application/json"})
        assert reply.status != 401, f"{op.label} asked for the token: {reply}"


def test_controlplane_token_routes_refuse_without_the_right_token(
        controlplane: LiveControlPlane, controlplane_unchanged: None) -> None:
    problems = Problems()
    secured = [op for op in CONTROLPLANE_OPS if op.secured]
    assert {op.label for op in secured} >= {"POST /api/action", "POST /api/settings",
                                            "GET /api/runner/bundle"}
    token = controlplane.token
    body = json.dumps({"id": "runner.drain", "args": {"name": controlplane.runner},
                       "key": "ceiling", "value": 2, "host": "h", "results": []}).encode()
    path_query = {"GET /api/runner/bundle": f"?name={controlplane.runner}"}
    for op in secured:
        url = op.path + path_query.get(op.label, "")
        cases = [({}, 401), ({"Authorization": "Bearer wrong"}, 403),
                 ({"Authorization": f"Basic {token}"}, 401),
                 ({"Authorization": f"Bearer {token[:-1]}"}, 403),
                 ({"Authorization": f"Bearer {token}x"}, 403),
                 ({"Authorization": "Bearer"}, 401),
                 ({"Authorization": f"Bearer {token}", "Origin": EVIL_ORIGIN}, 403),
                 ({"Authorization": f"Bearer {token}", "Origin": "null"}, 403),
                 ({"Authorization": f"Bearer {token}", "Sec-Fetch-Site": "cross-site"}, 403)]
        for headers, status in cases:
            reply = send(controlplane.url, op.method, url, body if op.method == "POST" else None,
                         {"Content-Type": "application/json", **headers})
            problems.check(reply, f"{op.label} with {sorted(headers)}", (status,))
    problems.assert_none()


def test_controlplane_simulate_refuses_other_sites(controlplane: LiveControlPlane) -> None:
    """The replay needs no token (it only reads) but another site's page may not start one."""
    body = {"repo": "octo/app", "runnerCounts": [1, 2], "sloSec": 60}
    for headers in ({"Origin": EVIL_ORIGIN}, {"Origin": "null"},
                    {"Sec-Fetch-Site": "cross-site"}):
        reply = send_json(controlplane.url, "POST", "/api/simulate", body, headers)
        assert_refused(reply, f"simulate with {headers}", (403,))


@pytest.mark.parametrize("service", ["collector", "controlplane"])
def test_no_cross_origin_grant_anywhere(service: str, request: Any) -> None:
    """No CORS: another site's page can neither read replies nor pass a preflight."""
    live = request.getfixturevalue(service)
    ops = COLLECTOR_OPS if service == "collector" else CONTROLPLANE_OPS
    for op in ops:
        if "{" in op.path or op.path.endswith("stream"):
            continue
        for method in (op.method, "OPTIONS"):
            reply = send(live.url, method, op.path, None, {
                "Origin": EVIL_ORIGIN, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type, x-fleet-token, authorization"})
            granted = {k.lower() for k in reply.headers if k.lower().startswith("access-control")}
            assert not granted, f"{method} {op.path} grants {granted}"
            if method == "OPTIONS":
                assert reply.status in (404, 405), f"preflight {op.path}: {reply}"


def test_guarded_changes_from_another_site_are_refused_without_a_token(
        collector: LiveCollector, collector_unchanged: None) -> None:
    problems = Problems()
    for op in COLLECTOR_OPS:
        if op.secured:
            reply = send(collector.url, op.method, op.url(known_path_values(collector)),
                         b"{}", {"Content-Type": "application/json",
                                 "Sec-Fetch-Site": "cross-site", "Origin": EVIL_ORIGIN})
            problems.check(reply, f"{op.label} from another site", (403,))
    problems.assert_none()


@pytest.mark.parametrize("service", ["collector", "controlplane"])
def test_method_not_allowed_names_the_allowed_methods(service: str, request: Any) -> None:
    """RFC 9110: a 405 carries Allow (schemathesis' unsupported_method check asks for it)."""
    live = request.getfixturevalue(service)
    reply = send(live.url, "PUT", "/jobs/sweep" if service == "collector" else "/api/state")
    assert_refused(reply, "PUT on a route without PUT", (405,))
    assert "GET" in (reply.headers.get("Allow") or ""), dict(reply.headers)
    if service == "collector":
        # Under /api/ the fallback route catches every method, and still tells the two apart:
        # a known path with the wrong method is 405 with Allow, an unknown path 404.
        reply = send(live.url, "PUT", "/api/jobs")
        assert_refused(reply, "PUT on /api/jobs", (405,))
        assert {"GET", "HEAD"} <= {m.strip() for m in (reply.headers.get("Allow") or "").split(",")}
        assert "PUT is not allowed on /api/jobs" in json.loads(reply.body)["error"]
        assert_refused(send(live.url, "PUT", "/api/no-such-thing"), "an unknown path", (404,))


def test_agent_reports_reach_the_snapshot_typed(controlplane: LiveControlPlane) -> None:
    """What an agent says about its runners reaches the snapshot and the UI: a field of the
    wrong type is dropped (null), never passed on (federation.clean_report)."""
    auth = {"Authorization": f"Bearer {controlplane.token}"}
    odd = [{"name": "r1", "state": {"html": "<b>x</b>"}, "busy": "yes", "labels": "linux",
            "draining": [1], "version": {"v": 1}, "repo": "../../etc", "owner": 5},
           {"name": "r2", "labels": ["ok", 5, None, {"x": 1}], "busy": True, "state": "idle"}]
    reply = send_json(controlplane.url, "POST", "/api/host/heartbeat",
                      {"host": "odd-agent", "runners": odd, "load": ["high"]}, auth)
    assert reply.status == 200, reply
    hosts = _get(controlplane.url, "/api/hosts")["hosts"]
    agent = next(h for h in hosts if h["host"] == "odd-agent")
    assert agent["load"] is None
    by_name = {r["name"]: r for r in agent["runners"]}
    assert by_name["r1"]["state"] is None and by_name["r1"]["busy"] is False
    assert by_name["r1"]["labels"] == [] and by_name["r1"]["draining"] is False
    assert by_name["r1"]["version"] is None and by_name["r1"]["repo"] is None
    assert by_name["r2"]["labels"] == ["ok"] and by_name["r2"]["busy"] is True

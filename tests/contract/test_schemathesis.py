"""Schemathesis runs every operation of both OpenAPI documents against the live services.

Each operation gets examples from the document, boundary cases (the coverage phase) and a few
generated requests, valid and invalid; every response is checked for: no 5xx, a status the
document lists, the content type and body the document describes, and a bounded answer (each
request times out after REQUEST_TIMEOUT_S, so a hang fails instead of stalling the suite).
Path parameters and the runner name are drawn half the time from the ids the seeded services
hold, so the replies of real records (not only 404s) are checked against the document.

Bounded: MAX_EXAMPLES per operation (FLEET_CONTRACT_EXAMPLES raises it for a longer search, and
FLEET_CONTRACT_SEED draws other requests than the suite's fixed seed does).
Long polls are held short: FLEET_LONG_POLL_S=0.3 on the collector, and the wait_s of the topic
long poll and of an agent's heartbeat is clamped to 0.5 s (hold_short); event streams are read
up to their first event.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

import pytest
import schemathesis
import yarl
from hypothesis import strategies as st
from schemathesis import Case

from fleet_min import openapi
from tests.support.live import LiveCollector, LiveControlPlane, SlowProbes

# One test runs every operation of a document (each request bounded by REQUEST_TIMEOUT_S): over
# a hundred operations take 70 s alone and 95 s beside two other workers on a slow hour, close to
# the suite's 120 s for one test, so the whole run gets ten minutes before it counts as hung.
pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(600)]

MAX_EXAMPLES = int(os.environ.get("FLEET_CONTRACT_EXAMPLES", "6"))
SEED = int(os.environ.get("FLEET_CONTRACT_SEED", "20251121"))
REQUEST_TIMEOUT_S = 15
# unsupported_method is left out: its one finding here (a 405 without Allow) would fail every
# operation, so test_hostile.py checks it once. positive_data_acceptance is left out too: a
# well-formed request may rightly be refused by state (an unknown id, a closed job, a workload
# no agent declares).
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "response_headers_conformance",
          "negative_data_rejection")


def _config(base_url: str, headers: dict[str, str] | None = None) -> schemathesis.Config:
    return schemathesis.Config.from_dict({
        "base-url": base_url,
        "headers": headers or {},
        "request-timeout": REQUEST_TIMEOUT_S,
        "max-stream-events": 1,
        "seed": SEED,
        "generation": {"max-examples": MAX_EXAMPLES, "mode": "all", "database": "none"},
        "phases": {"stateful": {"enabled": False}},
        "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
    })


def _load(name: str, config: schemathesis.Config) -> Any:
    return schemathesis.openapi.from_dict(generation_copy(json.loads(
        openapi.document_bytes(name))), config=config)


def generation_copy(doc: dict[str, Any]) -> dict[str, Any]:
    """The document as schemathesis generates from it.

    Schemathesis cannot generate from `if`/`then` (it reports the schema as unsupported), which
    the job schema uses to type `params` per workload. Requests are generated from the job spec
    without those rules (params stay an open object); replies, claimed jobs included, are still
    checked against the full schema, and tests/test_validate.py covers the per-workload rules.
    """
    schemas = doc["components"]["schemas"]
    if "JobSpec" in schemas:
        schemas["JobSpecRequest"] = {k: v for k, v in schemas["JobSpec"].items() if k != "allOf"}
        for path in ("/jobs", "/api/jobs"):  # the same route under two names
            body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
            body["schema"] = json.loads(json.dumps(body["schema"]).replace(
                "#/components/schemas/JobSpec\"", "#/components/schemas/JobSpecRequest\""))
    return doc


def _mixing_known(known: dict[str, list[Any]]) -> Any:
    """A before_generate_* hook: half the time, replace generated values by known ones."""

    def hook(context: Any, strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        def swap(values: Any) -> st.SearchStrategy[Any]:
            if not isinstance(values, dict):
                return st.just(values)
            return st.fixed_dictionaries({
                key: st.sampled_from(known[key]) if known.get(key) else st.just(value)
                for key, value in values.items()})

        return st.one_of(strategy, strategy.flatmap(swap))

    return hook


def hold_short(case: Case) -> None:
    """A valid `wait_s` of up to 25 s (the topic long poll, in the query) or 30 s (an agent's
    heartbeat, in the body) is right but slow: every phase's requests wait at most 0.5 s.
    A value past the documented maximum stays: it is refused at once, and must be."""
    for values, documented_max in ((case.query, 25), (case.body, 3600)):
        wait = values.get("wait_s") if isinstance(values, dict) else None
        if isinstance(wait, int | float) and not isinstance(wait, bool) \
                and 0.5 < wait <= documented_max:
            values["wait_s"] = 0.5


def _alert_ids(base: str) -> list[int]:
    with urllib.request.urlopen(base + "/api/alerts?state=all", timeout=10) as resp:
        return [alert["id"] for alert in json.loads(resp.read())["alerts"]]


@pytest.fixture(scope="session")
def collector_schema(collector_live: LiveCollector, slow_probes: SlowProbes) -> Any:
    # slow_probes: started here so that their minute-long wait overlaps this run.
    schema = _load("collector", _config(collector_live.url))
    seeded = collector_live.seeded
    known = {"job_id": list(seeded.jobs.values()), "device_id": seeded.devices,
             "sha256": [seeded.artifact], "id": [seeded.schedule],
             "alert_id": _alert_ids(collector_live.url),
             "topic": ["camera-frames", "build-log"]}
    schema.hook("before_generate_path_parameters")(_mixing_known(known))

    return schema


@pytest.fixture(scope="session")
def controlplane_schema(controlplane_live: LiveControlPlane) -> Any:
    auth = {"Authorization": f"Bearer {controlplane_live.token}"}
    schema = _load("controlplane", _config(controlplane_live.url, auth))
    schema.hook("before_generate_query")(_mixing_known({"name": [controlplane_live.runner,
                                                                 "octo/app"]}))

    return schema


collector = schemathesis.pytest.from_fixture("collector_schema")
controlplane = schemathesis.pytest.from_fixture("controlplane_schema")


def mirror_streams_on(case: Case) -> bool:
    """The live mirror of a running job (GET /api/jobs/{job_id}/mirror of a claimed job) is a
    multipart stream that ends only with the run; schemathesis reads every reply to its end
    (it bounds only event streams), so such a reply is read to its first part and checked here.
    True when it was; False for every other case, which goes through the usual checks (a
    mirror of a job that is not running is a 404 at once)."""
    if (case.method.upper(), case.path) != ("GET", "/api/jobs/{job_id}/mirror"):
        return False
    sent = case.as_transport_kwargs()
    request = urllib.request.Request(sent["url"], headers=sent.get("headers") or {})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            kind = reply.headers.get("Content-Type", "")
            assert kind.startswith("multipart/x-mixed-replace; boundary="), kind
            part_head = f"--{kind.split('boundary=', 1)[1]}\r\nContent-Type: image/jpeg\r\n\r\n"
            head = reply.read(len(part_head))
            assert head == part_head.encode(), head
            return True
    except urllib.error.HTTPError as refused:
        refused.close()
        return False


def _concrete_paths(name: str) -> frozenset[tuple[str, str]]:
    """(method, path) of every operation of a document whose path has no parameter."""
    paths = json.loads(openapi.document_bytes(name))["paths"]
    return frozenset((method.upper(), path) for path, item in paths.items() if "{" not in path
                     for method in item)


CONCRETE = {name: _concrete_paths(name) for name in openapi.DOCUMENTS}


def is_another_operation(case: Case, document: str) -> bool:
    """A templated path filled in to equal a path of its own (/dash/legacy/{tail} with the
    tail `jobs`): OpenAPI matches the concrete path first, so the request is that operation's,
    and is checked under it, not against the template's replies. The path is compared as
    aiohttp routes it (yarl's path_safe): decoded, but an encoded `/` or `%` kept, so
    /dash/{tail} with the tail `legacy%2Fjobs` stays the template's request."""
    if "{" not in case.path:
        return False
    filled = yarl.URL.build(path=case.formatted_path, encoded=True).path_safe
    return (case.method.upper(), filled) in CONCRETE[document]


@collector.parametrize()
def test_collector_operation_keeps_its_contract(case: Case) -> None:
    hold_short(case)
    if is_another_operation(case, "collector") or mirror_streams_on(case):
        return
    case.call_and_validate()


@controlplane.parametrize()
def test_controlplane_operation_keeps_its_contract(case: Case) -> None:
    hold_short(case)
    if is_another_operation(case, "controlplane"):
        return
    case.call_and_validate()


def test_a_filled_path_is_judged_by_the_operation_aiohttp_routes_it_to() -> None:
    """No server: how is_another_operation reads three filled-in paths."""
    schema = _load("collector", _config("http://127.0.0.1:9"))
    legacy = schema["/dash/legacy/{tail}"]["GET"]
    dash = schema["/dash/{tail}"]["GET"]
    assert is_another_operation(legacy.Case(path_parameters={"tail": "jobs"}), "collector")
    assert not is_another_operation(legacy.Case(path_parameters={"tail": "jobz"}), "collector")
    # Generated path values arrive percent-encoded (schemathesis quotes every character that is
    # not unreserved), so a tail `legacy/jobs` is sent as /dash/legacy%2Fjobs; aiohttp keeps
    # the encoded slash when routing, so the dashboard's template answers it...
    assert not is_another_operation(dash.Case(path_parameters={"tail": "legacy%2Fjobs"}),
                                    "collector")
    # ...while an encoded letter is decoded: /dash/legacy/j%6Fbs is /dash/legacy/jobs.
    assert is_another_operation(legacy.Case(path_parameters={"tail": "j%6Fbs"}), "collector")

"""FLEET_DASH_TOKEN: dashboard changes need X-Fleet-Token; agents and POST /jobs stay open."""

from __future__ import annotations

import pytest

from fleet_min.collector.access import guard
from fleet_min.collector.http.app import create_app
from fleet_min.config import COLLECTOR_SETTINGS, resolve
from tests.support.collector import job, registration

TOKEN = "s3cret-dashboard-token"
GOOD = {"X-Fleet-Token": TOKEN}


async def start(collector_factory, monkeypatch, token=None):
    """A collector with FLEET_DASH_TOKEN set or unset (both the environment and the override,
    so the test keeps working when the setting moves into fleet_min.config)."""
    if token is None:
        monkeypatch.delenv("FLEET_DASH_TOKEN", raising=False)
        return await collector_factory()
    monkeypatch.setenv("FLEET_DASH_TOKEN", token)
    return await collector_factory(dash_token=token)


async def queued_job(client, job_id="j"):
    resp = await client.post("/jobs", json=job(job_id))
    assert resp.status == 201, await resp.text()


# -- the table ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "template"), [
    ("POST", "/api/jobs/{job_id}/cancel"),
    ("POST", "/api/jobs/{job_id}/retry"),
    ("PATCH", "/api/jobs/{job_id}"),
    ("PATCH", "/api/devices/{device_id}"),
    ("DELETE", "/api/devices/{device_id}"),
    ("POST", "/api/schedules"),
    ("PATCH", "/api/schedules/{schedule_id}"),
    ("DELETE", "/api/schedules/{schedule_id}"),
    ("POST", "/api/schedules/{schedule_id}/run"),
    ("POST", "/schedules"),
    ("PATCH", "/schedules/{id}"),
    ("DELETE", "/schedules/{id}"),
    ("POST", "/api/templates"),
    ("PATCH", "/api/templates/{id}"),
    ("DELETE", "/api/templates/{id}"),
    ("POST", "/api/templates/{id}/enqueue"),
    ("POST", "/api/alerts/{alert_id}/ack"),
    ("POST", "/api/alerts/{alert_id}/snooze"),
    ("DELETE", "/api/artifacts/{sha256}"),
    ("POST", "/api/artifacts/{sha256}/pin"),
    ("DELETE", "/api/artifacts/{sha256}/pin"),
    ("POST", "/api/artifacts/{sha256}/baseline"),
    ("POST", "/api/system/retention"),
])
def test_dashboard_changes_are_guarded(method, template):
    assert guard.is_guarded(method, template, template.replace("{", "x").replace("}", ""))


@pytest.mark.parametrize(("method", "template"), [
    ("POST", "/jobs"),
    ("POST", "/jobs/sweep"),
    ("POST", "/jobs/{job_id}/release"),
    ("POST", "/devices/register"),
    ("POST", "/results"),
    ("POST", "/artifacts"),
    ("POST", "/schedules/tick"),
    ("POST", "/api/alerts/tick"),
    ("POST", "/api/jobs/preview-targets"),
    ("GET", "/api/jobs/{job_id}"),
    ("GET", "/api/schedules"),
    ("GET", "/api/artifacts/gc-candidates"),
])
def test_agent_routes_reads_and_ticks_stay_open(method, template):
    assert not guard.is_guarded(method, template, template)


def test_the_route_template_decides_not_the_decoded_path():
    # /api/jobs/a%2Fb/cancel decodes to a path with an extra segment; the router still matched
    # the cancel route, and the rule follows the route.
    assert guard.is_guarded("POST", "/api/jobs/{job_id}/cancel", "/api/jobs/a/b/cancel")


async def test_every_mutating_route_is_guarded_or_open_on_purpose(collector_factory,
                                                                   monkeypatch):
    """A new route that changes state must join one of guard's two tables."""
    monkeypatch.delenv("FLEET_DASH_TOKEN", raising=False)
    app = create_app(resolve(COLLECTOR_SETTINGS, environ={}, data_dir="unused"))
    unclassified = []
    for resource in app.router.resources():
        template = resource.canonical
        for route in resource:
            method = route.method
            if method in ("GET", "HEAD", "OPTIONS") or template == "/api/{tail}":
                continue
            methods = guard.MUTATING if method == "*" else {method}
            for one in methods:
                if not (guard.is_guarded(one, template, template)
                        or guard.is_open_on_purpose(one, template, template)):
                    unclassified.append(f"{one} {template}")
    assert not unclassified, f"add these to guard.GUARDED or guard.OPEN_ON_PURPOSE: {unclassified}"


# -- over HTTP -----------------------------------------------------------------------------------


async def test_missing_token_is_401_wrong_is_403_right_passes(collector_factory, monkeypatch):
    client = await start(collector_factory, monkeypatch, TOKEN)
    await queued_job(client)
    resp = await client.post("/api/jobs/j/cancel")
    assert resp.status == 401
    assert await resp.json() == {
        "error": "this collector requires X-Fleet-Token for dashboard changes"}
    resp = await client.post("/api/jobs/j/cancel", headers={"X-Fleet-Token": TOKEN + "x"})
    assert resp.status == 403 and "does not match" in (await resp.json())["error"]
    resp = await client.post("/api/jobs/j/cancel", headers={"X-Fleet-Token": "ü" * 4})
    assert resp.status == 403
    assert (await (await client.get("/jobs/j")).json())["status"] == "queued"
    resp = await client.post("/api/jobs/j/cancel", headers=GOOD)
    assert resp.status == 200 and (await resp.json())["was"] == "queued"


async def test_each_dashboard_change_needs_the_token(collector_factory, monkeypatch):
    client = await start(collector_factory, monkeypatch, TOKEN)
    await client.post("/devices/register", json=registration("d"))
    await queued_job(client)
    attempts = [
        ("PATCH", "/api/jobs/j", {"priority": 5}),
        ("POST", "/api/jobs/j/retry", None),
        ("PATCH", "/api/devices/d", {"name": "shelf pi"}),
        ("DELETE", "/api/devices/d", None),
        ("POST", "/api/schedules", {"id": "s", "cron": "* * * * *", "template": job("t")}),
        ("PATCH", "/api/schedules/s", {"enabled": True}),
        ("POST", "/api/schedules/s/run", None),
        ("DELETE", "/api/schedules/s", None),
        ("POST", "/schedules", {"id": "s", "cron": "* * * * *", "template": job("t")}),
        ("PATCH", "/schedules/s", {"enabled": True}),
        ("DELETE", "/schedules/s", None),
        ("POST", "/api/templates", {"id": "t", "spec": {"schema": 1, "workload": "benchmark",
                                                         "executor": "device"}}),
        ("PATCH", "/api/templates/t", {"name": "x"}),
        ("POST", "/api/templates/t/enqueue", None),
        ("DELETE", "/api/templates/t", None),
        ("POST", "/api/alerts/1/ack", None),
        ("POST", "/api/alerts/1/snooze", {"duration_s": 60}),
        ("DELETE", "/api/artifacts/" + "a" * 64, None),
        ("POST", "/api/artifacts/" + "a" * 64 + "/pin", {"reason": "release"}),
        ("POST", "/api/system/retention", {"apply": True}),
    ]
    for method, path, body in attempts:
        resp = await client.request(method, path, json=body)
        assert resp.status == 401, (method, path, resp.status)
    # nothing changed
    assert (await (await client.get("/api/devices/d")).json()).get("name") is None
    assert (await (await client.get("/jobs/j")).json())["priority"] == 0
    resp = await client.patch("/api/jobs/j", json={"priority": 5}, headers=GOOD)
    assert resp.status == 200 and (await resp.json())["priority"] == 5
    resp = await client.patch("/api/devices/d", json={"name": "shelf pi"}, headers=GOOD)
    assert resp.status == 200


async def test_agents_and_post_jobs_stay_open(collector_factory, monkeypatch):
    client = await start(collector_factory, monkeypatch, TOKEN)
    assert (await client.post("/devices/register", json=registration("d"))).status == 200
    await queued_job(client)
    resp = await client.get("/devices/d/next-job")
    assert resp.status == 200 and (await resp.json())["job_id"] == "j"
    resp = await client.post("/results", json={"schema": 1, "kind": "result", "job_id": "j",
                                               "device_id": "d", "iter": 0, "final": True,
                                               "ok": True})
    assert resp.status == 200
    assert (await client.post("/jobs/sweep")).status == 200
    for path in ("/api/jobs", "/api/jobs/j", "/api/devices", "/api/overview"):
        assert (await client.get(path)).status == 200, path


async def test_health_reports_the_guard(collector_factory, monkeypatch, tmp_path):
    client = await start(collector_factory, monkeypatch, TOKEN)
    assert (await (await client.get("/api/health")).json())["guard"] is True
    monkeypatch.delenv("FLEET_DASH_TOKEN")
    other = await collector_factory(data_dir=str(tmp_path / "open"))
    assert (await (await other.get("/api/health")).json())["guard"] is False


async def test_without_a_token_changes_are_open(collector_factory, monkeypatch):
    client = await start(collector_factory, monkeypatch)
    await queued_job(client)
    assert (await client.post("/api/jobs/j/cancel")).status == 200


async def test_cross_site_browser_requests_are_refused_even_without_a_token(
        collector_factory, monkeypatch):
    client = await start(collector_factory, monkeypatch)
    await queued_job(client)
    resp = await client.post("/api/jobs/j/cancel", headers={"Sec-Fetch-Site": "cross-site"})
    assert resp.status == 403 and "another site" in (await resp.json())["error"]
    assert (await (await client.get("/jobs/j")).json())["status"] == "queued"
    # the collector's own dashboard is same-origin; a page elsewhere cannot enqueue either
    # (every change is refused to it, open routes too), nor make a visitor's browser read
    resp = await client.post("/api/jobs/j/cancel", headers={"Sec-Fetch-Site": "same-origin"})
    assert resp.status == 200
    resp = await client.post("/jobs", json=job("k"), headers={"Sec-Fetch-Site": "cross-site"})
    assert resp.status == 403
    assert (await client.get("/jobs/k")).status == 404
    resp = await client.get("/api/jobs", headers={"Sec-Fetch-Site": "cross-site"})
    assert resp.status == 403
    for own in ({"Sec-Fetch-Site": "same-origin"}, {"Sec-Fetch-Site": "none"}, {}):
        assert (await client.get("/api/jobs", headers=own)).status == 200, own


async def test_cross_site_is_refused_with_the_right_token_too(collector_factory, monkeypatch):
    client = await start(collector_factory, monkeypatch, TOKEN)
    await queued_job(client)
    resp = await client.post("/api/jobs/j/cancel",
                             headers={**GOOD, "Sec-Fetch-Site": "cross-site"})
    assert resp.status == 403


async def test_encoded_slash_cannot_slip_past_the_guard(collector_factory, monkeypatch):
    client = await start(collector_factory, monkeypatch, TOKEN)
    resp = await client.post("/api/jobs/a%2Fb/cancel")
    assert resp.status == 401


def archive_job(job_id: str) -> dict:
    return job(job_id, workload="archive", executor="host",
               params={"source": "a" * 64, "app": "shop", "account": "release"})


async def test_a_signing_job_needs_the_token_when_one_is_set(collector_factory, monkeypatch):
    """POST /jobs is open, but an archive job has an executor sign bytes the job names with its
    owner's release key: with a token set, it is a dashboard change, alone or in a batch."""
    client = await start(collector_factory, monkeypatch, TOKEN)
    resp = await client.post("/jobs", json=archive_job("sign-1"))
    assert resp.status == 401 and "release key" in (await resp.json())["error"]
    resp = await client.post("/jobs", json=archive_job("sign-2"),
                             headers={"X-Fleet-Token": "wrong"})
    assert resp.status == 403
    resp = await client.post("/api/jobs", json=[job("plain-1"), archive_job("sign-3")])
    assert resp.status == 401
    for job_id in ("sign-1", "sign-2", "sign-3", "plain-1"):
        assert (await client.get(f"/jobs/{job_id}")).status == 404, job_id  # nothing stored
    assert (await client.post("/jobs", json=job("plain-2"))).status == 201  # others stay open
    resp = await client.post("/jobs", json=archive_job("sign-4"), headers=GOOD)
    assert resp.status == 201, await resp.text()


async def test_a_workload_named_by_a_template_reference_needs_the_token_too(
        collector_factory, monkeypatch):
    """A workload holding `${jobs.<id>.metrics.<key>}` is named only at promotion, from a row
    whoever ran the dependency chose: queued without the token it became an archive job that
    signed the attacker's bytes. With a token set it needs the token, whole or embedded."""
    client = await start(collector_factory, monkeypatch, TOKEN)
    # An executor declaring the reference as a capability gets the job past "nobody runs it".
    assert (await client.post("/executors/register", json={
        "name": "decoy", "capabilities": ["${jobs.dep.metrics.wl}", "arch${jobs.dep.metrics.x}"]
    })).status == 200
    assert (await client.post("/jobs", json=job("dep"))).status == 201
    for job_id, workload in (("whole", "${jobs.dep.metrics.wl}"),
                             ("inside", "arch${jobs.dep.metrics.x}")):
        spec = {**archive_job(job_id), "workload": workload, "depends_on": ["dep"]}
        resp = await client.post("/jobs", json=spec)
        assert resp.status == 401, await resp.text()
        assert "template reference" in (await resp.json())["error"]
        assert (await client.get(f"/jobs/{job_id}")).status == 404
        resp = await client.post("/jobs", json=spec, headers=GOOD)
        assert resp.status == 201, await resp.text()


async def test_without_a_token_a_signing_job_is_as_open_as_any(collector_factory, monkeypatch):
    client = await start(collector_factory, monkeypatch)
    resp = await client.post("/jobs", json=archive_job("sign-1"))
    assert resp.status == 201, await resp.text()

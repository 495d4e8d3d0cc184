"""A request acts only for what it proves (DESIGN rule 5a).

1. Commit statuses go only to repositories in FLEET_CI_STATUS_REPOS (a local fake of GitHub's
   statuses API stands in for GitHub).
2. Result rows are taken only from a job's claimant: its device, or for a host job its executor.
3. With FLEET_MESH_ALLOW set, every agent route checks the mesh node a request comes from against
   the device or executor name it speaks for (real collector processes; a fake `tailscale` on
   PATH answers the identity lookups).
4. X-Forwarded-For is believed only from the proxies FLEET_TRUST_PROXY names.
5. Beacons from ids that are no registered device are refused, unless a host executor beacons
   for the job it holds; a beacon never attaches to a job its sender does not hold.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import sqlite3

import pytest

from fleet_min.collector.access import mesh
from tests.support.collector import (
    CollectorProcess,
    age_rows,
    beacon,
    job,
    registration,
    result_row,
)
from tests.support.fake_statuses import running_fake_statuses
from tests.support.fake_tailscale import install, whois
from tests.support.stream import StreamReader

SHA = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "ghp_fake_status_token_for_authority_tests"


# -- 1. commit statuses -------------------------------------------------------------------------


@pytest.fixture
async def github():
    async with running_fake_statuses() as fake:
        yield fake


async def ci_collector(collector_factory, monkeypatch, api, token=TOKEN, repos=None):
    """A collector posting to the fake; settings given as environment and as typed overrides."""
    monkeypatch.setenv("FLEET_GITHUB_API", api)
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)
    for name, value in (("FLEET_CI_STATUS_TOKEN", token),
                        ("FLEET_CI_STATUS_REPOS", ",".join(repos or ()))):
        if value:
            monkeypatch.setenv(name, value)
        else:
            monkeypatch.delenv(name, raising=False)
    return await collector_factory(github_api=api, ci_status_token=token or "",
                                   ci_status_repos=tuple(r.lower() for r in repos or ()))


def reporting_job(job_id, target):
    return job(job_id, workload="install", executor="host", report_to={"ci_status": target})


async def run_host_job(client, job_id, executor="mac-mini"):
    claimed = await client.get(f"/executor/next-job?name={executor}")
    assert (await claimed.json())["job_id"] == job_id
    resp = await client.post("/results", json=result_row(job_id, executor, final=True, ok=True))
    assert (await resp.json())["status"] == "done"


async def statuses_of(client, job_id, count):
    for _ in range(2000):
        body = await (await client.get(f"/api/jobs/{job_id}/ci-status")).json()
        if len(body["statuses"]) >= count:
            return body["statuses"]
        await asyncio.sleep(0.01)
    raise AssertionError(f"{job_id} never recorded {count} statuses")


async def test_a_token_without_a_list_posts_nothing_and_says_why(
        collector_factory, monkeypatch, github, caplog):
    caplog.set_level(logging.INFO, logger="fleet_min.collector.ci_status")
    client = await ci_collector(collector_factory, monkeypatch, github.url)
    started = [r.getMessage() for r in caplog.records if "FLEET_CI_STATUS_REPOS" in r.getMessage()]
    assert len(started) == 1 and "no commit status is posted" in started[0]
    # no list: enqueue is not refused (the list applies whenever it is set), nothing is sent
    assert (await client.post("/jobs", json=reporting_job("j", f"anyone/any@{SHA}"))).status == 201
    await run_host_job(client, "j")
    recorded = await statuses_of(client, "j", 2)
    assert [(s["state"], s["dry_run"], s["http_status"]) for s in recorded] == [
        ("pending", False, None), ("success", False, None)]
    assert all("FLEET_CI_STATUS_REPOS is not set" in s["error"] for s in recorded)
    assert github.calls == []
    system = (await (await client.get("/api/system")).json())["ci_status"]
    assert system["armed"] is True and system["posting"] is False and system["repos"] is None
    assert "FLEET_CI_STATUS_REPOS" in system["problem"]
    assert TOKEN not in await (await client.get("/api/system")).text()


async def test_enqueue_outside_the_list_is_refused_and_stores_nothing(
        collector_factory, monkeypatch, github):
    client = await ci_collector(collector_factory, monkeypatch, github.url,
                                repos=["Octo-Org/*", "solo/tool"])
    resp = await client.post("/jobs", json=reporting_job("evil", f"victim/secrets@{SHA}"))
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert "victim/secrets" in error and "FLEET_CI_STATUS_REPOS" in error
    assert (await client.get("/jobs/evil")).status == 404
    # an array is all or none, and the refusal names the job
    resp = await client.post("/jobs", json=[reporting_job("fine", f"solo/tool@{SHA}"),
                                            reporting_job("bad", f"solo/other@{SHA}")])
    assert resp.status == 400 and (await resp.json())["error"].startswith("job 1: ")
    assert (await client.get("/jobs/fine")).status == 404
    # `..` is never a repository name, even under an owner pattern: it would walk the API path
    resp = await client.post("/jobs", json=reporting_job("walk", f"octo-org/..@{SHA}"))
    assert resp.status == 400
    # names compare as GitHub compares them: case-insensitively
    assert (await client.post("/jobs", json=reporting_job(
        "ok", f"octo-org/My.App@{SHA}"))).status == 201
    await run_host_job(client, "ok")
    calls = await github.wait_for(2)
    assert [c["path"] for c in calls] == [f"/repos/octo-org/My.App/statuses/{SHA}"] * 2
    assert [c["state"] for c in calls] == ["pending", "success"]


async def test_without_a_token_the_list_still_applies_and_dry_runs_are_recorded(
        collector_factory, monkeypatch, github):
    client = await ci_collector(collector_factory, monkeypatch, github.url, token=None,
                                repos=["octo-org/app"])
    assert (await client.post("/jobs", json=reporting_job(
        "x", f"other/app@{SHA}"))).status == 400
    assert (await client.post("/jobs", json=reporting_job(
        "y", f"octo-org/app@{SHA}"))).status == 201
    await run_host_job(client, "y")
    recorded = await statuses_of(client, "y", 2)
    assert [(s["dry_run"], s["error"]) for s in recorded] == [(True, None), (True, None)]
    assert github.calls == []


async def test_without_a_token_or_a_list_dry_runs_are_recorded_as_before(
        collector_factory, monkeypatch, github):
    client = await ci_collector(collector_factory, monkeypatch, github.url, token=None)
    assert (await client.post("/jobs", json=reporting_job(
        "z", f"anyone/any@{SHA}"))).status == 201
    await run_host_job(client, "z")
    recorded = await statuses_of(client, "z", 2)
    assert [(s["dry_run"], s["error"]) for s in recorded] == [(True, None), (True, None)]
    system = (await (await client.get("/api/system")).json())["ci_status"]
    assert system == {"armed": False, "repos": None, "posting": False, "problem": None}


async def test_a_job_stored_with_a_target_outside_the_list_is_not_posted(
        collector_factory, monkeypatch, github, db_path):
    """A job enqueued before the list was set (or by a path that skipped the check) is caught
    by the reporter too: nothing is sent to a repository outside the list."""
    client = await ci_collector(collector_factory, monkeypatch, github.url,
                                repos=["octo-org/app"])
    assert (await client.post("/jobs", json=reporting_job(
        "old", f"octo-org/app@{SHA}"))).status == 201
    age_rows(db_path, "UPDATE jobs SET spec = replace(spec, 'octo-org/app', 'victim/repo')")
    await run_host_job(client, "old")
    recorded = await statuses_of(client, "old", 2)
    assert all("victim/repo is not in FLEET_CI_STATUS_REPOS" in s["error"] for s in recorded)
    assert github.calls == []


async def test_schedule_templates_are_held_to_the_list(collector_factory, monkeypatch, github):
    client = await ci_collector(collector_factory, monkeypatch, github.url,
                                repos=["octo-org/app"])
    template = {k: v for k, v in reporting_job("t", f"victim/repo@{SHA}").items()
                if k != "job_id"}
    resp = await client.post("/api/schedules", json={"id": "nightly", "cron": "0 3 * * *",
                                                     "template": template})
    assert resp.status == 400
    assert (await resp.json())["error"].startswith("template: report_to.ci_status names "
                                                   "victim/repo")


async def test_the_older_report_to_name_is_held_to_the_list_too(
        collector_factory, monkeypatch, github):
    """report_to.github_status (the name the original's clients send) is the same target as
    ci_status: refused outside the list in a single spec, an array and a schedule template."""
    client = await ci_collector(collector_factory, monkeypatch, github.url,
                                repos=["octo-org/app"])
    aliased = job("alias", workload="install", executor="host",
                  report_to={"github_status": f"victim/repo@{SHA}"})
    for body in (aliased, [aliased]):
        resp = await client.post("/jobs", json=body)
        assert resp.status == 400, await resp.text()
        assert "victim/repo" in (await resp.json())["error"]
    assert (await client.get("/jobs/alias")).status == 404
    template = {k: v for k, v in aliased.items() if k != "job_id"}
    resp = await client.post("/api/schedules", json={"id": "aliased", "cron": "0 3 * * *",
                                                     "template": template})
    assert resp.status == 400 and "victim/repo" in (await resp.json())["error"]


# -- 2. result rows ------------------------------------------------------------------------------


async def claimed_by_device(client, job_id="j", device="d", **fields):
    await client.post("/devices/register", json=registration(device))
    assert (await client.post("/jobs", json=job(job_id, **fields))).status == 201
    got = await client.get(f"/devices/{device}/next-job")
    assert (await got.json())["job_id"] == job_id


async def claimed_by_executor(client, job_id="h", executor="mac-mini"):
    resp = await client.post("/jobs", json=job(job_id, workload="install", executor="host"))
    assert resp.status == 201
    got = await client.get("/executor/next-job", params={"name": executor})
    assert (await got.json())["job_id"] == job_id


async def rows_of(client, job_id):
    return (await (await client.get("/api/results", params={"job": job_id})).json())["results"]


async def status_of(client, job_id):
    return (await (await client.get(f"/jobs/{job_id}")).json())["status"]


async def test_a_row_from_another_device_is_refused_and_changes_nothing(client):
    await claimed_by_device(client)
    await client.post("/devices/register", json=registration("intruder"))
    async with StreamReader(client) as stream:
        resp = await client.post("/results", json=result_row("j", "intruder", 0, final=True,
                                                              ok=False, error="sabotage"))
        assert resp.status == 409
        error = (await resp.json())["error"]
        assert "held by the device that claimed it" in error and "'intruder'" in error
        # the next result event is the claimant's own row: the refused one made none
        ok = await client.post("/results", json=result_row("j", "d", 1, ok=True))
        assert ok.status == 200
        event = await stream.next_of("result")
        assert (event["device_id"], event["iter"]) == ("d", 1)
    assert [r["device_id"] for r in await rows_of(client, "j")] == ["d"]
    assert await status_of(client, "j") == "claimed"


async def test_a_host_job_takes_rows_only_from_its_executor(client):
    await claimed_by_executor(client)
    # a row filed under an attached device must name the executor
    bare = await client.post("/results", json=result_row("h", "pixel-7", 0, final=True,
                                                          ok=False))
    assert bare.status == 409
    assert "host executor that claimed it" in (await bare.json())["error"]
    assert "executor field" in (await bare.json())["error"]
    other = await client.post("/results", json=result_row("h", "pixel-7", 0, final=True,
                                                           ok=True, executor="other-mac"))
    assert other.status == 409
    assert await status_of(client, "h") == "claimed" and await rows_of(client, "h") == []
    # the executor itself: under an attached device's id with its name, or under its name
    attached = await client.post("/results", json=result_row("h", "pixel-7", 1, ok=True,
                                                              executor="mac-mini"))
    assert attached.status == 200
    own = await client.post("/results", json=result_row("h", "mac-mini", 2, ok=True))
    assert own.status == 200
    final = await client.post("/results", json=result_row("h", "pixel-7", 0, final=True,
                                                           ok=True, executor="mac-mini"))
    assert (await final.json())["status"] == "done"
    rows = {(r["device_id"], r["iter"]): r for r in await rows_of(client, "h")}
    assert rows[("pixel-7", 1)]["executor"] == "mac-mini"  # kept, shown with the row


async def test_executor_names_with_odd_characters_compare_exactly(client):
    name = "mac mini \u2603 #1"
    await claimed_by_executor(client, "odd", executor=name)
    near = await client.post("/results", json=result_row("odd", "pixel-7", 0, final=True,
                                                          ok=True, executor="mac mini"))
    assert near.status == 409
    exact = await client.post("/results", json=result_row("odd", "pixel-7", 0, final=True,
                                                           ok=True, executor=name))
    assert (await exact.json())["status"] == "done"


async def test_a_device_job_ignores_the_executor_field(client):
    """A device job's rows speak for their device_id: naming an executor borrows nothing."""
    await claimed_by_device(client)
    resp = await client.post("/results", json=result_row("j", "intruder", 0, final=True,
                                                          ok=True, executor="d"))
    assert resp.status == 409 and await status_of(client, "j") == "claimed"


async def test_rows_for_queued_and_waiting_jobs_are_refused(client):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=[job("first"), job("second", depends_on=["first"])])
    for job_id, status in (("first", "queued"), ("second", "waiting")):
        resp = await client.post("/results", json=result_row(job_id, "d", 0, final=True,
                                                              ok=True))
        assert resp.status == 409, job_id
        assert f"is {status}: nobody holds it" in (await resp.json())["error"]
        assert await rows_of(client, job_id) == [] and await status_of(client, job_id) == status


async def test_after_a_lapse_the_old_holder_adds_rows_only_to_its_own_attempt(client, db_path):
    await claimed_by_device(client, lease={"ttl_s": 60, "max_attempts": 3})
    first = result_row("j", "d", 1, ok=True, metrics={"n": 1})
    assert (await client.post("/results", json=first)).status == 200
    age_rows(db_path, "UPDATE jobs SET lease_deadline = lease_deadline - 120")
    assert (await (await client.post("/jobs/sweep")).json())["requeued"] == ["j"]
    # an agent re-posting its spool gets the idempotent answer, in any key order
    again = await client.post("/results", json=dict(reversed(list(first.items()))))
    assert again.status == 200 and (await again.json())["duplicate"] is True
    # a late row of the lapsed attempt is recorded against it; nobody holds the job now
    late = await client.post("/results", json=result_row("j", "d", 2, ok=True))
    assert late.status == 200
    assert await late.json() == {"ok": True, "duplicate": False, "job_id": "j",
                                 "status": "queued", "attempt": 1}
    # another device claims it; the old holder's late final row changes nothing
    await client.post("/devices/register", json=registration("e"))
    assert (await (await client.get("/devices/e/next-job")).json())["attempt"] == 2
    late_final = await client.post("/results", json=result_row("j", "d", 0, final=True,
                                                                ok=False, error="lapsed"))
    assert late_final.status == 200 and (await late_final.json())["status"] == "claimed"
    # but it cannot speak for the attempt it never held, and a stranger for none
    assert (await client.post("/results", json=result_row(
        "j", "d", 3, ok=True, attempt=2))).status == 409
    await client.post("/devices/register", json=registration("x"))
    stranger = await client.post("/results", json=result_row("j", "x", 0, final=True, ok=True))
    assert stranger.status == 409 and "held by the device that claimed it" in (
        await stranger.json())["error"]
    assert await status_of(client, "j") == "claimed"
    closing = await client.post("/results", json=result_row("j", "e", 0, final=True, ok=True))
    assert (await closing.json())["status"] == "done"
    assert sorted((r["device_id"], r["attempt"], r["iter"]) for r in await rows_of(
        client, "j")) == [("d", 1, 0), ("d", 1, 1), ("d", 1, 2), ("e", 2, 0)]


async def test_a_closed_job_takes_late_rows_only_from_its_holders(client):
    await claimed_by_device(client)
    done = await client.post("/results", json=result_row("j", "d", 0, final=True, ok=True))
    assert (await done.json())["status"] == "done"
    late = await client.post("/results", json=result_row("j", "d", 5, ok=True))
    assert late.status == 200 and (await late.json())["duplicate"] is False
    late_final = await client.post("/results", json=result_row("j", "d", 6, final=True,
                                                                ok=False, error="late"))
    assert (await late_final.json())["status"] == "done"  # stored, closes nothing again
    job_row = await (await client.get("/jobs/j")).json()
    assert job_row["status"] == "done" and job_row["last_error"] is None
    await client.post("/devices/register", json=registration("other"))
    stranger = await client.post("/results", json=result_row("j", "other", 7, ok=True))
    assert stranger.status == 409
    assert "done; after a job closes only the holders of its attempts" in (
        await stranger.json())["error"]
    assert sorted(r["iter"] for r in await rows_of(client, "j")) == [0, 5, 6]


async def test_an_array_with_a_foreign_row_stores_nothing(client):
    await claimed_by_device(client)
    await client.post("/devices/register", json=registration("intruder"))
    resp = await client.post("/results", json=[result_row("j", "d", 1, ok=True),
                                               result_row("j", "intruder", 0, final=True,
                                                          ok=True)])
    assert resp.status == 409 and (await resp.json())["error"].startswith("row 1: ")
    assert await rows_of(client, "j") == [] and await status_of(client, "j") == "claimed"


async def test_release_of_a_host_job_checks_the_executor_name(client):
    await claimed_by_executor(client)
    refused = await client.post("/jobs/h/release", json={"device_id": "pixel-7"})
    assert refused.status == 409 and await status_of(client, "h") == "claimed"
    released = await client.post("/jobs/h/release", json={"device_id": "mac-mini"})
    assert (await released.json())["status"] == "queued"


async def test_the_superseding_of_a_handed_back_attempt_still_works(client):
    """Rows of a new attempt by the same device replace the handed-back attempt's rows."""
    await claimed_by_device(client, preemptible=True)
    await client.post("/results", json=result_row("j", "d", 0, final=True, ok=False,
                                                  preempted=True))
    assert (await (await client.get("/devices/d/next-job")).json())["job_id"] == "j"
    reply = await client.post("/results", json=result_row("j", "d", 0, final=True, ok=True))
    body = await reply.json()
    assert body["duplicate"] is False and body["status"] == "done"


# -- 5. beacons ----------------------------------------------------------------------------------


async def beacon_rows(client):
    return (await (await client.get("/api/system")).json())["tables"]["beacons"]


async def test_beacons_from_strangers_are_refused_and_stored_nowhere(client):
    await claimed_by_device(client)
    await claimed_by_executor(client)
    cases = [(beacon("ghost", "no-such-job", battery_pct=40), 404, "register first"),
             (beacon("ghost", "j", battery_pct=40), 404, "register first"),
             (beacon("ghost", "h", battery_pct=40), 409, "not held by 'ghost'")]
    for body, status, words in cases:
        resp = await client.post("/results", json=body)
        assert resp.status == status, body
        assert words in (await resp.json())["error"]
    assert await beacon_rows(client) == 0
    drain = await (await client.get("/api/results/drain")).json()
    assert drain["devices"] == []


async def test_a_host_executor_beacons_under_its_name_for_the_job_it_holds(client, db_path):
    await claimed_by_executor(client)
    age_rows(db_path, "UPDATE jobs SET lease_deadline = lease_deadline - 300")
    before = (await (await client.get("/jobs/h")).json())["lease_deadline"]
    reply = await client.post("/results", json=beacon("mac-mini", "h", battery_pct=90))
    assert await reply.json() == {"lease_renewed": True, "preempt": False}
    assert (await (await client.get("/jobs/h")).json())["lease_deadline"] > before
    # the lease lapses and the job moves on: the executor learns it, and nothing is stored
    age_rows(db_path, "UPDATE jobs SET lease_deadline = 0")
    await client.post("/jobs/sweep")
    stored = await beacon_rows(client)
    lapsed = await client.post("/results", json=beacon("mac-mini", "h", battery_pct=80))
    assert lapsed.status == 200
    assert await lapsed.json() == {"lease_renewed": False, "preempt": False}
    assert await beacon_rows(client) == stored
    # an executor that never held it gets a refusal
    assert (await client.post("/results", json=beacon("other-mac", "h"))).status == 409


async def test_a_device_beaconing_a_job_it_does_not_hold_renews_nothing(client, db_path):
    await claimed_by_device(client, lease={"ttl_s": 60})
    await client.post("/devices/register", json=registration("other"))
    age_rows(db_path, "UPDATE jobs SET lease_deadline = lease_deadline - 50")
    before = (await (await client.get("/jobs/j")).json())["lease_deadline"]
    for job_id in ("j", "no-such-job"):
        reply = await client.post("/results", json=beacon("other", job_id, battery_pct=70))
        assert await reply.json() == {"lease_renewed": False, "preempt": False}
    assert (await (await client.get("/jobs/j")).json())["lease_deadline"] == before
    history = await (await client.get("/api/devices/other/beacons")).json()
    assert [(b["job_id"], b["battery_pct"]) for b in history["beacons"]] == [
        (None, 70), (None, 70)]
    drain = await (await client.get("/api/results/drain", params={"job": "j"})).json()
    assert drain["devices"] == []


# -- 3. mesh nodes (real collector processes) ----------------------------------------------------

MESH = {
    "100.64.0.5": whois("pi5.example.ts.net.", "pi5"),
    "100.64.0.6": whois("laptop.example.ts.net.", "laptop"),
    "100.64.0.7": whois("intruder.example.ts.net.", "intruder", hostname="pi5"),
    "100.64.0.8": whois("mac.example.ts.net.", "mac"),
}
PI5, LAPTOP, INTRUDER, MAC = (
    {"X-Forwarded-For": address} for address in ("100.64.0.5", "100.64.0.6", "100.64.0.7",
                                                 "100.64.0.8"))


@pytest.fixture
def mesh_collector(tmp_path):
    """A collector process behind a (pretend) proxy on loopback, listing pi5, laptop and mac."""
    env = {**install(tmp_path / "ts", MESH), "FLEET_MESH_ALLOW": "pi5,laptop,mac",
           "FLEET_TRUST_PROXY": "127.0.0.1", "FLEET_LONG_POLL_S": "0.2"}
    proc = CollectorProcess(tmp_path / "data", env=env).start()
    yield proc
    proc.stop()


def test_unlisted_mesh_nodes_cannot_act_for_any_device(mesh_collector):
    c = mesh_collector.client
    assert c.post("/devices/register", registration("pi"))[0] == 200  # loopback
    assert c.post("/jobs", job("j", targets={"device_id": "pi"}))[0] == 201
    assert c.get("/devices/pi/next-job")[0] == 200
    attempts = [
        ("GET", "/devices/pi/next-job", None),
        ("GET", "/executor/next-job?name=mac-mini", None),
        ("POST", "/results", result_row("j", "pi", 0, final=True, ok=True)),
        ("POST", "/results", beacon("pi", "j", battery_pct=5)),
        ("POST", "/jobs/j/release", {"device_id": "pi"}),
        ("POST", "/devices/register", registration("pi")),
    ]
    for method, path, body in attempts:
        status, reply = c.request(method, path, body, headers=INTRUDER)
        assert status == 403, (method, path, status)
        assert "intruder is not in this collector's FLEET_MESH_ALLOW" in reply["error"]
    assert c.get("/jobs/j")[1]["status"] == "claimed"
    assert c.get("/api/results?job=j")[1]["total"] == 0
    assert c.get("/api/devices/pi/beacons")[1]["beacons"] == []


def test_a_device_registered_from_the_mesh_answers_only_to_its_node(mesh_collector):
    c = mesh_collector.client
    assert c.post("/devices/register", registration("pi"), headers=PI5)[0] == 200
    assert c.post("/jobs", job("j", targets={"device_id": "pi"}))[0] == 201
    status, reply = c.get("/devices/pi/next-job", headers=LAPTOP)
    assert status == 403 and "registered from another mesh node" in reply["error"]
    assert c.post("/devices/register", registration("pi"), headers=LAPTOP)[0] == 403
    assert c.get("/jobs/j")[1]["status"] == "queued"
    assert c.get("/devices/pi/next-job", headers=PI5)[1]["job_id"] == "j"
    for body in (result_row("j", "pi", 0, final=True, ok=True), beacon("pi", "j")):
        assert c.post("/results", body, headers=LAPTOP)[0] == 403
    assert c.post("/jobs/j/release", {"device_id": "pi"}, headers=LAPTOP)[0] == 403
    assert c.post("/results", result_row("j", "pi", 1, ok=True), headers=PI5)[0] == 200
    assert c.post("/results", beacon("pi", "j"), headers=PI5)[1]["lease_renewed"] is True
    # loopback and LAN peers stay admitted: there the network is the access control
    assert c.post("/results", result_row("j", "pi", 2, ok=True))[0] == 200
    status, reply = c.post("/results", result_row("j", "pi", 0, final=True, ok=True),
                           headers=PI5)
    assert reply["status"] == "done"
    # re-registering from its own node keeps working
    assert c.post("/devices/register", registration("pi"), headers=PI5)[0] == 200


def test_an_executor_name_is_bound_to_the_first_node_that_uses_it(mesh_collector):
    c = mesh_collector.client
    assert c.get("/executor/next-job?name=mac-mini", headers=MAC)[0] == 204
    status, reply = c.get("/executor/next-job?name=mac-mini", headers=LAPTOP)
    assert status == 403 and "executor name 'mac-mini' is in use by another mesh node" in (
        reply["error"])
    assert c.post("/jobs", job("h", workload="install", executor="host"))[0] == 201
    assert c.get("/executor/next-job?name=mac-mini", headers=MAC)[1]["job_id"] == "h"
    forged = result_row("h", "pixel-7", 0, final=True, ok=False, executor="mac-mini")
    assert c.post("/results", forged, headers=LAPTOP)[0] == 403
    assert c.post("/results", beacon("mac-mini", "h"), headers=LAPTOP)[0] == 403
    assert c.post("/jobs/h/release", {"device_id": "mac-mini"}, headers=LAPTOP)[0] == 403
    assert c.get("/jobs/h")[1]["status"] == "claimed"
    assert c.post("/results", beacon("mac-mini", "h"), headers=MAC)[1]["lease_renewed"]
    own = result_row("h", "pixel-7", 0, final=True, ok=True, executor="mac-mini")
    assert c.post("/results", own, headers=MAC)[1]["status"] == "done"
    # once its node has been silent long enough, another listed node may take the name
    age_rows(mesh_collector.data_dir / "fleet.sqlite3",
             "UPDATE executor_nodes SET seen_at = seen_at - 1000")
    assert c.get("/executor/next-job?name=mac-mini", headers=LAPTOP)[0] == 204
    assert c.get("/executor/next-job?name=mac-mini", headers=MAC)[0] == 403


def test_a_browser_row_answers_to_the_node_of_the_executor_holding_the_job(mesh_collector):
    """A web:<browser> row (the original's executors file each browser's verdict so) speaks for
    the executor holding the host job: from the mesh, only that executor's node may post it."""
    c = mesh_collector.client
    assert c.post("/jobs", job("w", workload="web-test", executor="host"))[0] == 201
    assert c.get("/executor/next-job?name=web-runner", headers=MAC)[1]["job_id"] == "w"
    browser = result_row("w", "web:chromium", 0, ok=True, test={"passed": 1, "failed": 0})
    status, reply = c.post("/results", browser, headers=LAPTOP)
    assert status == 403 and "in use by another mesh node" in reply["error"]
    assert c.get("/api/results?job=w")[1]["total"] == 0
    assert c.post("/results", browser, headers=MAC)[0] == 200
    assert c.get("/api/results?job=w")[1]["total"] == 1


def test_a_device_id_equal_to_an_executor_name_does_not_borrow_its_authority(mesh_collector):
    """Device "mac-mini" registered from pi5; executor "mac-mini" bound to mac. Each job kind
    answers to its own claimant's node."""
    c = mesh_collector.client
    assert c.post("/devices/register", registration("mac-mini"), headers=PI5)[0] == 200
    assert c.get("/executor/next-job?name=mac-mini", headers=MAC)[0] == 204
    assert c.post("/jobs", job("dev", targets={"device_id": "mac-mini"}))[0] == 201
    assert c.get("/devices/mac-mini/next-job", headers=PI5)[1]["job_id"] == "dev"
    assert c.post("/jobs", job("host", workload="install", executor="host"))[0] == 201
    assert c.get("/executor/next-job?name=mac-mini", headers=MAC)[1]["job_id"] == "host"
    host_row = result_row("host", "mac-mini", 0, final=True, ok=True)
    dev_row = result_row("dev", "mac-mini", 0, final=True, ok=True)
    assert c.post("/results", host_row, headers=PI5)[0] == 403
    assert c.post("/results", dev_row, headers=MAC)[0] == 403
    assert c.post("/results", host_row, headers=MAC)[1]["status"] == "done"
    assert c.post("/results", dev_row, headers=PI5)[1]["status"] == "done"


def test_identity_lookups_are_cached_on_the_hot_path(mesh_collector):
    c = mesh_collector.client
    assert c.post("/devices/register", registration("pi"), headers=PI5)[0] == 200
    for n in range(20):
        assert c.post("/jobs", job(f"j{n}", targets={"device_id": "pi"}))[0] == 201
        assert c.get("/devices/pi/next-job", headers=PI5)[1]["job_id"] == f"j{n}"
        assert c.post("/results", result_row(f"j{n}", "pi", 0, final=True, ok=True),
                      headers=PI5)[0] == 200
    log = (mesh_collector.data_dir.parent / "ts" / "whois.log").read_text().splitlines()
    assert log == ["whois --json 100.64.0.5"]


# -- 4. proxy trust ------------------------------------------------------------------------------


def test_forwarded_for_is_believed_only_from_the_proxies_named(tmp_path):
    env = {**install(tmp_path / "ts", MESH), "FLEET_MESH_ALLOW": "pi5"}
    # The proxy named is elsewhere; this request comes straight from loopback, so its
    # X-Forwarded-For is the client's own say-so: ignored, and the peer is loopback.
    elsewhere = CollectorProcess(tmp_path / "a", env={**env, "FLEET_TRUST_PROXY": "10.0.0.0/8"})
    with_proxy = CollectorProcess(tmp_path / "b", env={**env, "FLEET_TRUST_PROXY": "127.0.0.1"})
    try:
        elsewhere.start()
        assert elsewhere.client.post("/devices/register", registration("x"),
                                     headers=INTRUDER)[0] == 200
        assert (tmp_path / "ts" / "whois.log").read_text() == ""
        with_proxy.start()
        status, reply = with_proxy.client.post("/devices/register", registration("x"),
                                               headers=INTRUDER)
        assert status == 403 and "intruder" in reply["error"]
    finally:
        elsewhere.stop()
        with_proxy.stop()


def test_the_old_on_switch_is_refused_at_start(tmp_path):
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_TRUST_PROXY": "1"})
    proc.start(wait=False)
    try:  # a collector that takes the setting runs on: stopped whatever the test finds
        assert proc.proc is not None
        assert proc.proc.wait(timeout=30) == 2
        assert "FLEET_TRUST_PROXY: '1' no longer switches proxy trust on: name the proxies" in (
            proc.log())
    finally:
        proc.stop(signal.SIGKILL)


def test_a_chain_of_trusted_proxies_is_walked_to_the_first_untrusted_hop():
    trusted = (ipaddress.ip_network("127.0.0.1/32"), ipaddress.ip_network("10.0.0.0/8"))
    # client -> 10.1.1.1 (trusted) -> 127.0.0.1 (trusted) -> collector
    assert str(mesh.peer_address("127.0.0.1", "100.64.0.7, 192.168.1.4, 10.1.1.1", trusted)
               ) == "192.168.1.4"
    # a client cannot hide behind a forged entry: only the hops right of it are read
    assert str(mesh.peer_address("127.0.0.1", "100.64.0.5, 100.64.0.7", trusted)
               ) == "100.64.0.7"
    # only trusted hops in the header: the leftmost entry is as far as it goes
    assert str(mesh.peer_address("127.0.0.1", "10.9.9.9", trusted)) == "10.9.9.9"
    # an untrusted socket peer is taken as it is
    assert str(mesh.peer_address("192.168.1.4", "100.64.0.5", trusted)) == "192.168.1.4"
    assert mesh.peer_address("127.0.0.1", "10.1.1.1, not-an-address, 10.2.2.2",
                             trusted) is None


def test_the_schema_upgrade_keeps_devices_unbound(tmp_path):
    """Schema 4 on a database made before it: devices registered earlier stay unbound."""
    from fleet_min.collector.storage.schema import MIGRATIONS
    from fleet_min.db import migrate

    data = tmp_path / "data"
    data.mkdir()
    conn = sqlite3.connect(data / "fleet.sqlite3", isolation_level=None)
    try:
        migrate(conn, MIGRATIONS[:3])
        conn.execute("INSERT INTO devices (device_id, descriptor, first_seen, last_seen, "
                     "registered_at) VALUES ('old', '{}', 1, 1, 1)")
    finally:
        conn.close()
    env = {**install(tmp_path / "ts", MESH), "FLEET_MESH_ALLOW": "pi5,laptop",
           "FLEET_TRUST_PROXY": "127.0.0.1", "FLEET_LONG_POLL_S": "0.2"}
    proc = CollectorProcess(data, env=env).start()
    try:
        # unbound: any listed node may speak for it, and a mesh registration binds it
        assert proc.client.get("/devices/old/next-job", headers=LAPTOP)[0] == 204
        assert proc.client.post("/devices/register", registration("old"),
                                headers=PI5)[0] == 200
        assert proc.client.get("/devices/old/next-job", headers=LAPTOP)[0] == 403
    finally:
        proc.stop()

"""Host executors the collector knows (issues 23 and 26), each through a real collector
(in-process, real socket, real SQLite file): registration and its checks, the capability rules
a host claim follows, the dispatcher's pre-check, and the refusal at enqueue."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.collector import (
    age_rows,
    attached_registration,
    executor_claim,
    registration,
)
from tests.support.collector import host_job as host


async def register(client, name, status=200, **fields):
    resp = await client.post("/executors/register", json={"name": name, **fields})
    body = await resp.json()
    assert resp.status == status, body
    return body


async def enqueue(client, spec, status=201):
    resp = await client.post("/jobs", json=spec)
    body = await resp.json()
    assert resp.status == status, body
    return body


def ui_test(job_id, kind):
    return host(job_id, "ui-test", app={"id": "com.example.shop"},
                suite={"kind": kind, "flows": "flows/"})


# -- registration ------------------------------------------------------------------------------


@pytest.mark.parametrize("body, words", [
    ({}, "name is required"),
    ({"name": ""}, "name is required"),
    ({"name": "x" * 201}, "name is required"),
    ({"name": 7}, "name is required"),
    ({"name": "mac", "capabilities": "web-test"}, "capabilities must be a list"),
    ({"name": "mac", "capabilities": ["web-test", 3]}, "capabilities must be a list"),
    ({"name": "mac", "capabilities": [""]}, "capabilities must be a list"),
    ({"name": "mac", "capabilities": [f"c{i}" for i in range(101)]},
     "capabilities must be a list"),
    ({"name": "mac", "slots": 0}, "slots must be an integer from 1 to 64"),
    ({"name": "mac", "slots": 65}, "slots must be an integer from 1 to 64"),
    ({"name": "mac", "slots": True}, "slots must be an integer from 1 to 64"),
    ({"name": "mac", "agent": ["fleet_agent"]}, "agent must be a string"),
])
async def test_a_registration_is_checked_and_a_refusal_changes_nothing(client, body, words):
    resp = await client.post("/executors/register", json=body)
    assert resp.status == 400
    assert words in (await resp.json())["error"]
    listed = await (await client.get("/api/executors")).json()
    assert listed["executors"] == []


async def test_omitted_capabilities_keep_the_list_and_an_empty_one_means_nothing(client):
    first = await register(client, "mac", capabilities=["web-test", "digest"], slots=2,
                           agent="fleet_agent 0.9.0")
    assert first["capabilities"] == ["digest", "web-test"] and first["slots"] == 2
    again = await register(client, "mac")  # omitted: the list is kept
    assert again["capabilities"] == ["digest", "web-test"] and again["slots"] == 2
    await enqueue(client, host("page", "web-test"))
    assert await executor_claim(client, "mac") == "page"
    await register(client, "mac", capabilities=[])
    await enqueue(client, host("page-2", "web-test"))
    assert await executor_claim(client, "mac") is None  # it runs nothing now
    await register(client, "never-said")  # no opinion: offered every host job
    assert await executor_claim(client, "never-said") == "page-2"


# -- the claim rules ---------------------------------------------------------------------------


async def test_each_executor_is_offered_only_the_host_jobs_it_declared(collector_factory):
    client = await collector_factory(long_poll_s=0.05)
    await register(client, "phones", capabilities=["cold-start", "ui-test:flow_runner"],
                   slots=8)
    await register(client, "web", capabilities=["web-test"], slots=8)
    await enqueue(client, host("page", "web-test"))
    await enqueue(client, ui_test("flows", "flow_runner"))
    await enqueue(client, ui_test("bundle", "native_bundle"))  # nobody declared it
    await enqueue(client, host("cold", "cold-start", params={"app_id": "com.example.shop"}))
    await enqueue(client, host("pinned", "web-test", targets={"executor": "phones"}))
    phones = [await executor_claim(client, "phones", "&slots=8") for _ in range(4)]
    assert phones == ["flows", "cold", None, None]  # a pin does not override what it declared
    assert await executor_claim(client, "web", "&slots=8") == "page"
    assert await executor_claim(client, "web", "&slots=8") is None  # pinned to phones
    detail = await (await client.get("/api/jobs/bundle")).json()
    assert detail["status"] == "queued"


async def test_a_waiting_poll_that_could_not_take_a_job_does_not_keep_it_from_another(
        collector_factory):
    client = await collector_factory(long_poll_s=30)
    await register(client, "phones", capabilities=["cold-start"])
    await register(client, "web", capabilities=["web-test"])
    phones = asyncio.create_task(client.get("/executor/next-job?name=phones"))
    await asyncio.sleep(0.3)
    web = asyncio.create_task(client.get("/executor/next-job?name=web"))
    await asyncio.sleep(0.3)
    await enqueue(client, host("page", "web-test"))
    # The pre-check knows what each declared, so the page goes to the waiting web executor at
    # once (not to the first poll, which would refuse it, leaving web to wait out its hold).
    resp = await asyncio.wait_for(web, 10)
    assert resp.status == 200 and (await resp.json())["job_id"] == "page"
    assert not phones.done()
    phones.cancel()


async def test_a_host_job_for_an_attached_device_goes_to_the_executor_that_drives_it(
        collector_factory):
    client = await collector_factory(long_poll_s=3)  # lab-a's empty direct poll waits it out
    for name in ("lab-a", "lab-b"):
        await register(client, name, capabilities=["cold-start"])
    assert (await client.post("/devices/register",
                              json=attached_registration("R5CT1234ABC", "lab-b"))).status == 200
    cold = {"app_id": "com.example.shop"}
    # lab-a polls first: a job for lab-b's phone passes it by and reaches lab-b's poll at once
    first = asyncio.create_task(client.get("/executor/next-job?name=lab-a"))
    await asyncio.sleep(0.3)
    second = asyncio.create_task(client.get("/executor/next-job?name=lab-b"))
    await asyncio.sleep(0.3)
    await enqueue(client, host("phone", "cold-start", params=cold,
                               targets={"device_id": "R5CT1234ABC"}))
    resp = await asyncio.wait_for(second, 10)
    assert resp.status == 200 and (await resp.json())["job_id"] == "phone"
    assert not first.done()
    first.cancel()
    # polled directly, the same: lab-a is passed over, the job stays queued for lab-b
    await enqueue(client, host("again", "cold-start", params=cold,
                               targets={"device_id": "R5CT1234ABC"}))
    assert await executor_claim(client, "lab-a") is None
    assert (await (await client.get("/api/jobs/again")).json())["status"] == "queued"
    assert await executor_claim(client, "lab-b", "&slots=2") == "again"
    # a device no executor registered goes to whichever executor asks
    await enqueue(client, host("loose", "cold-start", params=cold,
                               targets={"device_id": "unknown-serial"}))
    assert await executor_claim(client, "lab-a") == "loose"


async def test_pins_that_contradict_an_attachment_are_refused_or_narrowed(collector_factory):
    client = await collector_factory(long_poll_s=0.05)
    for name in ("lab-a", "lab-b"):
        await register(client, name, capabilities=["cold-start"])
        assert await executor_claim(client, name) is None  # seen polling
    assert (await client.post("/devices/register",
                              json=attached_registration("R5CT1234ABC", "lab-b"))).status == 200
    cold = {"app_id": "com.example.shop"}
    # naming the other executor could never be offered: refused, naming both, nothing stored
    refused = await enqueue(client, host("stuck", "cold-start", params=cold, targets={
        "device_id": "R5CT1234ABC", "executor": "lab-a"}), status=400)
    assert "'lab-a'" in refused["error"] and "attached to executor 'lab-b'" in refused["error"]
    assert (await client.get("/jobs/stuck")).status == 404
    # a fan-out for the phone has one child: for the executor it is plugged into
    spec = host("each", "cold-start", params=cold, fanout=True,
                targets={"device_id": "R5CT1234ABC"})
    preview = await (await client.post("/api/jobs/preview-targets", json={
        **spec, "job_id": "preview"})).json()
    assert preview["executors"] == ["lab-b"]
    assert (await enqueue(client, spec))["fanout"] == ["each--lab-b"]
    assert await executor_claim(client, "lab-b") == "each--lab-b"


async def test_a_host_workload_nobody_declares_is_refused_at_enqueue(client):
    spec = host("apk", "build", params={"repo": "shop", "kind": "gradle"})
    refused = await enqueue(client, spec, status=422)
    assert "build:gradle" in refused["error"]
    await register(client, "linux", capabilities=["build:gradle"])
    await enqueue(client, spec)
    assert await executor_claim(client, "linux") == "apk"


async def test_the_last_slots_seen_win_and_a_poll_without_registration_still_works(client):
    assert await executor_claim(client, "bare", "&slots=3") is None
    await register(client, "bare", slots=5)
    bare = (await listed(client))["bare"]
    assert bare["slots"] == 5 and bare["capabilities"] is None
    assert await executor_claim(client, "bare") is None  # says nothing: 5 stands
    assert (await listed(client))["bare"]["slots"] == 5
    assert await executor_claim(client, "bare", "&slots=2") is None
    assert (await listed(client))["bare"]["slots"] == 2



async def test_the_slots_a_poll_says_hold_for_that_same_poll(client):
    """A poll's first look reads the executor's row once, before recording the poll: the slots
    the poll says must still count for its own claim, for a new name and a known one."""
    cold = {"app_id": "com.example.shop"}
    assert await executor_claim(client, "fresh") is None  # seen: no opinion, one slot
    for n in range(4):
        await enqueue(client, host(f"j{n}", "cold-start", params=cold))
    assert await executor_claim(client, "fresh") == "j0"
    assert await executor_claim(client, "fresh") is None  # one slot, held
    assert await executor_claim(client, "fresh", "&slots=2") == "j1"  # said now, counts now
    assert await executor_claim(client, "fresh") is None  # 2 stand, both held
    assert await executor_claim(client, "newcomer", "&slots=2") == "j2"  # a new name, too
    assert await executor_claim(client, "newcomer") == "j3"
    assert (await listed(client))["newcomer"]["slots"] == 2

# -- the listing -------------------------------------------------------------------------------


async def listed(client):
    resp = await client.get("/api/executors")
    assert resp.status == 200
    return {e["name"]: e for e in (await resp.json())["executors"]}


async def test_the_listing_says_what_each_executor_does_and_what_is_attached(
        collector_factory, db_path):
    client = await collector_factory(long_poll_s=30)
    await register(client, "lab", capabilities=["cold-start"], slots=2,
                   agent="fleet_agent 0.9.0")
    await register(client, "old", capabilities=["web-test"])
    await register(client, "quiet", capabilities=["digest"])
    for device_id in ("R5CT1234ABC", "emulator-5554"):
        resp = await client.post("/devices/register", json=attached_registration(device_id, "lab"))
        assert resp.status == 200
    await client.post("/devices/register", json=registration("pi"))  # attached to nobody
    age_rows(db_path, "UPDATE executors SET registered_at = registered_at - 600, "
             "first_seen = first_seen - 600 WHERE name = 'old'")
    age_rows(db_path, "UPDATE executors SET registered_at = registered_at - 120, "
             "first_seen = first_seen - 120 WHERE name = 'quiet'")
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 600 "
             "WHERE device_id = 'emulator-5554'")
    poll = asyncio.create_task(client.get("/executor/next-job?name=lab&slots=2"))
    await asyncio.sleep(0.3)
    seen = await listed(client)
    assert (seen["lab"]["status"], seen["old"]["status"], seen["quiet"]["status"]) == (
        "polling", "offline", "idle")
    assert seen["lab"]["capabilities"] == ["cold-start"] and seen["lab"]["slots"] == 2
    assert seen["lab"]["agent"] == "fleet_agent 0.9.0" and seen["lab"]["jobs"] == []
    assert seen["lab"]["attached"] == [
        {"device_id": "R5CT1234ABC", "status": "online"},
        {"device_id": "emulator-5554", "status": "stale"}]
    assert seen["old"]["attached"] == [] and "pi" not in seen
    await enqueue(client, host("cold", "cold-start", params={"app_id": "com.example.shop"}))
    assert (await asyncio.wait_for(poll, 10)).status == 200
    seen = await listed(client)
    assert seen["lab"]["status"] == "busy"
    assert seen["lab"]["jobs"] == [{"job_id": "cold", "workload": "cold-start"}]



async def test_a_host_fan_out_reaches_only_the_executors_that_would_take_it(collector_factory):
    client = await collector_factory(long_poll_s=0.05)
    await register(client, "web", capabilities=["web-shots"])
    await register(client, "phones", capabilities=["cold-start"])
    for name in ("web", "phones", "never-said"):
        assert await executor_claim(client, name) is None  # seen polling
    reply = await enqueue(client, host("shots", "web-shots", fanout=True,
                                       params={"browser": ["chromium"]}))
    assert reply["fanout"] == ["shots--never-said", "shots--web"]  # not phones: never offered
    preview = await (await client.post("/api/jobs/preview-targets", json={
        "workload": "web-shots", "executor": "host", "fanout": True})).json()
    assert preview["executors"] == ["never-said", "web"]
    assert await executor_claim(client, "web") == "shots--web"


@pytest.mark.parametrize("name", ["mac\u2011mini\u200b", "mac-mini ", " mac-mini", "mac-mini\x00",
                                  "\u202einim-cam", "mac\u00a0mini", "mac-mini\n"])
async def test_an_executor_name_that_would_list_as_a_twin_is_refused(client, name):
    """Jobs target an executor by its exact name and people pick it from a listing: a name
    with an invisible, control or direction-changing character, or a space at an end, would
    show as another's twin. Registration and the poll refuse it alike; nothing is stored."""
    await register(client, "mac-mini")
    refused = await register(client, name, status=400)
    assert "the executor's name" in refused["error"]
    resp = await client.get("/executor/next-job", params={"name": name})
    assert resp.status == 400
    listed = (await (await client.get("/api/executors")).json())["executors"]
    assert [e["name"] for e in listed] == ["mac-mini"]
    # A job pinned to such a name could never be claimed, and would list as the twin's.
    resp = await client.post("/jobs", json=host("twin", "install", app={
        "name": "shelf", "sha256": "a" * 64}, targets={"executor": name}))
    assert resp.status == 400
    assert "targets.executor: the executor's name" in (await resp.json())["error"]
    assert (await client.get("/jobs/twin")).status == 404


async def test_a_job_pinned_to_an_executor_takes_its_names_rules(client):
    await register(client, "mac-mini")
    resp = await client.post("/jobs", json=host("long", "install", app={
        "name": "shelf", "sha256": "a" * 64}, targets={"executor": "x" * 201}))
    assert resp.status == 400 and "1 to 200 characters" in (await resp.json())["error"]
    # An empty name is no pin, as leaving it out is.
    resp = await client.post("/jobs", json=host("any", "install", app={
        "name": "shelf", "sha256": "a" * 64}, targets={"executor": ""}))
    assert resp.status == 201, await resp.text()


# -- forgetting ----------------------------------------------------------------------------------


def silence(db_path, name, seconds=600):
    age_rows(db_path, "UPDATE executors SET first_seen = first_seen - ?, "
             "last_poll = last_poll - ?, registered_at = registered_at - ? WHERE name = ?",
             (seconds, seconds, seconds, name))


async def test_an_executor_that_is_gone_can_be_forgotten_but_not_one_running_a_job(
        client, db_path):
    await register(client, "old-mac", capabilities=["cold-start"])
    await register(client, "lab", capabilities=["cold-start"])
    await enqueue(client, host("running", "cold-start", params={"app_id": "com.example.shop"},
                               targets={"executor": "lab"}))
    assert await executor_claim(client, "lab") == "running"
    silence(db_path, "old-mac")
    silence(db_path, "lab")
    busy = await client.delete("/api/executors/lab")
    assert busy.status == 409
    assert "running" in (await busy.json())["error"]
    resp = await client.delete("/api/executors/old-mac")
    assert resp.status == 200
    assert await resp.json() == {"ok": True, "name": "old-mac", "forgotten": True}
    assert set(await listed(client)) == {"lab"}  # and lab, refused, is unchanged
    assert (await client.delete("/api/executors/old-mac")).status == 404
    assert (await client.delete("/api/executors/%20padded")).status == 400
    # The job it ran stays; a poll under the name starts a new record (no opinion yet).
    assert (await client.get("/api/jobs/running")).status == 200
    assert await executor_claim(client, "old-mac") is None
    assert (await listed(client))["old-mac"]["capabilities"] is None


async def test_a_live_executor_is_not_forgotten(collector_factory, db_path):
    """Forgotten, a live executor's next poll would be a new name's: no declared capabilities,
    offered every host job (a soak job meant for another host) until its agent registers."""
    client = await collector_factory(long_poll_s=3)
    await register(client, "web-host", capabilities=["web-test"])
    await register(client, "soak-host", capabilities=["soak"])
    await enqueue(client, host("soaking", "soak", params={"app_id": "com.example.shop"}))
    assert await executor_claim(client, "web-host") is None  # polled just now
    refused = await client.delete("/api/executors/web-host")
    assert refused.status == 409
    assert "is not gone" in (await refused.json())["error"]
    # Silent by its times, but a poll of its waits now.
    silence(db_path, "web-host")
    waiting = asyncio.create_task(client.get("/executor/next-job?name=web-host"))
    await asyncio.sleep(0.5)
    silence(db_path, "web-host")  # the poll's own sighting, moved back too
    refused = await client.delete("/api/executors/web-host")
    assert refused.status == 409 and "waits now" in (await refused.json())["error"]
    assert (await waiting).status == 204
    assert (await listed(client))["web-host"]["capabilities"] == ["web-test"]
    assert (await (await client.get("/api/jobs/soaking")).json())["status"] == "queued"


async def test_forgetting_an_executor_needs_the_dashboard_token_when_one_is_set(
        collector_factory, monkeypatch, db_path):
    monkeypatch.setenv("FLEET_DASH_TOKEN", "operator-secret")
    client = await collector_factory(dash_token="operator-secret")
    await register(client, "old-mac")
    silence(db_path, "old-mac")
    assert (await client.delete("/api/executors/old-mac")).status == 401
    assert "old-mac" in await listed(client)
    resp = await client.delete("/api/executors/old-mac",
                               headers={"X-Fleet-Token": "operator-secret"})
    assert resp.status == 200 and "old-mac" not in await listed(client)

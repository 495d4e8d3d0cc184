"""Schedules: the API over HTTP against a real collector, and the tick with explicit times
against a real SQLite file (the tick is a transaction function; `now` is its argument)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from datetime import UTC, datetime, timedelta, tzinfo
from pathlib import Path

import pytest

from fleet_min.collector.automation import schedules
from fleet_min.collector.jobs import queue
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.storage.schema import MIGRATIONS
from fleet_min.db import migrate
from fleet_min.errors import BadRequest
from tests.support.collector import CollectorProcess, age_rows, edit_rows, registration
from tests.support.faults import faketime_lib

TEMPLATE = {"schema": 1, "workload": "benchmark", "executor": "device", "backend": "synthetic",
            "params": {"prompt_tokens": 8, "gen_tokens": 8}}
LATEST = {"schema": 1, "workload": "install", "executor": "host",
          "app": {"name": "demo", "sha256": "latest", "platform": "android"}}
SHA = "c" * 64


def ts(*args: int) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()


@pytest.fixture
def quiet_scheduler(monkeypatch):
    """The background tick once at start and then hourly; tests tick by hand. Cron in UTC."""
    monkeypatch.setenv("FLEET_SCHEDULE_TICK_S", "3600")
    monkeypatch.setenv("FLEET_SCHEDULE_TZ", "UTC")


@pytest.fixture
async def api(quiet_scheduler, collector_factory):
    return await collector_factory()


async def create(api, schedule_id="nightly", cron="0 0 1 1 *", template=None):
    resp = await api.post("/api/schedules", json={"id": schedule_id, "cron": cron,
                                                  "template": template or TEMPLATE})
    assert resp.status == 201, await resp.text()
    return await resp.json()


async def enable(api, schedule_id="nightly"):
    resp = await api.patch(f"/api/schedules/{schedule_id}", json={"enabled": True})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def history(api, schedule_id="nightly"):
    resp = await api.get(f"/api/schedules/{schedule_id}/history")
    assert resp.status == 200
    return await resp.json()


async def tick(api):
    resp = await api.post("/schedules/tick")
    assert resp.status == 200
    return await resp.json()


# -- the API -----------------------------------------------------------------------------------


async def test_create_list_get_new_schedules_are_disabled(api):
    created = await create(api, cron="*/15 6-18 * * mon-fri")
    assert set(created) >= {"id", "cron", "enabled", "last_run", "next_run", "template",
                            "last_skip", "created_at", "updated_at"}
    # Disabled: next_run is when it would run if enabled now (the scheduler keeps none).
    assert created["enabled"] is False and created["missed"] is False
    assert created["next_run"] > datetime.now(UTC).strftime("%Y-%m-%dT%H:%M")
    assert created["last_run"] is None and created["template"] == TEMPLATE
    listing = await (await api.get("/api/schedules")).json()
    assert [s["id"] for s in listing["schedules"]] == ["nightly"]
    one = await (await api.get("/api/schedules/nightly")).json()
    assert one == created


@pytest.mark.parametrize(("body", "words"), [
    ({"id": "a", "cron": "61 * * * *", "template": TEMPLATE}, "cron minute: 61 is out of range"),
    ({"id": "a", "cron": "* * *", "template": TEMPLATE}, "needs 5 fields"),
    ({"id": "a", "cron": 5, "template": TEMPLATE}, "cron must be a string"),
    ({"id": "a", "cron": "@daily", "template": {"schema": 1, "executor": "device"}},
     "template: workload"),
    ({"id": "a", "cron": "@daily", "template": [1]}, "template must be a JSON object"),
    ({"id": "a", "cron": "@daily", "template": {**TEMPLATE, "job_id": "x"}},
     "must not carry job_id"),
    ({"id": "a", "cron": "@daily", "template": {**TEMPLATE, "params": {"api_token": "x"}}},
     "looks like a secret"),
    ({"id": "a", "cron": "@daily", "template": {**TEMPLATE, "targets": {"match": "ram_mb >="}}},
     "targets.match"),
    ({"id": "a", "cron": "@daily", "template": {
        **TEMPLATE, "params": {"prompt_tokens": "${jobs.other.metrics.n}"}}}, "depends_on"),
    ({"id": "-a", "cron": "@daily", "template": TEMPLATE}, "id is required"),
    ({"id": "..", "cron": "@daily", "template": TEMPLATE}, "not . or .."),  # /api/schedules/..
    ({"cron": "@daily", "template": TEMPLATE}, "id is required"),
    ({"id": "a", "cron": "@daily", "template": TEMPLATE, "enabled": "yes"}, "true or false"),
    ({"id": "a", "cron": "@daily", "template": TEMPLATE, "colour": 1}, "not a schedule field"),
])
async def test_create_refusals_are_400_and_store_nothing(api, body, words):
    resp = await api.post("/api/schedules", json=body)
    assert resp.status == 400
    assert words in (await resp.json())["error"]
    assert (await (await api.get("/api/schedules")).json()) == {"schedules": []}


async def test_duplicate_id_is_409(api):
    await create(api)
    resp = await api.post("/api/schedules", json={"id": "nightly", "cron": "@daily",
                                                  "template": TEMPLATE})
    assert resp.status == 409


async def test_enable_sets_next_run_and_disable_clears_it(api):
    await create(api, cron="0 0 1 1 *")
    enabled = await enable(api)
    assert enabled["enabled"] is True
    expected = datetime(datetime.now(UTC).year + 1, 1, 1, tzinfo=UTC)
    assert enabled["next_run"] == expected.strftime("%Y-%m-%dT%H:%M:%S.000000Z")
    patched = await (await api.patch("/api/schedules/nightly", json={"cron": "0 0 1 * *"})).json()
    assert patched["cron"] == "0 0 1 * *" and patched["next_run"] < enabled["next_run"]
    disabled = await (await api.patch("/api/schedules/nightly", json={"enabled": False})).json()
    assert disabled["enabled"] is False
    # The listing still says when it would run; the scheduler holds no due minute for it.
    assert disabled["next_run"] == patched["next_run"]


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"cron": "* * * * mon-sun-x"}, 400, "day-of-week"),
    ({"enabled": "yes"}, 400, "enabled must be true or false"),
    ({"template": {"schema": 2, "workload": "x", "executor": "device"}}, 400, "template: schema"),
    ({"id": "renamed"}, 400, "cannot be changed"),
    ({}, 400, "nothing to change"),
])
async def test_patch_refusals_change_nothing(api, body, status, words):
    before = await create(api)
    resp = await api.patch("/api/schedules/nightly", json=body)
    assert resp.status == status
    assert words in (await resp.json())["error"]
    assert await (await api.get("/api/schedules/nightly")).json() == before


async def test_unknown_schedule_is_404_everywhere(api):
    for method, path in [("GET", "/api/schedules/nope"), ("PATCH", "/api/schedules/nope"),
                         ("DELETE", "/api/schedules/nope"), ("POST", "/api/schedules/nope/run"),
                         ("GET", "/api/schedules/nope/history")]:
        resp = await api.request(method, path, json={"enabled": True})
        assert resp.status == 404, (method, path)
        assert "nope" in (await resp.json())["error"]


async def test_create_enabled_sets_next_run(api):
    resp = await api.post("/api/schedules", json={"id": "on", "cron": "@daily",
                                                  "template": TEMPLATE, "enabled": True})
    assert resp.status == 201, await resp.text()
    record = await resp.json()
    tomorrow = datetime.fromtimestamp(datetime.now(UTC).timestamp() + 86400, UTC)
    assert record["enabled"] is True
    assert record["next_run"] == tomorrow.strftime("%Y-%m-%dT00:00:00.000000Z")
    listed = (await (await api.get("/api/schedules")).json())["schedules"]
    assert [s["next_run"] for s in listed] == [record["next_run"]]


async def test_the_original_routes_create_replace_toggle_and_delete(api, db_path):
    bad = await api.post("/schedules", json={"id": "old", "cron": "not a cron", "template": {}})
    assert bad.status == 400 and "cron" in (await bad.json())["error"]
    assert await (await api.get("/schedules")).json() == []
    resp = await api.post("/schedules", json={"id": "old", "cron": "* * * * *",
                                              "enabled": True, "template": TEMPLATE})
    assert resp.status == 201, await resp.text()
    created = await resp.json()
    assert created["ok"] is True and created["id"] == "old" and created["enabled"] is True
    age_rows(db_path, "UPDATE schedules SET next_run = ?", (ts(2026, 1, 1),))
    fired = (await tick(api))["fired"]  # the latest due minute only
    assert len(fired) == 1 and fired[0]["job_id"].startswith("old-2026")
    off = await api.patch("/schedules/old", json={"enabled": False})
    assert off.status == 200
    assert (await off.json())["ok"] is True and (await off.json())["enabled"] is False
    listed = await (await api.get("/schedules")).json()
    assert [(s["id"], s["enabled"], s["missed"]) for s in listed] == [("old", False, False)]
    assert isinstance(listed[0]["next_run"], str)
    # The same id again replaces its cron and template (the original's upsert): 200, not 409.
    again = await api.post("/schedules", json={"id": "old", "cron": "@hourly",
                                               "template": TEMPLATE})
    assert again.status == 200
    assert (await again.json())["cron"] == "@hourly"
    gone = await api.delete("/schedules/old")
    assert gone.status == 200 and (await gone.json())["ok"] is True
    assert (await api.delete("/schedules/old")).status == 404
    assert (await api.patch("/schedules/old", json={"enabled": True})).status == 404


async def test_a_listing_says_which_schedules_are_missed(api, db_path):
    await create(api, "late")
    await enable(api, "late")
    await create(api, "idle")
    fresh = {s["id"]: s["missed"] for s in (await (await api.get("/api/schedules")).json())[
        "schedules"]}
    assert fresh == {"idle": False, "late": False}
    # Due ten minutes ago and not run (the scheduler was stopped): missed, with the reason.
    age_rows(db_path, "UPDATE schedules SET next_run = ? WHERE id = 'late'",
             (datetime.now(UTC).timestamp() - 600,))
    listed = {s["id"]: s for s in (await (await api.get("/api/schedules")).json())["schedules"]}
    assert listed["late"]["missed"] is True and "has not run" in listed["late"]["missed_detail"]
    assert listed["idle"]["missed"] is False and listed["idle"]["missed_detail"] is None
    one = await (await api.get("/api/schedules/late")).json()
    assert one["missed"] is True


async def test_tick_fires_the_due_minute_once(api, db_path):
    await create(api)
    await enable(api)
    age_rows(db_path, "UPDATE schedules SET next_run = ?", (ts(2026, 1, 1),))
    first = await tick(api)
    assert first["fired"] == [{"schedule_id": "nightly", "slot": "202601010000",
                               "job_id": "nightly-202601010000", "status": "queued"}]
    assert first["missed"] == 0
    assert (await tick(api))["fired"] == []
    job = await (await api.get("/jobs/nightly-202601010000")).json()
    assert job["template_id"] == "nightly" and job["workload"] == "benchmark"
    record = await (await api.get("/api/schedules/nightly")).json()
    assert record["last_run"] is not None and record["last_slot"] == "2026-01-01T00:00:00.000000Z"
    assert record["next_run"] > record["last_slot"]
    # A clock stepped back (next_run behind again) never refires a handled minute.
    age_rows(db_path, "UPDATE schedules SET next_run = ?", (ts(2026, 1, 1),))
    assert (await tick(api))["fired"] == []
    got = await history(api)
    assert [j["job_id"] for j in got["jobs"]] == ["nightly-202601010000"]
    assert [(r["slot"], r["outcome"]) for r in got["runs"]] == [("202601010000", "enqueued")]


async def test_runs_whose_workload_needs_the_registry_read_off_the_loop_fire(api, db_path):
    """A run's check that a registered device declares its workload reads at most
    queue.CHECK_IN_TRANSACTION devices inside the tick's transaction; past them the run is held
    back, the registry read on a worker thread, and the tick run again, with the answers of a
    whole read: fired when a device past them declares it, failed when none does. A run by
    hand the same. (Inside the tick, a thousand schedules of a workload nobody declares held
    the event loop for minutes at 25,000 devices registered at their limits.)"""
    for i in range(queue.CHECK_IN_TRANSACTION + 8):
        resp = await api.post("/devices/register", json=registration(f"crowd-{i}",
                                                                       capabilities=["other"]))
        assert resp.status == 200
    resp = await api.post("/devices/register", json=registration(
        "late", capabilities=["sched-rare"]))
    assert resp.status == 200
    for schedule_id, workload in (("rare", "sched-rare"), ("nobody", "sched-nobody")):
        await create(api, schedule_id, template={"schema": 1, "workload": workload,
                                                 "executor": "device"})
        await enable(api, schedule_id)
    # A fan-out's targets are chosen off the loop too, once the registry is past a shelf.
    await create(api, "fan", template={"schema": 1, "workload": "sched-rare",
                                       "executor": "device", "fanout": True})
    await enable(api, "fan")
    age_rows(db_path, "UPDATE schedules SET next_run = ?", (ts(2026, 1, 1),))
    report = await tick(api)
    assert report["fired"] == [
        {"schedule_id": "fan", "slot": "202601010000", "job_id": "fan-202601010000",
         "status": "queued"},
        {"schedule_id": "rare", "slot": "202601010000", "job_id": "rare-202601010000",
         "status": "queued"}], report
    listed = await (await api.get("/api/jobs")).json()
    assert sorted(j["job_id"] for j in listed["jobs"] if j["job_id"].startswith("fan-")) == [
        "fan-202601010000", "fan-202601010000--late"], listed
    assert [(f["schedule_id"], f["slot"]) for f in report["failed"]] == [
        ("nobody", "202601010000")]
    assert "'sched-nobody'" in report["failed"][0]["error"]
    assert report["deferred"] == [] and "unread" not in report
    assert (await tick(api))["fired"] == []
    resp = await api.post("/api/schedules/rare/run")
    assert resp.status == 201 and (await resp.json())["outcome"] == "enqueued"
    resp = await api.post("/api/schedules/nobody/run")
    assert resp.status == 422 and "'sched-nobody'" in (await resp.json())["error"]


async def test_after_downtime_only_the_latest_due_minute_fires(api, db_path):
    await create(api)
    await enable(api)
    age_rows(db_path, "UPDATE schedules SET next_run = ?", (ts(2020, 1, 1),))
    result = await tick(api)
    assert [f["slot"] for f in result["fired"]] == ["202601010000"]
    assert result["missed"] == 6
    got = await history(api)
    assert len(got["jobs"]) == 1
    outcomes = {r["slot"]: r["outcome"] for r in got["runs"]}
    assert outcomes == {"202601010000": "enqueued", **{f"{y}01010000": "skipped"
                                                       for y in range(2020, 2026)}}
    fired = next(r for r in got["runs"] if r["outcome"] == "enqueued")
    assert "6 earlier due minutes were missed" in fired["detail"]


async def test_at_most_once_across_a_restart(quiet_scheduler, collector_factory, db_path):
    first = await collector_factory()
    await create(first)
    await enable(first)
    age_rows(db_path, "UPDATE schedules SET next_run = ?", (ts(2026, 1, 1),))
    assert len((await tick(first))["fired"]) == 1
    await first.close()
    # Pretend the restart lost track of next_run: the recorded slot still holds.
    age_rows(db_path, "UPDATE schedules SET next_run = ?", (ts(2026, 1, 1),))
    second = await collector_factory()
    assert (await tick(second))["fired"] == []
    assert len((await history(second))["jobs"]) == 1


async def test_latest_with_no_published_build_is_skipped_not_failed(api, db_path):
    await create(api, template=LATEST)
    await enable(api)
    age_rows(db_path, "UPDATE schedules SET next_run = ?", (ts(2026, 1, 1),))
    result = await tick(api)
    assert result["fired"] == [] and result["failed"] == []
    assert result["skipped"][0]["slot"] == "202601010000"
    assert "no published build of app 'demo'" in result["skipped"][0]["reason"]
    record = await (await api.get("/api/schedules/nightly")).json()
    assert "x-artifact-app: demo" in record["last_skip"]
    runs = (await history(api))["runs"]
    assert [(r["outcome"], r["job_id"]) for r in runs] == [("skipped", None)]
    # Run now says the same, with 200 and nothing enqueued.
    resp = await api.post("/api/schedules/nightly/run")
    assert resp.status == 200
    assert (await resp.json())["outcome"] == "skipped"


async def test_latest_resolves_to_the_newest_published_build(api, db_path):
    await create(api, template=LATEST)
    await enable(api)
    age_rows(db_path, "INSERT INTO artifacts (sha256, size, created_at, app) "
             "VALUES (?, 1, 1, 'demo')", (SHA,))
    age_rows(db_path, "UPDATE schedules SET next_run = ?", (ts(2026, 1, 1),))
    fired = (await tick(api))["fired"]
    job = await (await api.get(f"/jobs/{fired[0]['job_id']}")).json()
    assert job["spec"]["app"]["sha256"] == SHA
    assert (await (await api.get("/api/schedules/nightly")).json())["last_skip"] is None


async def test_an_enqueue_refusal_is_recorded_as_failed(api, db_path):
    # No agent declares "batch": POST /jobs would answer 422; the tick records it.
    await create(api, template={"schema": 1, "workload": "batch", "executor": "device"})
    await enable(api)
    age_rows(db_path, "UPDATE schedules SET next_run = ?", (ts(2026, 1, 1),))
    result = await tick(api)
    assert result["failed"][0]["slot"] == "202601010000"
    assert "capability 'batch'" in result["failed"][0]["error"]
    runs = (await history(api))["runs"]
    assert runs[0]["outcome"] == "failed" and runs[0]["job_id"] is None
    assert (await (await api.get("/api/jobs")).json())["total"] == 0


async def test_run_now_works_while_disabled(api):
    await create(api)
    resp = await api.post("/api/schedules/nightly/run")
    assert resp.status == 201
    reply = await resp.json()
    assert reply["outcome"] == "enqueued" and reply["status"] == "queued"
    assert reply["job_id"].startswith("nightly-manual-") and len(reply["job_id"]) == 29
    job = await (await api.get(f"/jobs/{reply['job_id']}")).json()
    assert job["template_id"] == "nightly"
    got = await history(api)
    assert got["runs"][0]["slot"] == "manual-" + reply["job_id"][-14:]
    assert got["runs"][0]["job_status"] == "queued"
    assert (await (await api.get("/api/schedules/nightly")).json())["last_run"] is not None


async def test_delete_forgets_the_schedule_and_keeps_its_jobs(api):
    await create(api)
    job_id = (await (await api.post("/api/schedules/nightly/run")).json())["job_id"]
    resp = await api.delete("/api/schedules/nightly")
    assert await resp.json() == {"ok": True, "id": "nightly", "deleted": True}
    assert (await api.get("/api/schedules/nightly")).status == 404
    assert (await api.get(f"/jobs/{job_id}")).status == 200


async def test_schedule_events_reach_the_stream(api, db_path):
    stream = await api.get("/api/stream")
    await create(api)
    seen: list[dict] = []

    async def read_until_created():
        async for line in stream.content:
            if line.startswith(b"data:"):
                seen.append(json.loads(line[5:]))
                if seen[-1].get("type") == "schedule":
                    return

    await asyncio.wait_for(read_until_created(), 10)
    stream.close()
    assert seen[-1]["schedule_id"] == "nightly" and seen[-1]["action"] == "created"


async def test_the_background_tick_fires_without_being_asked(monkeypatch, collector_factory,
                                                             db_path):
    monkeypatch.setenv("FLEET_SCHEDULE_TICK_S", "0.2")
    monkeypatch.setenv("FLEET_SCHEDULE_TZ", "UTC")
    api = await collector_factory()
    await create(api)
    await enable(api)
    age_rows(db_path, "UPDATE schedules SET next_run = ?", (ts(2026, 1, 1),))
    for _ in range(200):
        if (await history(api))["jobs"]:
            break
        await asyncio.sleep(0.05)
    assert [j["job_id"] for j in (await history(api))["jobs"]] == ["nightly-202601010000"]


# -- a cron with no due minute within the horizon the cron module searches ----------------------

# On 2026-11-27 the next Sunday November 1st is in 2037, past that horizon (nine years). Whether
# a cron comes round in time depends on the date, so the collector runs as a real process under
# libfaketime at a fixed moment: the in-process app reads the real clock.
FAR_NOW = "2026-11-27 12:00:00"
FAR_CRON = "0 0 */31 11 */7"
FAR_WORDS = f"cron {FAR_CRON!r} has no due minute in the next nine years"


@pytest.fixture
def far_collector(tmp_path: Path):
    lib = faketime_lib()
    if lib is None:
        pytest.skip("libfaketime is not installed (apt-get install faketime)")
    proc = CollectorProcess(tmp_path / "data", env={
        "LD_PRELOAD": lib, "FAKETIME": f"@{FAR_NOW}", "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FLEET_SCHEDULE_TZ": "UTC", "FLEET_SCHEDULE_TICK_S": "3600"})
    proc.start()
    try:
        yield proc.client
    finally:
        proc.stop()


def test_enabling_a_cron_with_no_due_minute_in_range_is_400_and_changes_nothing(far_collector):
    client = far_collector
    assert client.get("/api/health")[1]["now"].startswith("2026-11-27T12:")
    body = {"id": "rare", "cron": FAR_CRON, "template": TEMPLATE, "enabled": True}
    for path in ("/api/schedules", "/schedules"):
        status, reply = client.post(path, body)
        assert status == 400, (path, status, reply)
        assert FAR_WORDS in reply["error"] and "cannot be enabled" in reply["error"]
    assert client.get("/api/schedules")[1] == {"schedules": []}
    # Disabled it waits for no minute, so it is stored; enabling it is refused.
    status, stored = client.post("/api/schedules", {**body, "enabled": False})
    assert status == 201 and stored["enabled"] is False and stored["next_run"] is None
    status, reply = client.request("PATCH", "/api/schedules/rare", {"enabled": True})
    assert status == 400 and FAR_WORDS in reply["error"]
    status, reply = client.post("/schedules", body)  # the original's replace
    assert status == 400 and FAR_WORDS in reply["error"]
    assert client.get("/api/schedules/rare")[1] == stored
    # An enabled schedule's cron cannot be changed to it either.
    daily = {"id": "daily", "cron": "@daily", "template": TEMPLATE, "enabled": True}
    status, before = client.post("/api/schedules", daily)
    assert status == 201
    status, reply = client.request("PATCH", "/api/schedules/daily", {"cron": FAR_CRON})
    assert status == 400 and FAR_WORDS in reply["error"]
    assert client.get("/api/schedules/daily")[1] == before


# -- the tick with explicit times (a real SQLite file, no HTTP) ----------------------------------


@pytest.fixture
def conn(tmp_path: Path):
    connection = sqlite3.connect(tmp_path / "ticks.sqlite3", isolation_level=None)
    connection.row_factory = sqlite3.Row
    migrate(connection, MIGRATIONS)
    yield connection
    connection.close()


def in_transaction(conn, fn, *args, **kwargs):
    """As the collector's writer runs a transaction function: one BEGIN ... COMMIT."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = fn(conn, *args, **kwargs)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return result


def make(conn, cron: str, now: float, schedule_id: str = "s") -> None:
    effects = Effects()
    in_transaction(conn, schedules.create, {"id": schedule_id, "cron": cron,
                                            "template": TEMPLATE}, now, effects)
    in_transaction(conn, schedules.update, schedule_id, {"enabled": True}, now, effects,
                   view=schedules.View(now, UTC))


def run_tick(conn, now: float) -> schedules.TickReport:
    return in_transaction(conn, schedules.tick, now, Effects(), tz=UTC)


def job_ids(conn) -> list[str]:
    return [r[0] for r in conn.execute("SELECT job_id FROM jobs ORDER BY seq")]


def test_each_due_minute_fires_once_and_a_clock_jump_back_refires_nothing(conn):
    start = ts(2026, 6, 1, 12, 0, 30)
    make(conn, "*/5 * * * *", start)
    assert run_tick(conn, start + 200).fired == []            # 12:03:50, nothing due yet
    assert [f["slot"] for f in run_tick(conn, start + 270).fired] == ["202606011205"]
    assert run_tick(conn, start + 290).fired == []            # the same minute again
    assert run_tick(conn, start - 3600).fired == []           # the clock stepped back an hour
    assert run_tick(conn, start + 280).fired == []            # and forward to the handled minute
    assert [f["slot"] for f in run_tick(conn, start + 570).fired] == ["202606011210"]
    assert job_ids(conn) == ["s-202606011205", "s-202606011210"]


def test_enabling_mid_minute_does_not_fire_that_minute(conn):
    start = ts(2026, 6, 1, 12, 0, 30)
    make(conn, "* * * * *", start)
    assert run_tick(conn, start + 10).fired == []
    assert [f["slot"] for f in run_tick(conn, start + 30).fired] == ["202606011201"]


def test_three_days_down_fires_one_job_and_records_the_rest(conn):
    start = ts(2026, 6, 1, 12, 0, 30)
    make(conn, "*/15 * * * *", start)
    report = run_tick(conn, start + 3 * 86400)
    assert [f["slot"] for f in report.fired] == ["202606041200"]
    assert report.missed == 3 * 96 - 1
    skipped = conn.execute("SELECT COUNT(*) FROM schedule_runs WHERE outcome = 'skipped'"
                           ).fetchone()[0]
    assert skipped == schedules.MISSED_RECORDED
    assert job_ids(conn) == ["s-202606041200"]


def test_a_year_down_with_a_minutely_schedule_is_no_storm(conn):
    start = ts(2025, 6, 1, 12, 0, 30)
    make(conn, "* * * * *", start)
    report = run_tick(conn, ts(2026, 6, 1, 12, 0, 30))
    assert [f["slot"] for f in report.fired] == ["202606011200"]
    assert report.missed == schedules.MISSED_COUNTED
    fired = conn.execute("SELECT detail FROM schedule_runs WHERE outcome = 'enqueued'").fetchone()
    assert fired["detail"].startswith(f"more than {schedules.MISSED_COUNTED} earlier")


def test_a_refused_enqueue_leaves_no_job_and_no_effects(conn):
    now = ts(2026, 6, 1, 12, 0, 30)
    effects = Effects()
    in_transaction(conn, schedules.create, {"id": "b", "cron": "* * * * *", "template": {
        "schema": 1, "workload": "batch", "executor": "device"}}, now, effects)
    in_transaction(conn, schedules.update, "b", {"enabled": True}, now, effects,
                   view=schedules.View(now, UTC))
    effects = Effects()
    report = in_transaction(conn, schedules.tick, now + 60, effects, tz=UTC)
    assert len(report.failed) == 1 and job_ids(conn) == []
    assert [e["action"] for e in effects.events] == ["failed"] and effects.claimable == []


# 2026-03-01 is a Sunday and the next Sunday March 1st is in 2037, past the nine years the cron
# module searches: this schedule's due minute at 2026-03-01 00:00 is the last one in range.
LAST_IN_RANGE = "0 0 */31 3 */7"
BEFORE_IT = ts(2026, 2, 28, 23, 59, 20)


def record(conn, schedule_id: str, now: float) -> dict:
    row = conn.execute(schedules.SELECT + " WHERE s.id = ?", (schedule_id,)).fetchone()
    return schedules.schedule_record(row, schedules.View(now, UTC))


def test_a_schedule_past_its_last_due_minute_in_range_stops_alone(conn):
    make(conn, LAST_IN_RANGE, BEFORE_IT, "rare")
    make(conn, "* * * * *", BEFORE_IT, "every")
    effects = Effects()
    report = in_transaction(conn, schedules.tick, ts(2026, 3, 1, 0, 0, 30), effects, tz=UTC)
    # Its one due minute fires; then it holds no next_run and says why.
    assert sorted(f["job_id"] for f in report.fired) == ["every-202603010000",
                                                         "rare-202603010000"]
    rare = record(conn, "rare", ts(2026, 3, 1, 0, 0, 30))
    assert rare["enabled"] is True and rare["next_run"] is None
    assert rare["last_slot"] == "2026-03-01T00:00:00.000000Z"
    assert f"cron {LAST_IN_RANGE!r} has no due minute in the next nine years" in rare["last_skip"]
    assert "stopped" in rare["last_skip"]
    assert {"type": "schedule", "schedule_id": "rare", "action": "stopped"} in effects.events
    # The next ticks go on with the others.
    assert [f["job_id"] for f in run_tick(conn, ts(2026, 3, 1, 0, 1, 30)).fired] == [
        "every-202603010001"]
    assert [f["job_id"] for f in run_tick(conn, ts(2026, 3, 1, 0, 2, 30)).fired] == [
        "every-202603010002"]
    assert record(conn, "every", ts(2026, 3, 1, 0, 2, 30))["next_run"] == (
        "2026-03-01T00:03:00.000000Z")
    assert job_ids(conn) == ["every-202603010000", "rare-202603010000", "every-202603010001",
                             "every-202603010002"]


def test_enabling_a_stopped_schedule_again_rearms_it_or_says_why(conn):
    make(conn, LAST_IN_RANGE, BEFORE_IT, "rare")
    run_tick(conn, ts(2026, 3, 1, 0, 0, 30))
    before = record(conn, "rare", ts(2026, 3, 2))
    with pytest.raises(BadRequest, match="no due minute in the next nine years"):
        in_transaction(conn, schedules.update, "rare", {"enabled": True}, ts(2026, 3, 2),
                       Effects(), view=schedules.View(ts(2026, 3, 2), UTC))
    assert record(conn, "rare", ts(2026, 3, 2)) == before
    # Once 2037 comes within range, enabling it again holds that due minute.
    later = ts(2029, 1, 1)
    rearmed = in_transaction(conn, schedules.update, "rare", {"enabled": True}, later,
                             Effects(), view=schedules.View(later, UTC))
    assert rearmed["next_run"] == "2037-03-01T00:00:00.000000Z"


def test_a_day_of_due_minutes_down_then_none_in_range_fires_the_last_and_stops(conn):
    # Every minute of that one Sunday, and the collector down through all of it: the catch-up
    # search meets the end of the range too.
    make(conn, "* * */31 3 */7", BEFORE_IT, "rare")
    make(conn, "0 * * * *", BEFORE_IT, "hourly")
    report = run_tick(conn, ts(2026, 3, 2, 0, 0, 30))
    assert sorted(f["job_id"] for f in report.fired) == ["hourly-202603020000",
                                                         "rare-202603012359"]
    assert report.missed == schedules.MISSED_COUNTED + 24
    rare = record(conn, "rare", ts(2026, 3, 2, 0, 0, 30))
    assert rare["next_run"] is None and "no due minute" in rare["last_skip"]


def test_slots_are_utc_minutes():
    assert schedules.slot_of(ts(2026, 12, 31, 23, 59, 59)) == "202612312359"
    assert schedules.slot_time("202612312359") == ts(2026, 12, 31, 23, 59)
    assert schedules.slot_time("manual-20261231235959") is None


class CountingUTC(tzinfo):
    """UTC, counting the wall-clock conversions asked of it: next_after makes one or two for
    each candidate minute it looks at, so this counts the cron work a tick or a listing does."""

    def __init__(self) -> None:
        self.conversions = 0

    def utcoffset(self, dt):
        return timedelta(0)

    def dst(self, dt):
        return timedelta(0)

    def tzname(self, dt):
        return "UTC"

    def fromutc(self, dt):
        self.conversions += 1
        return dt + timedelta(0)


RARE = "0 0 29 2 */7"  # 29 February on a Sunday: next in 2032


def make_in(conn, zone: tzinfo, cron: str, now: float, schedule_id: str,
            enabled: bool = True) -> None:
    view = schedules.View(now, zone)
    in_transaction(conn, schedules.create, {"id": schedule_id, "cron": cron,
                                            "template": TEMPLATE, "enabled": enabled},
                   now, Effects(), view=view)


def test_a_tick_with_nothing_due_computes_no_cron(conn):
    # Every schedule's next due minute was recomputed on every tick (3,000 of '0 0 29 2 */7'
    # held the loop 5.9 s a tick); a next_run computed at or before now is already the next
    # due minute, so only a clock set back (or another zone) makes the tick look again.
    zone, start = CountingUTC(), ts(2026, 11, 27, 12, 0, 30)
    for i in range(200):
        make_in(conn, zone, RARE, start, f"rare{i:03d}")
    make_in(conn, zone, "0 * * * *", start, "hourly")
    zone.conversions = 0
    for later in (start + 20, start + 40, start + 600, start + 1800):
        assert run_zone_tick(conn, later, zone).fired == []
    assert zone.conversions == 0
    # The hourly one fires and moves on: its own cron is read, not the 200 others'.
    assert [f["schedule_id"] for f in run_zone_tick(conn, start + 3600, zone).fired] == [
        "hourly"]
    assert 0 < zone.conversions <= 40


def test_a_clock_set_back_still_brings_next_run_back(conn):
    zone, start = CountingUTC(), ts(2026, 11, 27, 12, 0, 30)
    make_in(conn, zone, "0 * * * *", start, "hourly")
    assert record(conn, "hourly", start)["next_run"] == "2026-11-27T13:00:00.000000Z"
    run_zone_tick(conn, start - 2 * 3600, zone)  # 10:00:30
    assert record(conn, "hourly", start)["next_run"] == "2026-11-27T11:00:00.000000Z"
    assert [f["slot"] for f in run_zone_tick(conn, ts(2026, 11, 27, 11, 0, 10), zone).fired] == [
        "202611271100"]


def test_listing_disabled_rare_schedules_costs_a_few_conversions_each(conn):
    zone, start = CountingUTC(), ts(2026, 11, 27, 12, 0, 30)
    for i in range(100):
        make_in(conn, zone, RARE, start, f"off{i:03d}", enabled=False)
    zone.conversions = 0
    rows = conn.execute(schedules.SELECT + " ORDER BY s.id").fetchall()
    listed = [schedules.schedule_record(row, schedules.View(start, zone)) for row in rows]
    assert {r["next_run"] for r in listed} == {"2032-02-29T00:00:00.000000Z"}
    assert zone.conversions <= 100 * 10


def run_zone_tick(conn, now: float, zone: tzinfo) -> schedules.TickReport:
    return in_transaction(conn, schedules.tick, now, Effects(), tz=zone)


async def test_a_collector_holds_at_most_max_schedules(api, db_path):
    await create(api, "s0000")
    # The rest written straight into the file, as many creates would leave them.
    edit_rows(db_path, "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n "
              "WHERE i < ?) INSERT INTO schedules (id, cron, enabled, template, created_at, "
              "updated_at) SELECT printf('s%04d', i), cron, 0, template, created_at, updated_at "
              "FROM n, schedules WHERE schedules.id = 's0000'", (schedules.MAX_SCHEDULES - 1,))
    before = await (await api.get("/api/schedules")).json()
    assert len(before["schedules"]) == schedules.MAX_SCHEDULES
    for path in ("/api/schedules", "/schedules"):
        resp = await api.post(path, json={"id": "one-more", "cron": "@daily",
                                          "template": TEMPLATE, "enabled": True})
        assert resp.status == 409
        error = (await resp.json())["error"]
        assert f"holds {schedules.MAX_SCHEDULES} schedules" in error
        assert "delete one" in error
    assert await (await api.get("/api/schedules")).json() == before
    # Replacing one that exists is no new schedule, and deleting one makes room.
    resp = await api.post("/schedules", json={"id": "s0001", "cron": "@daily",
                                              "template": TEMPLATE})
    assert resp.status == 200
    assert (await api.delete("/api/schedules/s0002")).status == 200
    await create(api, "one-more")


def clone_device(db_path: Path, device_id: str, count: int) -> None:
    """`count` copies of a registered device's row, written straight into the file (a shelf
    that large registering one by one would make the test a benchmark)."""
    conn = sqlite3.connect(db_path, timeout=30)
    try:
        conn.row_factory = sqlite3.Row
        row = dict(conn.execute("SELECT * FROM devices WHERE device_id = ?", (device_id,))
                   .fetchone())
        columns = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        conn.executemany(f"INSERT INTO devices ({columns}) VALUES ({marks})",
                         [tuple({**row, "device_id": f"{device_id}-{i:04d}"}.values())
                          for i in range(count)])
        conn.commit()
    finally:
        conn.close()


def count_jobs(db_path: Path) -> int:
    conn = sqlite3.connect(db_path, timeout=30)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])
    finally:
        conn.close()


async def test_one_tick_creates_at_most_the_request_budget_and_defers_the_rest(api, db_path):
    # Six fan-outs due in the same minute over 2,100 devices are 12,606 jobs: one tick wrote
    # them all in one transaction (50 such schedules over 2,000 devices: 100,000 jobs, every
    # minute). The tick has one budget, queue.MAX_JOBS_PER_REQUEST: the runs that would pass
    # it wait for the next tick, first in line, and nothing is recorded for them meanwhile.
    resp = await api.post("/devices/register", json={"device_id": "d", "platform": "linux"})
    assert resp.status in (200, 201), await resp.text()
    clone_device(db_path, "d", 2099)
    for i in range(6):
        await create(api, f"fan{i}", "0 0 1 1 *", {**TEMPLATE, "fanout": True})
        await enable(api, f"fan{i}")
    age_rows(db_path, "UPDATE schedules SET next_run = ?", (ts(2026, 1, 1),))
    per_run = 2100 + 1  # the children and their parent
    first = await tick(api)
    assert [f["schedule_id"] for f in first["fired"]] == ["fan0", "fan1", "fan2", "fan3"]
    assert [d["schedule_id"] for d in first["deferred"]] == ["fan4", "fan5"]
    assert all(d["slot"] == "202601010000" and "next tick" in d["reason"]
               and "10000" in d["reason"] for d in first["deferred"])
    assert count_jobs(db_path) == 4 * per_run <= schedules.queue.MAX_JOBS_PER_REQUEST
    held = await (await api.get("/api/schedules/fan4")).json()
    assert held["last_skip"].startswith("deferred") and held["last_slot"] is None
    assert (await history(api, "fan4"))["runs"] == []
    second = await tick(api)
    assert [f["schedule_id"] for f in second["fired"]] == ["fan4", "fan5"]
    assert second["deferred"] == [] and second["failed"] == []
    assert count_jobs(db_path) == 6 * per_run
    ran = await (await api.get("/api/schedules/fan4")).json()
    assert ran["last_skip"] is None and ran["last_slot"] == "2026-01-01T00:00:00.000000Z"
    assert (await tick(api))["fired"] == []


async def test_a_template_past_its_bound_is_413_and_changes_nothing(api):
    """Listings carry every schedule's template whole, so one is at most MAX_TEMPLATE_BYTES."""
    big = {**TEMPLATE, "params": {**TEMPLATE["params"], "note": "x" * schedules.MAX_TEMPLATE_BYTES}}
    for path in ("/api/schedules", "/schedules"):
        resp = await api.post(path, json={"id": "big", "cron": "@daily", "template": big})
        assert resp.status == 413, path
        assert f"at most {schedules.MAX_TEMPLATE_BYTES}" in (await resp.json())["error"]
    await create(api)
    before = await (await api.get("/api/schedules")).json()
    resp = await api.patch("/api/schedules/nightly", json={"template": big})
    assert resp.status == 413
    assert await (await api.get("/api/schedules")).json() == before

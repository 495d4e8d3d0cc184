"""Alerts: the pure rules with explicit times, the open/seen/resolved state machine, ack and
snooze over HTTP against a real collector, and the webhook against a real local receiver."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from aiohttp import web

from fleet_min.collector.automation import alerts
from fleet_min.collector.automation.alerts import Sizes, Thresholds
from fleet_min.collector.automation.webhook import MAX_BACKOFF_S, backoff
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.storage.schema import MIGRATIONS
from fleet_min.db import migrate
from tests.support.collector import (
    CollectorProcess,
    age_rows,
    beacon,
    free_port,
    job,
    registration,
    result_row,
)

NOW = 1_800_000_000.0
TH = Thresholds()


def device(device_id="d1", name="Pixel 7", seen_ago=0.0, ttl_s=None, beacon_ago=None,
           **fields):
    return {"device_id": device_id, "name": name, "last_seen": NOW - seen_ago, "ttl_s": ttl_s,
            "last_beacon_at": None if beacon_ago is None else NOW - beacon_ago,
            "last_beacon": json.dumps(fields) if beacon_ago is not None else None}


def subjects(findings):
    return [(f.rule, f.subject) for f in findings]


# -- the rules, pure -----------------------------------------------------------------------------


def test_offline_only_for_named_devices_past_fifteen_minutes():
    devices = [device("named", seen_ago=901), device("fresh", seen_ago=899),
               device("anon", name=None, seen_ago=5000), device("blank", name="  ",
                                                                 seen_ago=5000),
               device("gone-temp", seen_ago=5000, ttl_s=600)]
    found = alerts.device_offline(devices, NOW, TH)
    assert subjects(found) == [("device-offline", "named")]
    assert "Pixel 7 (named) has not been seen for over 15 min (last seen 20" in found[0].detail


def test_an_open_findings_detail_holds_still_while_it_stays_true():
    """A tick rewrites a detail that changed, so a detail that counted the minutes rewrote
    every offline device's row each minute."""
    later = NOW + 3600
    offline = [device("named", seen_ago=901)]
    stuck = [claimed_job("stuck", lease_deadline=later + 60)]
    assert [f.detail for f in alerts.device_offline(offline, NOW, TH)] == [
        f.detail for f in alerts.device_offline(offline, later, TH)]
    assert [f.detail for f in alerts.job_stuck(stuck, NOW, TH)] == [
        f.detail for f in alerts.job_stuck(stuck, later, TH)]
    [detail] = [f.detail for f in alerts.job_stuck(stuck, NOW, TH)]
    assert "has run for over 20 min (claimed 20" in detail


def test_thermal_serious_or_worse_on_a_fresh_beacon():
    devices = [device("hot", beacon_ago=10, thermal="critical"),
               device("ios", beacon_ago=10, thermal="Serious"),
               device("ok", beacon_ago=10, thermal="nominal"),
               device("moderate", beacon_ago=10, thermal="moderate"),
               device("stale", beacon_ago=901, thermal="critical"),
               device("number", beacon_ago=10, thermal=4),
               device("anon", name=None, beacon_ago=10, thermal="shutdown")]
    assert subjects(alerts.thermal_critical(devices, NOW, TH)) == [
        ("thermal-critical", "hot"), ("thermal-critical", "ios"), ("thermal-critical", "anon")]
    only_critical = replace(TH, thermal_states=frozenset({"critical"}))
    assert [f.subject for f in alerts.thermal_critical(devices, NOW, only_critical)] == ["hot"]


def test_low_battery_under_fifteen_and_not_charging():
    devices = [device("low", beacon_ago=10, battery_pct=9, charging=False),
               device("unsaid", beacon_ago=10, battery_pct=14.5),
               device("plugged", beacon_ago=10, battery_pct=3, charging=True),
               device("edge", beacon_ago=10, battery_pct=15, charging=False),
               device("bool", beacon_ago=10, battery_pct=True, charging=False),
               device("stale", beacon_ago=1000, battery_pct=2, charging=False)]
    found = alerts.low_battery(devices, NOW, TH)
    assert [f.subject for f in found] == ["low", "unsaid"]
    assert "9% battery" in found[0].detail


def test_the_device_rules_read_the_same_from_sqlites_readings_of_a_large_beacon():
    """The tick and the overview read a device's battery and thermal state through
    alerts.DEVICES_SQL, which takes them out of the stored beacon in SQLite rather than handing
    16 KiB of beacon per device to Python (6,000 of them held the event loop 3 s at each tick).
    Every case of the two rules above, padded to 16 KiB, gives the same findings, through a
    real database of the collector's schema, and the rows carry only the readings."""
    import sqlite3

    from fleet_min.collector.storage.schema import MIGRATIONS
    from fleet_min.db import migrate

    cases = [device("hot", beacon_ago=10, thermal="critical"),
             device("ios", beacon_ago=10, thermal="Serious"),
             device("number", beacon_ago=10, thermal=4),
             device("nested", beacon_ago=10, thermal={"state": "critical"}),
             device("low", beacon_ago=10, battery_pct=9, charging=False),
             device("unsaid", beacon_ago=10, battery_pct=14.5),
             device("plugged", beacon_ago=10, battery_pct=3, charging=True),
             device("plugged-1", beacon_ago=10, battery_pct=3, charging=1),
             device("text", beacon_ago=10, battery_pct="3", charging=False),
             device("bool", beacon_ago=10, battery_pct=True, charging=False),
             device("stale", beacon_ago=1000, battery_pct=2, charging=False),
             device("lone", beacon_ago=10, thermal="\ud800", battery_pct=1),
             device("list", beacon_ago=10), device("never")]
    for case in cases:
        if case["last_beacon"] is not None:
            case["last_beacon"] = json.dumps({**json.loads(case["last_beacon"]),
                                              "pad": "x" * (16 << 10)})
    cases[-2]["last_beacon"] = "[1, 2]"  # not an object: read as no readings
    conn = sqlite3.connect(":memory:")
    conn.row_factory = sqlite3.Row
    migrate(conn, MIGRATIONS)
    for case in cases:
        conn.execute("INSERT INTO devices (device_id, name, first_seen, registered_at, "
                     "last_seen, ttl_s, last_beacon, last_beacon_at) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                     (case["device_id"], case["name"], NOW, NOW, case["last_seen"],
                      case["ttl_s"], case["last_beacon"], case["last_beacon_at"]))
    rows = conn.execute(alerts.DEVICES_SQL + " ORDER BY rowid").fetchall()
    assert max(len(row["readings"] or "") for row in rows) < 100
    read = alerts.device_rows(rows)
    for rule in (alerts.thermal_critical, alerts.low_battery):
        assert subjects(rule(read, NOW, TH)) == subjects(rule(cases, NOW, TH)), rule
    assert [f.subject for f in alerts.low_battery(read, NOW, TH)] == ["low", "unsaid",
                                                                     "plugged-1", "lone"]


def failed_job(job_id="j", **fields):
    return {"job_id": job_id, "status": "failed", "workload": "benchmark", "attempts": 1,
            "max_attempts": 3, "is_group": 0, "last_error": "boom", "finished_at": NOW - 60,
            **fields}


def test_job_failed_only_when_it_ran_and_recently():
    jobs = [failed_job("ran"), failed_job("cascaded", attempts=0),
            failed_job("parent", is_group=1), failed_job("old", finished_at=NOW - 90000),
            failed_job("done", status="done")]
    found = alerts.job_failed(jobs, NOW, TH)
    assert subjects(found) == [("job-failed", "ran")]
    assert found[0].detail == "benchmark job ran failed on attempt 1 of 3 and will not be " \
        "retried: boom"
    last = alerts.job_failed([failed_job("last", attempts=3)], NOW, TH)
    assert last[0].detail == "benchmark job last failed on its final attempt (3 of 3): boom"


def claimed_job(job_id="j", **fields):
    return {"job_id": job_id, "status": "claimed", "workload": "benchmark", "claimed_by": "d1",
            "ttl_s": 600, "claimed_at": NOW - 1201, "lease_deadline": NOW + 300,
            "has_results": 0, **fields}


def test_job_stuck_after_twice_the_lease_with_no_rows():
    jobs = [claimed_job("stuck"), claimed_job("young", claimed_at=NOW - 1199),
            claimed_job("talking", has_results=1), claimed_job("lapsed", lease_deadline=NOW - 1)]
    assert subjects(alerts.job_stuck(jobs, NOW, TH)) == [("job-stuck", "stuck")]
    assert alerts.job_stuck(jobs, NOW, replace(TH, stuck_factor=3.0)) == []


def schedule(schedule_id="s", **fields):
    return {"id": schedule_id, "enabled": 1, "next_run": NOW + 60, "last_slot": None,
            "run_at": None, "run_outcome": None, "run_detail": None, **fields}


def slot(ts):
    return datetime.fromtimestamp(ts, UTC).strftime("%Y%m%d%H%M")


def test_schedule_missed_when_overdue_late_or_failed():
    due = NOW - 3600
    rows = [schedule("overdue", next_run=NOW - 301), schedule("recent", next_run=NOW - 299),
            schedule("late", last_slot=slot(due), run_at=due + 301, run_outcome="enqueued"),
            schedule("on-time", last_slot=slot(due), run_at=due + 20, run_outcome="enqueued"),
            schedule("failed", last_slot=slot(due), run_at=due + 1, run_outcome="failed",
                     run_detail="no agent"),
            schedule("skipped", last_slot=slot(due), run_at=due + 1, run_outcome="skipped"),
            schedule("off", enabled=0, next_run=NOW - 9999)]
    found = alerts.schedule_missed(rows, NOW, TH)
    assert [f.subject for f in found] == ["overdue", "late", "failed"]
    assert "5 min late" in found[0].detail and "no agent" in found[2].detail


def test_disk_size_thresholds():
    th = replace(TH, data_bytes=1000, log_bytes=100, free_bytes=50)
    assert alerts.disk_size(Sizes(500, 100, 50), 500, th) == []
    found = alerts.disk_size(Sizes(600, 101, 49), 500, th)
    assert [f.subject for f in found] == ["data", "logs", "free-space"]
    assert "take 1.1 KiB" in found[0].detail


def test_benchmark_regressed_reads_only_numbers_a_float_holds():
    """Stored figures may be integers no float holds, or doubles near the top of the range
    whose sum is infinite: the first are no figure, the second keep a finite median."""
    def runs(*values):
        return [{"device_id": "pi", "config": "q4", "decode_tok_s": v} for v in values]
    top = 1.7e308
    (finding,) = alerts.benchmark_regressed(runs(top, top, top, top, 10 ** 400, 1.0), TH)
    assert "under the median 1.7e+308 of its 4 earlier runs" in finding.detail
    assert alerts.benchmark_regressed(runs(100, 100, 100, 10 ** 400), TH) == []


def test_backoff_doubles_with_jitter_and_a_cap():
    assert backoff(1, 2.0, lambda: 0.0) == 1.0
    assert backoff(1, 2.0, lambda: 0.999) < 2.0
    assert backoff(4, 2.0, lambda: 0.0) == 8.0
    assert backoff(30, 2.0, lambda: 0.999) <= MAX_BACKOFF_S


# -- the state machine over HTTP -----------------------------------------------------------------


async def alert_tick(client):
    resp = await client.post("/api/alerts/tick")
    assert resp.status == 200
    return await resp.json()


async def listing(client, query=""):
    resp = await client.get(f"/api/alerts{query}")
    assert resp.status == 200, await resp.text()
    return (await resp.json())["alerts"]


async def named_device(client, device_id="d1", name="Pixel 7"):
    await client.post("/devices/register", json=registration(device_id))
    if name:
        resp = await client.patch(f"/api/devices/{device_id}", json={"name": name})
        assert resp.status == 200


async def test_offline_alert_opens_rises_and_resolves(client, db_path):
    await named_device(client, "d1")
    await named_device(client, "browser-tab", name=None)
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 1000")
    opened = await alert_tick(client)
    assert len(opened["opened"]) == 1 and opened["open"] == 1
    second = await alert_tick(client)
    assert second["opened"] == [] and second["resolved"] == []
    [row] = await listing(client)
    assert set(row) >= {"id", "rule", "subject", "state", "seen_count", "first_seen",
                        "last_seen", "resolved_at", "acked_at", "snoozed_until", "detail",
                        "webhook_state"}
    assert (row["rule"], row["subject"], row["state"], row["seen_count"]) == (
        "device-offline", "d1", "open", 2)
    assert row["webhook_state"] is None and "Pixel 7 (d1)" in row["detail"]
    await client.post("/results", json=beacon("d1", battery_pct=80, charging=True))
    resolved = await alert_tick(client)
    assert resolved["resolved"] == [row["id"]] and resolved["open"] == 0
    assert (await listing(client, "?state=open")) == []
    [gone] = await listing(client, "?state=resolved")
    assert gone["state"] == "resolved" and gone["resolved_at"] and gone["seen_count"] == 2
    assert [a["id"] for a in await listing(client)] == [row["id"]]  # default: open + recent
    # It comes back: a new row, counting from one.
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 1000")
    again = await alert_tick(client)
    assert again["opened"] and again["opened"][0] != row["id"]


async def test_ack_and_snooze(client, db_path):
    await named_device(client)
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 1000")
    [alert_id] = (await alert_tick(client))["opened"]
    acked = await (await client.post(f"/api/alerts/{alert_id}/ack")).json()
    assert acked["acked_at"] and acked["muted"] and acked["state"] == "open"
    snoozed = await (await client.post(f"/api/alerts/{alert_id}/snooze",
                                       json={"minutes": 30})).json()
    until = datetime.fromisoformat(snoozed["snoozed_until"].replace("Z", "+00:00"))
    assert 29 * 60 < (until - datetime.now(UTC)).total_seconds() <= 30 * 60
    by_seconds = await (await client.post(f"/api/alerts/{alert_id}/snooze",
                                          json={"duration_s": 60})).json()
    assert by_seconds["snoozed_until"] < snoozed["snoozed_until"]
    # Still counted while muted: the condition holds.
    await alert_tick(client)
    assert (await listing(client))[0]["seen_count"] == 2
    # A flap keeps the snooze: resolved, then back, the new row is still snoozed.
    await client.post("/results", json=beacon("d1"))
    await alert_tick(client)
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 1000")
    [new_id] = (await alert_tick(client))["opened"]
    [new] = await listing(client, "?state=open")
    assert new["id"] == new_id and new["snoozed_until"] and new["acked_at"] is None
    lifted = await (await client.post(f"/api/alerts/{new_id}/snooze",
                                      json={"duration_s": 0})).json()
    assert lifted["snoozed_until"] is None and not lifted["muted"]


@pytest.mark.parametrize(("method", "path", "body", "status", "words"), [
    ("POST", "/api/alerts/999/ack", None, 404, "no alert 999"),
    ("POST", "/api/alerts/abc/ack", None, 404, "no alert 'abc'"),
    ("POST", "/api/alerts/999/snooze", {"minutes": 5}, 404, "no alert 999"),
    ("GET", "/api/alerts?state=closed", None, 400, "state must be open, resolved or all"),
    ("GET", "/api/alerts?rule=nope", None, 400, "rule must be one of"),
    ("GET", "/api/alerts?limit=0", None, 400, "limit"),
])
async def test_alert_refusals(client, method, path, body, status, words):
    resp = await client.request(method, path, json=body)
    assert resp.status == status
    assert words in (await resp.json())["error"]


async def test_snooze_body_and_state_refusals(client, db_path):
    await named_device(client)
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 1000")
    [alert_id] = (await alert_tick(client))["opened"]
    for body in ({}, {"minutes": "ten"}, {"minutes": 1, "duration_s": 60}, {"minutes": -1},
                 {"duration_s": 10 ** 9}, {"minutes": True}):
        resp = await client.post(f"/api/alerts/{alert_id}/snooze", json=body)
        assert resp.status == 400, body
    await client.post("/results", json=beacon("d1"))
    await alert_tick(client)
    resp = await client.post(f"/api/alerts/{alert_id}/snooze", json={"minutes": 5})
    assert resp.status == 409 and "already resolved" in (await resp.json())["error"]


async def test_job_failed_and_job_stuck(client, db_path):
    await named_device(client)
    await client.post("/jobs", json=job("broken"))
    assert (await client.get("/devices/d1/next-job")).status == 200
    await client.post("/results", json=result_row("broken", "d1", 0, final=True, ok=False,
                                                  error="the model file is missing"))
    await client.post("/jobs", json=job("hung", lease={"ttl_s": 60}))
    assert (await client.get("/devices/d1/next-job")).status == 200
    await client.post("/results", json=beacon("d1", job_id="hung"))
    age_rows(db_path, "UPDATE jobs SET claimed_at = claimed_at - 121 WHERE job_id = 'hung'")
    await alert_tick(client)
    found = {(a["rule"], a["subject"]): a for a in await listing(client)}
    assert set(found) == {("job-failed", "broken"), ("job-stuck", "hung")}
    assert "the model file is missing" in found[("job-failed", "broken")]["detail"]
    # A result row means it is not stuck after all.
    await client.post("/results", json=result_row("hung", "d1", 1, metrics={"decode_tok_s": 1}))
    await alert_tick(client)
    assert [a["rule"] for a in await listing(client, "?state=open")] == ["job-failed"]


async def test_thermal_and_battery_from_beacons(client):
    await named_device(client, "phone", name=None)  # any device, named or not
    await client.post("/results", json=beacon("phone", thermal="critical", battery_pct=9,
                                               charging=False))
    await alert_tick(client)
    assert {(a["rule"], a["subject"]) for a in await listing(client, "?state=open")} == {
        ("thermal-critical", "phone"), ("low-battery", "phone")}
    await client.post("/results", json=beacon("phone", thermal="nominal", battery_pct=9,
                                               charging=True))
    assert len((await alert_tick(client))["resolved"]) == 2


async def test_disk_and_log_size(monkeypatch, collector_factory, tmp_path):
    log_file = tmp_path / "collector.log"
    log_file.write_bytes(b"x" * 2048)
    monkeypatch.setenv("FLEET_ALERT_DATA_BYTES", "1")
    monkeypatch.setenv("FLEET_ALERT_LOG_BYTES", "1K")
    monkeypatch.setenv("FLEET_ALERT_LOG_PATHS", str(log_file))
    client = await collector_factory()
    await alert_tick(client)
    assert {a["subject"] for a in await listing(client, "?rule=disk-size")} == {"data", "logs"}


async def test_schedule_missed(monkeypatch, collector_factory, db_path):
    monkeypatch.setenv("FLEET_SCHEDULE_TICK_S", "3600")
    client = await collector_factory()
    await client.post("/api/schedules", json={"id": "hourly", "cron": "0 * * * *", "template": {
        "schema": 1, "workload": "benchmark", "executor": "device", "backend": "synthetic"}})
    await client.patch("/api/schedules/hourly", json={"enabled": True})
    age_rows(db_path, "UPDATE schedules SET next_run = next_run - 3600 - 600")
    await alert_tick(client)
    [missed] = await listing(client, "?rule=schedule-missed")
    assert missed["subject"] == "hourly" and "has not run" in missed["detail"]
    await client.post("/schedules/tick")  # it runs now, late: still an alert, now saying so
    await alert_tick(client)
    [late] = await listing(client, "?rule=schedule-missed")
    assert late["id"] == missed["id"] and "late" in late["detail"]


async def test_alert_events_reach_the_stream(client, db_path):
    await named_device(client)
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 1000")
    stream = await client.get("/api/stream")
    await alert_tick(client)

    async def first_alert():
        async for line in stream.content:
            if line.startswith(b"data:") and json.loads(line[5:])["type"] == "alert":
                return json.loads(line[5:])
        return None

    event = await asyncio.wait_for(first_alert(), 10)
    stream.close()
    assert (event["rule"], event["subject"], event["action"]) == ("device-offline", "d1",
                                                                  "opened")


# -- the webhook against a real receiver ---------------------------------------------------------


class Receiver:
    """A local webhook endpoint that answers from a script of statuses, then 200."""

    def __init__(self, statuses=(), endless=False, refused=()):
        self.statuses = list(statuses)
        self.endless = endless  # answer with a body that never ends
        self.refused = set(refused)  # subjects of alerts answered 500 every time
        self.streamed = 0  # bytes of that body the sender let through before hanging up
        self.hung_up = asyncio.Event()
        self.posts: list[tuple[int, dict, str]] = []  # (status answered, body, idempotency key)
        self.accepted = asyncio.Event()
        self.port = free_port()
        self.runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        status = self.statuses.pop(0) if self.statuses else 200
        if body["alert"]["subject"] in self.refused:
            status = 500
        self.posts.append((status, body, request.headers.get("Idempotency-Key", "")))
        if status == 200:
            self.accepted.set()
        if self.endless:
            return await self.flood(request, status)
        return web.json_response({"ok": status == 200}, status=status)

    async def flood(self, request, status):
        resp = web.StreamResponse(status=status)
        await resp.prepare(request)
        chunk = b"x" * 65536
        try:
            while self.streamed < 1 << 30:
                await resp.write(chunk)
                self.streamed += len(chunk)
        except (ConnectionError, RuntimeError):  # the sender hung up
            self.hung_up.set()
        return resp

    async def start(self):
        app = web.Application()
        app.router.add_post("/hook", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}/hook"

    def delivered(self, alert_id):
        return [p for p in self.posts if p[0] == 200 and p[1]["alert"]["id"] == alert_id]

    async def stop(self):
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def receiver():
    made: list[Receiver] = []

    async def make(statuses=(), endless=False, refused=()):
        made.append(await Receiver(statuses, endless, refused).start())
        return made[-1]

    yield make
    for r in made:
        await r.stop()


async def wait_webhook_state(client, alert_id, wanted, seconds=10.0):
    for _ in range(int(seconds / 0.02)):
        rows = {a["id"]: a for a in await listing(client, "?state=all")}
        if rows[alert_id]["webhook_state"] == wanted:
            return rows[alert_id]
        await asyncio.sleep(0.02)
    raise AssertionError(f"alert {alert_id} never reached webhook_state {wanted}")


async def test_webhook_retries_a_500_and_delivers_each_new_alert_once(
        monkeypatch, collector_factory, receiver, db_path):
    hook = await receiver([500])
    monkeypatch.setenv("FLEET_ALERT_WEBHOOK", hook.url)
    monkeypatch.setenv("FLEET_ALERT_WEBHOOK_BACKOFF_S", "0.02")
    monkeypatch.setenv("FLEET_ALERT_DATA_BYTES", "1")
    client = await collector_factory()
    [first] = (await alert_tick(client))["opened"]
    assert (await listing(client))[0]["webhook_state"] in ("pending", "delivered")
    row = await wait_webhook_state(client, first, "delivered")
    assert [p[0] for p in hook.posts] == [500, 200]
    [(_, body, key)] = hook.delivered(first)
    assert body["type"] == "alert" and body["alert"]["rule"] == "disk-size"
    assert body["alert"]["subject"] == "data" and "database" in body["text"]
    assert key == body["delivery_id"] and key.endswith(f":alert:{first}")
    assert hook.posts[0][2] == key  # the retry carried the same key
    # The alert stays open and is seen again: no second delivery.
    await alert_tick(client)
    await alert_tick(client)
    # A second, new alert is delivered once too.
    await named_device(client)
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 1000")
    [second] = (await alert_tick(client))["opened"]
    await wait_webhook_state(client, second, "delivered")
    assert len(hook.delivered(first)) == 1 and len(hook.delivered(second)) == 1
    assert len(hook.posts) == 3 and row["seen_count"] == 1


async def test_alerts_a_receiver_keeps_refusing_do_not_hold_back_the_others(
        monkeypatch, collector_factory, receiver, db_path):
    """A retry waits its backoff without one of the four delivery slots: four alerts the
    receiver answers 500 every time held all of them through their waits (minutes at the
    default backoff), and a new alert that the receiver would take waited behind them."""
    hook = await receiver(refused={"d1", "d2", "d3", "d4"})
    monkeypatch.setenv("FLEET_ALERT_WEBHOOK", hook.url)
    monkeypatch.setenv("FLEET_ALERT_WEBHOOK_BACKOFF_S", "60")
    client = await collector_factory()
    for device in ("d1", "d2", "d3", "d4"):
        await named_device(client, device)
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 1000")
    refused = (await alert_tick(client))["opened"]
    assert len(refused) == 4
    for _ in range(500):  # each refused once, now waiting 30 to 60 s for its retry
        if len(hook.posts) == 4:
            break
        await asyncio.sleep(0.02)
    assert sorted(p[0] for p in hook.posts) == [500] * 4, hook.posts
    await named_device(client, "d5")
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 1000 WHERE device_id = 'd5'")
    [taken] = (await alert_tick(client))["opened"]
    await wait_webhook_state(client, taken, "delivered")
    assert len(hook.delivered(taken)) == 1 and len(hook.posts) == 5


async def test_webhook_text_carries_a_clients_words_as_plain_text(
        monkeypatch, collector_factory, receiver):
    """A failed job's alert quotes its row's error, which its poster chooses: in the chat
    text, `<!channel>` pinged everyone and `<https://...|label>` showed a link under a false
    label, and in Markdown chats `[label](url)`, `![x](url)` and `@channel` did the same. The
    text escapes them; the structured alert keeps them as they were."""
    hook = await receiver()
    monkeypatch.setenv("FLEET_ALERT_WEBHOOK", hook.url)
    client = await collector_factory()
    await named_device(client)
    await client.post("/jobs", json=job("broken"))
    assert (await client.get("/devices/d1/next-job")).status == 200
    error = ("<!channel> see <https://evil.example/|the fix> & retry; @channel @all read "
             "[the runbook](https://evil.example/login) ![x](https://evil.example/px.png)\n"
             "[1]: https://evil.example/")
    await client.post("/results", json=result_row("broken", "d1", 0, final=True, ok=False,
                                                  error=error))
    [opened] = (await alert_tick(client))["opened"]
    await wait_webhook_state(client, opened, "delivered")
    [(_, body, _)] = hook.delivered(opened)
    assert error in body["alert"]["detail"]
    text = body["text"]
    assert ("&lt;!channel&gt; see &lt;https://evil.example/|the fix&gt; &amp; retry; "
            "@\u200bchannel @\u200ball read [the runbook]\u200b(https://evil.example/login) "
            "![x]\u200b(https://evil.example/px.png) [1]: https://evil.example/") in text, text
    assert "<" not in text and "\n" not in text and "](" not in text


async def test_webhook_gives_up_on_a_refusal(monkeypatch, collector_factory, receiver):
    hook = await receiver([404])
    monkeypatch.setenv("FLEET_ALERT_WEBHOOK", hook.url)
    monkeypatch.setenv("FLEET_ALERT_DATA_BYTES", "1")
    client = await collector_factory()
    [alert_id] = (await alert_tick(client))["opened"]
    await wait_webhook_state(client, alert_id, "failed")
    assert [p[0] for p in hook.posts] == [404]


async def test_a_receiver_that_never_stops_answering_is_not_read(monkeypatch, collector_factory,
                                                                   receiver):
    """The status says delivered; a body that never ends (a hostile or broken receiver) is not
    read into memory, and does not hold the delivery until the timeout."""
    hook = await receiver(endless=True)
    monkeypatch.setenv("FLEET_ALERT_WEBHOOK", hook.url)
    monkeypatch.setenv("FLEET_ALERT_WEBHOOK_TIMEOUT_S", "600")
    monkeypatch.setenv("FLEET_ALERT_DATA_BYTES", "1")
    client = await collector_factory()
    [alert_id] = (await alert_tick(client))["opened"]
    await wait_webhook_state(client, alert_id, "delivered")
    assert len(hook.delivered(alert_id)) == 1
    await asyncio.wait_for(hook.hung_up.wait(), 10)
    assert hook.streamed < 64 << 20


async def test_a_restart_resumes_pending_deliveries(monkeypatch, collector_factory, receiver):
    hook = await receiver([503])
    monkeypatch.setenv("FLEET_ALERT_WEBHOOK", hook.url)
    monkeypatch.setenv("FLEET_ALERT_WEBHOOK_BACKOFF_S", "600")  # first retry far away
    monkeypatch.setenv("FLEET_ALERT_DATA_BYTES", "1")
    first = await collector_factory()
    [alert_id] = (await alert_tick(first))["opened"]
    for _ in range(500):
        if hook.posts:
            break
        await asyncio.sleep(0.02)
    assert [p[0] for p in hook.posts] == [503]
    await first.close()  # stopped while the row is pending, one attempt used
    monkeypatch.setenv("FLEET_ALERT_WEBHOOK_BACKOFF_S", "0.02")
    second = await collector_factory()
    await asyncio.wait_for(hook.accepted.wait(), 10)
    row = await wait_webhook_state(second, alert_id, "delivered")
    assert [p[0] for p in hook.posts] == [503, 200] and len(hook.delivered(alert_id)) == 1
    assert row["state"] == "open"


async def fail_jobs(client, prefix: str, count: int) -> None:
    """`count` jobs claimed by d1 and failed by a final row: what any client may do."""
    resp = await client.post("/jobs", json=[job(f"{prefix}{i:03d}") for i in range(count)])
    assert resp.status == 201, await resp.text()
    for _ in range(count):
        claimed = await client.get("/devices/d1/next-job")
        assert claimed.status == 200
        job_id = (await claimed.json())["job_id"]
        await client.post("/results", json=result_row(job_id, "d1", 0, final=True, ok=False,
                                                      error="<!channel> click here"))


async def settled(client, ids, seconds=15.0):
    """The alert rows once none of `ids` is pending any more."""
    for _ in range(int(seconds / 0.05)):
        rows = {a["id"]: a for a in await listing(client, "?state=all&limit=1000")}
        if all(rows[i]["webhook_state"] != "pending" for i in ids):
            return rows
        await asyncio.sleep(0.05)
    raise AssertionError("deliveries still pending")


async def test_a_burst_of_alerts_is_posted_as_a_few_and_one_summary(
        monkeypatch, collector_factory, receiver):
    # 300 failing jobs made 300 webhook POSTs within seconds. Past WEBHOOK_PER_WINDOW in a
    # minute the new rows of a tick go out as one summary; none is left unsaid.
    hook = await receiver()
    monkeypatch.setenv("FLEET_ALERT_WEBHOOK", hook.url)
    client = await collector_factory()
    await named_device(client)
    await fail_jobs(client, "burst", 30)
    opened = (await alert_tick(client))["opened"]
    assert len(opened) == 30
    rows = await settled(client, opened)
    states = [rows[i]["webhook_state"] for i in sorted(opened)]
    assert states == ["delivered"] * 11 + ["folded"] * 19
    assert len(hook.posts) == alerts.WEBHOOK_PER_WINDOW + 1
    singles = [p[1] for p in hook.posts if p[1]["type"] == "alert"]
    [summary] = [p[1] for p in hook.posts if p[1]["type"] == "alert-summary"]
    assert len(singles) == 10
    first_folded = sorted(opened)[10]
    assert summary["summary"] == {"alerts": 20, "rules": {"job-failed": 20},
                                  "first_id": first_folded, "last_id": max(opened)}
    assert summary["delivery_id"].endswith(f":alerts:{first_folded}")
    assert "20 new alerts at once" in summary["text"] and "job-failed 20" in summary["text"]
    assert "<" not in summary["text"]
    # The window's share is spent: the next burst within the minute is one summary alone.
    await fail_jobs(client, "again", 3)
    more = (await alert_tick(client))["opened"]
    rows = await settled(client, more)
    assert [rows[i]["webhook_state"] for i in sorted(more)] == ["delivered", "folded", "folded"]
    assert len(hook.posts) == alerts.WEBHOOK_PER_WINDOW + 2
    assert hook.posts[-1][1]["summary"]["alerts"] == 3


@pytest.mark.parametrize(("url", "said"), [
    ("hxxp://hook:SECRETPW@chat.example/T/SECRETPATH", "got 'hxxp://chat.example/...'"),
    ("https://hook:SECRETPW@chat.example:99999/T/SECRETPATH",
     "must be a URL with a valid host and port, got 'https://chat.example:99999/...'"),
])
def test_a_webhook_url_refused_at_start_is_quoted_without_its_secrets(tmp_path, url, said):
    """The start-up error quoted the whole webhook URL, user, password and the token in its path,
    into the service manager's journal; a port past 65535 was taken and failed every delivery."""
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_ALERT_WEBHOOK": url})
    proc.start(wait=False)
    try:  # a collector that takes the URL runs on: stopped whatever the test finds
        assert proc.proc is not None
        assert proc.proc.wait(timeout=30) == 2
        log = proc.log()
        assert "FLEET_ALERT_WEBHOOK" in log and said in log, log
        assert "SECRET" not in log
    finally:
        proc.stop(signal.SIGKILL)


def test_a_tick_records_still_open_alerts_together_and_keeps_their_details(tmp_path):
    """The alerts still open are seen again in one statement; a changed detail is kept, a
    resolved alert is not counted again. Real SQLite, the collector's schema."""
    conn = sqlite3.connect(tmp_path / "a.sqlite3", isolation_level=None)
    conn.row_factory = sqlite3.Row
    migrate(conn, MIGRATIONS)
    stays = alerts.Finding(alerts.AlertRule.LOW_BATTERY, "d1", "d1 is at 9% battery")
    goes = alerts.Finding(alerts.AlertRule.LOW_BATTERY, "d2", "d2 is at 8% battery")
    first = alerts.record(conn, [stays, goes], NOW, Effects(), False)
    assert len(first.opened) == 2
    moved = alerts.Finding(stays.rule, "d1", "d1 is at 7% battery")
    second = alerts.record(conn, [moved], NOW + 60, Effects(), False)
    assert second.opened == [] and len(second.resolved) == 1 and second.still_open == 1
    rows = {r["subject"]: dict(r) for r in conn.execute("SELECT * FROM alerts")}
    assert (rows["d1"]["seen_count"], rows["d1"]["detail"], rows["d1"]["last_seen"]) == (
        2, "d1 is at 7% battery", NOW + 60)
    assert (rows["d2"]["state"], rows["d2"]["seen_count"]) == ("resolved", 1)
    conn.close()

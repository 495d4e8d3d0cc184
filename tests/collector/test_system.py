"""GET /api/system and the retention policy (POST /api/system/retention) against a real
collector with a real SQLite file."""

from __future__ import annotations

import os
import sqlite3
import time

import pytest

from fleet_min.config import ConfigError
from tests.support.collector import age_rows, beacon, registration

DAY_S = 86400


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("FLEET_CI_STATUS_TOKEN", "GITHUB_TOKEN", "FLEET_LOG_FILE", "FLEET_RETENTION_AUTO",
                 "FLEET_RETAIN_BEACONS_DAYS", "FLEET_RETAIN_EVENTS_DAYS",
                 "FLEET_RETAIN_ALERTS_DAYS"):
        monkeypatch.delenv(name, raising=False)


async def system(client):
    resp = await client.get("/api/system")
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def retention(client, body=None, status=200):
    resp = await (client.post("/api/system/retention", json=body) if body is not None
                  else client.post("/api/system/retention"))
    assert resp.status == status, await resp.text()
    return await resp.json()


# -- /api/system -------------------------------------------------------------------------------


async def test_system_figures(client, db_path):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/results", json=beacon("d", battery_pct=50))
    await client.post("/api/events/t", json={"x": 1})
    body = await system(client)
    assert body["uptime_s"] >= 0 and body["started_at"].endswith("Z")
    database = body["database"]
    assert database["path"] == str(db_path)
    assert database["size_bytes"] == os.path.getsize(db_path)
    assert isinstance(database["wal_bytes"], int) and database["page_size"] > 0
    assert database["auto_vacuum"] in ("none", "full", "incremental")
    tables = body["tables"]
    assert tables["devices"] == 1 and tables["beacons"] == 1 and tables["topic_events"] == 1
    assert tables["jobs"] == 0 and "sqlite_sequence" not in tables
    assert body["artifacts"]["count"] == 0 and body["artifacts"]["size_bytes"] == 0
    assert body["ci_status"] == {"armed": False, "repos": None, "posting": False,
                                 "problem": None}
    policy = body["retention"]
    assert (policy["beacons_days"], policy["events_days"], policy["alerts_days"]) == (30, 30, 90)
    # retention runs by default: its first run is a minute after start
    assert policy["auto"] is True and policy["next_run"].endswith("Z")
    assert policy["last_run"] is None


async def test_artifact_store_size_is_walked(client, db_path):
    store = db_path.parent / "artifacts"
    (store / "ab").mkdir(parents=True)
    (store / "ab" / ("ab" + "0" * 62)).write_bytes(b"x" * 1000)
    (store / "cd").mkdir()
    (store / "cd" / ("cd" + "0" * 62)).write_bytes(b"y" * 24)
    outside = db_path.parent.parent / "outside.bin"
    outside.write_bytes(b"z" * 10_000)
    (store / "link").symlink_to(outside)  # not followed, not counted
    body = await system(client)
    assert body["artifacts"]["count"] == 2 and body["artifacts"]["size_bytes"] == 1024
    assert body["artifacts"]["path"] == str(store)


async def test_configured_log_file_and_armed_ci_status(collector_factory, tmp_path, monkeypatch):
    log_file = tmp_path / "collector.log"
    log_file.write_text("a line\n")
    monkeypatch.setenv("FLEET_LOG_FILE", str(log_file))
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_not_a_real_token")
    client = await collector_factory()
    body = await system(client)
    assert body["log"] == {"path": str(log_file), "size_bytes": 7}
    ci = body["ci_status"]
    assert ci["armed"] is True and ci["posting"] is False and ci["repos"] is None
    assert "FLEET_CI_STATUS_REPOS is not set" in ci["problem"]
    assert "ghp_not_a_real_token" not in await (await client.get("/api/system")).text()


async def test_auto_retention_can_be_turned_off(collector_factory, monkeypatch):
    monkeypatch.setenv("FLEET_RETENTION_AUTO", "0")
    client = await collector_factory()
    policy = (await system(client))["retention"]
    assert policy["auto"] is False and policy["next_run"] is None


async def test_bad_retention_settings_stop_the_collector(collector_factory, monkeypatch):
    monkeypatch.setenv("FLEET_RETAIN_EVENTS_DAYS", "a month")
    with pytest.raises(ConfigError, match="FLEET_RETAIN_EVENTS_DAYS"):
        await collector_factory()


# -- retention ---------------------------------------------------------------------------------


def _seed_old_and_new(db_path, now):
    conn = sqlite3.connect(db_path, timeout=30)
    with conn:
        conn.executemany("INSERT INTO beacons (device_id, at, body) VALUES ('d', ?, '{}')",
                         [(now - 40 * DAY_S,)] * 3 + [(now - 1 * DAY_S,)] * 2)
        conn.executemany("INSERT INTO topic_events (topic, payload, at) VALUES ('t', '1', ?)",
                         [(now - 31 * DAY_S,)] * 4 + [(now,)])
        alert = ("INSERT INTO alerts (rule, subject, state, first_seen, last_seen, resolved_at) "
                 "VALUES (?, ?, ?, ?, ?, ?)")
        conn.executemany(alert, [
            ("job-failed", "j1", "resolved", now - 200 * DAY_S, now - 100 * DAY_S,
             now - 100 * DAY_S),
            ("job-failed", "j2", "resolved", now - 20 * DAY_S, now - 10 * DAY_S,
             now - 10 * DAY_S),
            ("device-offline", "d", "open", now - 200 * DAY_S, now - 100 * DAY_S, None)])
    conn.close()


def _count(db_path, table):
    conn = sqlite3.connect(db_path, timeout=30)
    try:
        return conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
    finally:
        conn.close()


async def test_dry_run_reports_and_deletes_nothing(client, db_path):
    _seed_old_and_new(db_path, time.time())
    for body in (None, {}, {"apply": False}):
        report = await retention(client, body)
        assert report["ok"] is True and report["apply"] is False
        tables = report["tables"]
        assert {t: tables[t]["would_delete"] for t in tables} == {
            "beacons": 3, "topic_events": 4, "alerts": 1}
        assert tables["beacons"]["retain_days"] == 30
        assert tables["beacons"]["older_than"].endswith("Z")
    assert (_count(db_path, "beacons"), _count(db_path, "topic_events"),
            _count(db_path, "alerts")) == (5, 5, 3)


async def test_apply_deletes_old_rows_and_returns_space(client, db_path):
    _seed_old_and_new(db_path, time.time())
    report = await retention(client, {"apply": True})
    assert report["apply"] is True
    assert {t: v["deleted"] for t, v in report["tables"].items()} == {
        "beacons": 3, "topic_events": 4, "alerts": 1}
    assert report["reclaim"]["checkpoint_busy"] is False
    assert isinstance(report["reclaim"]["freelist_pages"], int)
    assert (_count(db_path, "beacons"), _count(db_path, "topic_events"),
            _count(db_path, "alerts")) == (2, 1, 2)
    conn = sqlite3.connect(db_path)
    states = sorted(r[0] for r in conn.execute("SELECT subject FROM alerts"))
    conn.close()
    assert states == ["d", "j2"]  # open alerts are never pruned, however old
    last = (await system(client))["retention"]["last_run"]
    assert last["deleted"] == {"beacons": 3, "topic_events": 4, "alerts": 1}
    again = await retention(client, {"apply": False})
    assert all(v["would_delete"] == 0 for v in again["tables"].values())


async def test_apply_works_through_many_batches(client, db_path):
    old = time.time() - 90 * DAY_S
    conn = sqlite3.connect(db_path, timeout=30)
    with conn:
        conn.executemany("INSERT INTO beacons (device_id, at, body) VALUES ('d', ?, '{}')",
                         [(old,)] * 12_001)
    conn.close()
    report = await retention(client, {"apply": True})
    assert report["tables"]["beacons"]["deleted"] == 12_001
    assert _count(db_path, "beacons") == 0


async def test_zero_days_keeps_a_table(collector_factory, db_path, monkeypatch):
    monkeypatch.setenv("FLEET_RETAIN_BEACONS_DAYS", "0")
    monkeypatch.setenv("FLEET_RETAIN_EVENTS_DAYS", "7.5")
    client = await collector_factory()
    _seed_old_and_new(db_path, time.time())
    report = await retention(client, {"apply": True})
    assert report["tables"]["beacons"] == {"retain_days": 0, "older_than": None, "deleted": 0}
    assert report["tables"]["topic_events"]["deleted"] == 4
    assert report["policy"]["events_days"] == 7.5
    assert _count(db_path, "beacons") == 5


async def test_retention_refuses_bad_bodies(client, db_path):
    _seed_old_and_new(db_path, time.time())
    for body in ({"apply": "yes"}, {"aply": True}, {"apply": 1}):
        error = (await retention(client, body, status=400))["error"]
        assert "apply" in error
    resp = await client.post("/api/system/retention", data=b"[true]",
                             headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert _count(db_path, "beacons") == 5


async def test_aged_beacons_via_the_api_are_pruned(client, db_path):
    await client.post("/devices/register", json=registration("d"))
    for pct in (90, 80):
        await client.post("/results", json=beacon("d", battery_pct=pct))
    age_rows(db_path, "UPDATE beacons SET at = at - ? WHERE id = (SELECT MIN(id) FROM beacons)",
             (31 * DAY_S,))
    report = await retention(client, {"apply": True})
    assert report["tables"]["beacons"]["deleted"] == 1
    device = await (await client.get("/api/devices/d")).json()
    assert device["device_id"] == "d"  # the device and its last beacon stay

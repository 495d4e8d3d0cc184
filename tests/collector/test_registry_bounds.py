"""The device registry's bounds against a neighbour who registers without end: FLEET_MAX_DEVICES
(new devices past it are refused, or take the place of temporary devices long gone) and the
listing's trim of bulky descriptors and beacons, and the job listings' of bulky specs (the whole
record stays one GET away); the host
executors a collector keeps (any name a poll gives is stored)."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import pytest

from fleet_min.collector.access import enrolment
from fleet_min.collector.http.app import SERVICE
from fleet_min.collector.insight import telemetry
from fleet_min.collector.jobs import devices, views
from fleet_min.collector.jobs.executors import MAX_EXECUTORS
from tests.support.collector import age_rows, edit_rows, job, registration


async def register(client, device_id: str, **fields):
    resp = await client.post("/devices/register", json=registration(device_id, **fields))
    return resp.status, await resp.json()


async def listed(client, query: str = "?expired=1") -> dict[str, dict]:
    listing = await (await client.get(f"/api/devices{query}")).json()
    return {d["device_id"]: d for d in listing["devices"]}


async def test_a_full_registry_refuses_a_new_device_and_changes_nothing(collector_factory):
    client = await collector_factory(max_devices=3)
    for name in ("a", "b", "c"):
        assert (await register(client, name))[0] == 200
    status, reply = await register(client, "d")
    assert status == 507
    assert "FLEET_MAX_DEVICES" in reply["error"] and "3" in reply["error"]
    assert "forget" in reply["error"]
    assert set(await listed(client)) == {"a", "b", "c"}
    # One already registered may always register again, with a new descriptor.
    status, _ = await register(client, "b", descriptor={"platform": "linux", "model": "new"})
    assert status == 200
    assert (await listed(client))["b"]["descriptor"]["model"] == "new"
    # Forgetting one makes room.
    assert (await client.delete("/api/devices/a")).status in (200, 204)
    assert (await register(client, "d"))[0] == 200


async def test_temporary_devices_that_left_the_shelf_give_way_oldest_first(
        collector_factory, db_path):
    client = await collector_factory(max_devices=3)
    await register(client, "shelf")
    await register(client, "tab-old", ttl_s=60)
    await register(client, "tab-new", ttl_s=60)
    # Both tabs left the shelf (silent past their TTL); the older went first.
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 500 WHERE device_id = 'tab-old'")
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 100 WHERE device_id = 'tab-new'")
    assert (await register(client, "tab-3", ttl_s=60))[0] == 200
    assert set(await listed(client)) == {"shelf", "tab-new", "tab-3"}
    # A temporary device still within its TTL, and a shelf device however silent, stay.
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 100000 WHERE device_id = 'shelf'")
    assert (await register(client, "tab-4", ttl_s=60))[0] == 200  # tab-new gives way
    status, _ = await register(client, "tab-5", ttl_s=60)
    assert status == 507
    assert set(await listed(client)) == {"shelf", "tab-3", "tab-4"}


async def test_a_gone_temporary_device_a_job_holds_locked_does_not_give_way(
        collector_factory, db_path):
    client = await collector_factory(max_devices=2)
    await register(client, "tab", ttl_s=60)
    await register(client, "shelf")
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 500 WHERE device_id = 'tab'")
    edit_rows(db_path, "INSERT INTO device_locks (device_id, job_id, locked_at) "
                       "VALUES ('tab', 'soak', 0)")
    status, reply = await register(client, "new")
    assert status == 507, reply
    assert set(await listed(client)) == {"tab", "shelf"}


async def test_a_flood_is_forgotten_in_one_request_and_locked_devices_are_kept(
        collector_factory, db_path):
    """A registry filled by a flood is cleared by one request, not one device at a time: by
    silence (every device not seen for a while) or by a list of ids."""
    client = await collector_factory(max_devices=60)
    for n in range(50):
        assert (await register(client, f"flood-{n}"))[0] == 200
    for name in ("shelf-pi", "held-phone", "fresh"):
        assert (await register(client, name))[0] == 200
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 7200 WHERE device_id != 'fresh'")
    edit_rows(db_path, "INSERT INTO device_locks (device_id, job_id, locked_at) "
                       "VALUES ('held-phone', 'soak', 0)")
    events = await client.get("/api/stream")  # one event for the whole forget, not fifty-one
    resp = await client.post("/api/devices/forget", json={"silent_for_s": 3600})
    reply = await resp.json()
    assert resp.status == 200, reply
    assert len(reply["forgotten"]) == 51 and "shelf-pi" in reply["forgotten"]
    assert reply["kept"] == [{"device_id": "held-phone", "locked_by": "soak"}]
    assert reply["unknown"] == []
    assert set(await listed(client)) == {"held-phone", "fresh"}
    assert (await register(client, "marker"))[0] == 200  # the next device event
    frames = b""
    while b'"marker"' not in frames:
        frames += await events.content.readany()
    events.close()
    assert frames.count(b"event: device") == 2, frames.decode(errors="replace")[-2000:]
    assert b'"count": 51' in frames or b'"count":51' in frames
    # By ids: the unknown ones are named, the rest forgotten.
    resp = await client.post("/api/devices/forget", json={"device_ids": ["fresh", "nobody"]})
    reply = await resp.json()
    assert reply["forgotten"] == ["fresh"] and reply["unknown"] == ["nobody"]
    assert set(await listed(client)) == {"held-phone", "marker"}


@pytest.mark.parametrize("body", [
    {}, {"device_ids": []}, {"device_ids": "a"}, {"device_ids": [""]}, {"device_ids": [1]},
    {"device_ids": ["a"] * 1001}, {"silent_for_s": 60}, {"silent_for_s": True},
    {"silent_for_s": "3600"}, {"silent_for_s": 1e300}, {"device_ids": ["a"], "silent_for_s": 3600},
    {"everything": True}])
async def test_a_bulk_forget_is_refused_unless_it_says_which_devices(client, body):
    assert (await register(client, "a"))[0] == 200
    resp = await client.post("/api/devices/forget", json=body)
    assert resp.status == 400, await resp.text()
    assert set(await listed(client)) == {"a"}


async def test_the_listing_trims_bulky_descriptors_and_beacons_the_record_keeps_them(client):
    bulky = {"platform": "android", "model": "Pixel 8", "ram_mb": 8192, "rooted": False,
             "adb": True, "note": "n" * 3000, "sensors": {"list": ["x"] * 10},
             "extra": None}
    assert (await register(client, "bulky", descriptor=bulky))[0] == 200
    await register(client, "small", descriptor={"platform": "linux", "model": "Pi 5"})
    resp = await client.post("/results", json={
        "schema": 1, "kind": "beacon", "device_id": "bulky",
        "beacon": {"battery_pct": 55, "charging": True, "thermal": "nominal", "log": "l" * 4000}})
    assert resp.status == 200, await resp.text()

    got = await listed(client, "")
    assert got["small"]["trimmed"] == []
    assert got["small"]["descriptor"] == {"platform": "linux", "model": "Pi 5"}
    record = got["bulky"]
    assert record["trimmed"] == ["descriptor", "last_beacon"]
    # Plain fields a listing shows survive with their JSON types; long text and nested
    # values are left to the device's own record.
    assert record["descriptor"] == {"platform": "android", "model": "Pixel 8", "ram_mb": 8192,
                                    "rooted": False, "adb": True, "extra": None}
    assert record["last_beacon"]["battery_pct"] == 55
    assert record["last_beacon"]["charging"] is True
    assert record["last_beacon"]["thermal"] == "nominal"
    assert "log" not in record["last_beacon"]
    assert record["beacon"] == record["last_beacon"]

    whole = await (await client.get("/api/devices/bulky")).json()
    assert whole["descriptor"] == bulky
    assert whole["last_beacon"]["log"] == "l" * 4000


async def test_an_integer_a_float_cannot_hold_is_refused_before_a_listing_meets_it(client):
    """SQLite's JSON functions, which trim a bulky descriptor for the listing, turn an integer
    of 309 digits or more into Inf, which no JSON reader takes back: one device registered so
    made the device listing answer 500. Such a body is refused; 308 digits still list."""
    pad = "x" * 2100  # past the trim's threshold
    resp = await client.post("/devices/register", data=(
        '{"device_id": "huge", "descriptor": {"n": 1' + "0" * 308 + ', "pad": "' + pad + '"}}'),
        headers={"Content-Type": "application/json"})
    assert resp.status == 400 and "more than 308 digits" in (await resp.json())["error"]
    resp = await client.post("/devices/register", data=(
        '{"device_id": "wide", "descriptor": {"n": 9' + "9" * 307 + ', "pad": "' + pad + '"}}'),
        headers={"Content-Type": "application/json"})
    assert resp.status == 200, await resp.text()
    got = await listed(client)
    assert set(got) == {"wide"} and got["wide"]["trimmed"] == ["descriptor"]
    assert got["wide"]["descriptor"]["n"] == pytest.approx(1e308)


async def test_a_listing_of_many_bulky_devices_stays_small(client):
    # 200 devices whose descriptors are each near the 16 KiB a registration may carry: whole,
    # they would make the listing over 3 MB; trimmed, each record is a few hundred bytes.
    descriptor = {"platform": "linux", "model": "m", "pad": "p" * 15000}
    for n in range(200):
        assert (await register(client, f"d{n}", descriptor=descriptor))[0] == 200
    body = await (await client.get("/api/devices")).read()
    assert len(body) < 200 * 2000, len(body)


async def test_the_listing_trims_long_name_lists_and_the_record_keeps_them(client, db_path):
    """A registration may declare 256 capabilities of 200 characters and 64 pools of 100: 25,000
    such devices made the listing 2 GB. A listing carries each list whole up to 1,024 characters of
    JSON, else its first 32 short names, and says so; the device's record has them all."""
    capabilities = ["benchmark", *(f"cap-{n}-" + "c" * 190 for n in range(255))]
    pools = ["shelf", *(f"pool-{n}-" + "p" * 90 for n in range(63))]
    status, body = await register(client, "wide", capabilities=capabilities, pools=pools)
    assert status == 200, body
    await register(client, "plain", capabilities=["benchmark"], pools=["shelf"])
    got = await listed(client, "")
    assert got["plain"]["trimmed"] == [] and got["plain"]["capabilities"] == ["benchmark"]
    wide = got["wide"]
    assert wide["trimmed"] == ["pools", "capabilities"]
    assert wide["capabilities"] == ["benchmark"] and wide["pools"] == ["shelf"]
    assert wide["reported_pools"] == ["shelf"]
    whole = await (await client.get("/api/devices/wide")).json()
    assert whole["capabilities"] == sorted(capabilities) and whole["pools"] == pools
    # Long lists of short names keep their first 32.
    short = [f"c{n}" for n in range(256)]
    assert (await register(client, "many", capabilities=short))[0] == 200
    many = (await listed(client, ""))["many"]
    assert many["trimmed"] == ["capabilities"] and many["capabilities"] == sorted(short)[:32]
    # 1,200 devices at the limit: the listing stays within a few KB a device.
    edit_rows(db_path, "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE "
              "i < 1200) INSERT INTO devices (device_id, platform, kind, pools, capabilities, "
              "descriptor, first_seen, last_seen, registered_at) SELECT 'w' || i, platform, "
              "kind, pools, capabilities, descriptor, first_seen, last_seen - i, registered_at "
              "FROM n, devices WHERE device_id = 'wide'")
    body = await (await client.get("/api/devices")).read()
    assert len(body) < 1203 * 3000, len(body)
    page = await (await client.get("/dash/legacy/devices")).text()
    assert "The 1000 seen most recently of 1203 devices." in page


async def test_a_limited_listing_holds_the_devices_seen_last_and_counts_the_rest(client, db_path):
    """?limit= lists the devices seen last and says how many it leaves out (the Devices page
    asks for 2,000: a registry a flood filled to 25,000 at the limits is 136 MB of JSON); expired
    temporary devices count neither as listed nor in the total, as without a limit."""
    for name in ("a", "b", "c", "d"):
        assert (await register(client, name))[0] == 200
    assert (await register(client, "tab", ttl_s=10))[0] == 200
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 60 WHERE device_id = 'tab'")
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 5 * "
                      "(unicode(device_id) - unicode('a')) WHERE device_id != 'tab'")
    listing = await (await client.get("/api/devices?limit=2")).json()
    assert [d["device_id"] for d in listing["devices"]] == ["a", "b"]
    assert (listing["devices_total"], listing["cut"], listing["expired_hidden"]) == (4, True, 1)
    listing = await (await client.get("/api/devices?limit=2&expired=1")).json()
    assert (listing["devices_total"], listing["cut"], listing["expired_hidden"]) == (5, True, 0)
    listing = await (await client.get("/api/devices?limit=4")).json()
    assert [d["device_id"] for d in listing["devices"]] == ["a", "b", "c", "d"]
    assert (listing["devices_total"], listing["cut"]) == (4, False)
    assert listing["pools"] == sorted({p for d in listing["devices"] for p in d["pools"]})
    whole = await (await client.get("/api/devices")).json()
    assert "devices_total" not in whole and len(whole["devices"]) == 4
    for bad in ("0", "-1", "two", "1e3", "1000001"):
        resp = await client.get(f"/api/devices?limit={bad}")
        assert resp.status == 400, bad
        assert (await resp.json())["error"] == "limit must be an integer from 1 to 1000000"


def fill_executors(db_path, count: int, silent_s: float = 0.0) -> None:
    """`count` host executors, stored as a collector stores polls, last heard `silent_s` ago."""
    edit_rows(db_path, "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n "
                       "WHERE i < ?) INSERT INTO executors (name, first_seen, last_poll, slots) "
                       "SELECT 'host-' || i, unixepoch() - ?, unixepoch() - ?, 1 FROM n",
              (count, silent_s, silent_s))


async def executors_named(client) -> set[str]:
    listing = await (await client.get("/api/executors")).json()
    return {e["name"] for e in listing["executors"]}


async def test_a_full_executor_registry_refuses_new_names_by_poll_and_registration(
        client, db_path):
    await client.get("/api/health")  # the database exists
    fill_executors(db_path, MAX_EXECUTORS)
    resp = await client.get("/executor/next-job?name=newcomer")
    assert resp.status == 507, await resp.text()
    assert "1,000" in (await resp.json())["error"]
    resp = await client.post("/executors/register", json={"name": "newcomer", "slots": 1})
    assert resp.status == 507
    names = await executors_named(client)
    assert "newcomer" not in names and len(names) == MAX_EXECUTORS
    # A name it keeps still polls.
    assert (await client.get("/executor/next-job?name=host-7")).status == 204


async def test_an_executor_silent_for_a_day_gives_way_to_a_new_name(client, db_path):
    await client.get("/api/health")
    fill_executors(db_path, MAX_EXECUTORS - 1)
    edit_rows(db_path, "INSERT INTO executors (name, first_seen, last_poll, slots) "
                       "VALUES ('old-mac', unixepoch() - 200000, unixepoch() - 100000, 1)")
    assert (await client.get("/executor/next-job?name=new-mac")).status == 204
    names = await executors_named(client)
    assert "new-mac" in names and "old-mac" not in names
    assert len(names) == MAX_EXECUTORS


async def test_job_listings_trim_bulky_specs_and_the_job_record_keeps_them(client):
    bulky_params = {"prompt": "p" * 200_000, "measure_iters": 3}
    spec = job("bulky", params=bulky_params, targets={"pool": "lab"}, priority=5)
    assert (await client.post("/jobs", json=spec)).status == 201
    assert (await client.post("/jobs", json=job("small", params={"measure_iters": 2}))).status \
        == 201

    listing = await (await client.get("/api/jobs")).json()
    got = {j["job_id"]: j for j in listing["jobs"]}
    assert got["small"]["trimmed"] == []
    assert got["small"]["spec"]["params"] == {"measure_iters": 2}
    record = got["bulky"]
    assert record["trimmed"] == ["spec"]
    # Short fields, objects among them, keep their JSON types; the large params are left out.
    assert record["spec"]["targets"] == {"pool": "lab"}
    assert record["spec"]["priority"] == 5 and record["spec"]["job_id"] == "bulky"
    assert "params" not in record["spec"]
    assert record["pool"] == "lab"

    whole = await (await client.get("/api/jobs/bulky")).json()
    assert whole["spec"]["params"] == bulky_params


async def test_a_page_of_bulky_jobs_stays_small(client):
    for n in range(50):
        assert (await client.post("/jobs", json=job(f"j{n}", params={
            "prompt": "p" * 900_000}))).status == 201
    page = await (await client.get("/api/jobs")).read()
    assert len(page) < 50 * 4000, len(page)  # whole, 45 MB
    # The overview never carried specs; this guards against it starting to (its reading only
    # the columns it shows lowers memory, not output, and is not measured here).
    overview = await (await client.get("/api/overview")).read()
    assert len(overview) < 50_000


async def test_a_page_of_bulky_result_rows_stays_small_and_the_job_keeps_them_whole(client):
    """Rows near the body limit (metrics, device and an agent's own fields, which validation
    does not bound) are cut down in the results listing, a device's benchmark history and the
    job's detail; GET /api/results/{id} carries one row as posted."""
    assert (await register(client, "bench-pi"))[0] == 200
    assert (await client.post("/jobs", json=job("big", targets={
        "device_id": "bench-pi"}))).status == 201
    assert (await client.get("/devices/bench-pi/next-job")).status == 200
    rows = 12
    for n in range(rows):
        resp = await client.post("/results", json={
            "schema": 1, "kind": "result", "job_id": "big", "device_id": "bench-pi", "iter": n,
            "final": n == rows - 1, "ok": True,
            "metrics": {"decode_tok_s": 12.5, "notes": "m" * 150_000},
            "device": {"model": "Pi 5", "soc": "s" * 150_000},
            "log": "x" * 150_000, "exit_code": 0})
        assert resp.status == 200, await resp.text()
    listing = await (await client.get("/api/results?job=big")).read()
    assert len(listing) < rows * 2000, len(listing)  # whole, 5.4 MB
    results = (await (await client.get("/api/results?job=big")).json())["results"]
    assert len(results) == rows
    for row in results:
        assert row["trimmed"] == ["metrics", "device", "extra"]
        assert row["metrics"] == {"decode_tok_s": 12.5}  # the short fields stay
        assert row["device"] == {"model": "Pi 5"} and row["exit_code"] == 0
        assert "log" not in row
    detail = await (await client.get("/api/devices/bench-pi")).json()
    assert detail["benchmarks"][0]["trimmed"] == ["metrics", "device", "extra"]
    assert detail["benchmarks"][0]["metrics"] == {"decode_tok_s": 12.5}
    job_detail = await (await client.get("/api/jobs/big")).read()
    assert len(job_detail) < rows * 4000, len(job_detail)  # with each row's payload
    listed = json.loads(job_detail)["results"]
    assert len(listed) == rows and all(r["trimmed"] == ["metrics", "device", "extra"]
                                       for r in listed)
    for row in listed:
        whole = await (await client.get(f"/api/results/{row['id']}")).json()
        assert len(whole["log"]) == 150_000 and len(whole["metrics"]["notes"]) == 150_000
        assert whole["payload"]["device"]["soc"] == "s" * 150_000
        assert (whole["iter"], whole["final"]) == (row["iter"], row["final"])
    assert (await client.get("/api/results/999999")).status == 404
    assert (await client.get("/api/results/-1")).status == 404


async def test_names_a_page_shows_refuse_characters_that_reorder_the_text(client):
    """A direction override in a device's name, pools or capabilities, a job's workload or a
    template's name reorders what a page shows after it (`<U+202E>kpa.exe` reads `exe.apk`):
    each is refused with nothing stored. Right-to-left text with its marks is a name like any
    other, and notes keep their lines."""
    for fields in ({"pools": ["lab\u202e"]}, {"capabilities": ["bench\u2066mark"]}):
        status, body = await register(client, "rtl", **fields)
        assert status == 400 and "reorder the text" in body["error"], body
    assert (await register(client, "rtl", pools=["\u05de\u05e2\u05d1\u05d3\u05d4\u200f"]))[0] == 200
    for change in ({"name": "pixel\u202e"}, {"notes": "a\u2068b"}, {"pools": ["a\u202ab"]},
                   {"name": "two\nlines"}):
        resp = await client.patch("/api/devices/rtl", json=change)
        assert resp.status == 400 and "reorder the text" in (await resp.json())["error"]
    resp = await client.patch("/api/devices/rtl", json={"name": "\u05d8\u05dc\u05e4\u05d5\u05df",
                                                        "notes": "shelf 2\nleft\tside"})
    assert resp.status == 200, await resp.text()
    resp = await client.post("/jobs", json=job("j", workload="bench\u202emark"))
    assert resp.status == 400 and "reorder the text" in (await resp.json())["error"]
    resp = await client.post("/api/templates", json={"id": "t", "name": "nightly\u202e", "spec": {
        "schema": 1, "workload": "benchmark", "executor": "device"}})
    assert resp.status == 400 and "reorder the text" in (await resp.json())["error"]
    resp = await client.post("/jobs", json=job("p", targets={"pool": "\u202ebal"}))
    assert resp.status == 400 and "reorder the text" in (await resp.json())["error"]
    assert (await (await client.get("/api/jobs")).json())["jobs"] == []
    # What a device reports of itself keeps its control characters (agents in the field send
    # what they read), but not a direction override.
    status, body = await register(client, "kpa", descriptor={"model": "fleet-1.4-\u202ekpa.exe"})
    assert status == 400 and "reorder the text" in body["error"], body
    assert (await register(client, "tabbed", descriptor={"model": "Pixel\t8"}))[0] == 200
    for body in ({"name": "mac-1", "capabilities": ["\x1b[2J\u202ex"]},
                 {"name": "mac-1", "agent": "fleet_agent \u202e0.9"}):
        resp = await client.post("/executors/register", json=body)
        assert resp.status == 400 and "reorder the text" in (await resp.json())["error"]
    assert (await (await client.get("/api/executors")).json())["executors"] == []


async def test_a_listing_of_the_devices_first_seen_since_a_time(client, db_path):
    """The Add-a-device page watches for arrivals: it asks for the devices first seen after it
    opened, not for the whole registry each time one beacons."""
    for name in ("old-1", "old-2"):
        assert (await register(client, name))[0] == 200
    age_rows(db_path, "UPDATE devices SET first_seen = first_seen - 600")
    opened = (await (await client.get("/api/enroll")).json())["now"]
    assert (await register(client, "new-1"))[0] == 200
    assert (await register(client, "old-1"))[0] == 200  # seen again, not new
    fresh = await listed(client, f"?first_seen_after={opened}")
    assert set(fresh) == {"new-1"}
    assert set(await listed(client, "")) == {"old-1", "old-2", "new-1"}
    resp = await client.get("/api/devices?first_seen_after=yesterday")
    assert resp.status == 400 and "first_seen_after" in (await resp.json())["error"]


async def test_a_page_of_devices_is_not_queued_behind_whole_registry_listings(client):
    """Every listing queued for the same two slots: behind a dozen clients asking for all of
    25,000 devices (25 MB each), the dashboard's page of 100 waited 30 s. Pages (a limit of
    2,000 or less) have slots of their own. Here both slots of whole listings are held."""
    for name in ("a", "b", "c"):
        assert (await client.post("/devices/register", json=registration(name))).status == 200
    db = client.server.app[SERVICE].db
    whole = db.slots("device listings", 2)
    await whole.acquire()
    await whole.acquire()
    try:
        waiting = asyncio.ensure_future(client.get("/api/devices"))
        page = await asyncio.wait_for(client.get("/api/devices", params={"limit": "100"}), 30)
        assert [d["device_id"] for d in (await page.json())["devices"]] == ["c", "b", "a"]
        assert not waiting.done()  # the whole registry waits for its own slot
    finally:
        whole.release()
        whole.release()
    assert (await asyncio.wait_for(waiting, 30)).status == 200


def _reads_of_rows(conn: sqlite3.Connection, sql: str, params: tuple = ()) -> list[str]:
    """The columns of the devices table (not of an index of it) that `sql` reads, as names."""
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'devices'").fetchone()[0]
    program = conn.execute(f"EXPLAIN {sql}", params).fetchall()
    cursors = {op[2] for op in program if op[1] == "OpenRead" and op[3] == root}
    names = [row[1] for row in conn.execute("PRAGMA table_info(devices)")]
    return [names[op[3]] for op in program if op[1] == "Column" and op[2] in cursors]


async def test_reads_of_every_devices_times_never_read_its_row(client, db_path):
    """A device's times come after its descriptor, pools and capabilities in its row (57 KB
    at the registration's limits), so reading them for every device read every page of a full
    registry (1.4 GB): each metrics scrape, each overview, each count of expired devices in a
    listing, and each registration refused at the bound, which looked for a temporary device
    to give way in every row. The times are read from an index, and those that may give way
    are found in one of their own."""
    await register(client, "d")
    conn = sqlite3.connect(db_path)
    try:
        for sql, params in ((telemetry.DEVICE_TIMES, ()),
                            (views.OVERVIEW_DEVICES, ()),
                            ("SELECT count(*) FROM devices WHERE ttl_s IS NOT NULL "
                             "AND ? - last_seen > ttl_s", (1.0,)),
                            (enrolment._KNOWN_IDS, (10,))):
            assert _reads_of_rows(conn, sql, params) == [], sql
        plan = " | ".join(row[3] for row in conn.execute(
            f"EXPLAIN QUERY PLAN {devices._DEVICES.gone_sql}", (1.0, 1)))
    finally:
        conn.close()
    # Only the devices found to have left the shelf are read, for their ids.
    assert plan.startswith("SEARCH d USING INDEX devices_leaving"), plan

"""Device registration, capabilities rules, pools, temporary devices and derived status."""

from __future__ import annotations

from tests.support.collector import age_rows, job, registration


async def test_register_is_an_upsert_with_the_documented_reply(client):
    resp = await client.post("/devices/register", json=registration("pi-1", pools=["lab"]))
    assert resp.status == 200
    assert await resp.json() == {"ok": True, "device_id": "pi-1", "capabilities": None,
                                 "pools": ["lab"]}
    body = registration("pi-1", pools=["lab", "desk"])
    body["descriptor"]["model"] = "Pi 5 rev 2"
    resp = await client.post("/devices/register", json=body)
    assert (await resp.json())["pools"] == ["lab", "desk"]
    device = await (await client.get("/api/devices/pi-1")).json()
    assert device["descriptor"]["model"] == "Pi 5 rev 2"
    assert device["status"] == "online"
    listing = await (await client.get("/api/devices")).json()
    assert [d["device_id"] for d in listing["devices"]] == ["pi-1"]


async def test_capabilities_rules(client):
    # Omitted at first registration: no opinion, offered everything (stored as null).
    reply = await (await client.post("/devices/register", json=registration("a"))).json()
    assert reply["capabilities"] is None
    # An explicit list is stored; re-registration omitting the key keeps it.
    await client.post("/devices/register", json=registration("b", capabilities=["self-check"]))
    reply = await (await client.post("/devices/register", json=registration("b"))).json()
    assert reply["capabilities"] == ["self-check"]
    # [] means nothing is offered.
    reply = await (await client.post("/devices/register",
                                     json=registration("c", capabilities=[]))).json()
    assert reply["capabilities"] == []
    await client.post("/jobs", json=job("sc", workload="self-check"))
    resp = await client.get("/devices/c/next-job")
    assert resp.status == 204
    resp = await client.get("/devices/b/next-job")
    assert (await resp.json())["job_id"] == "sc"


async def test_workload_backend_pairing_satisfies_only_that_backend(client):
    await client.post("/devices/register",
                      json=registration("web", capabilities=["benchmark:jssha"]))
    resp = await client.post("/jobs", json=job("w1", backend="jssha"))
    assert resp.status == 201
    resp = await client.post("/jobs", json=job("w2", backend="webcrypto"))
    assert resp.status == 422
    assert "benchmark:webcrypto" in (await resp.json())["error"]
    # The synthetic backend is built in but this device did not declare it: not offered.
    await client.post("/jobs", json=job("w3", priority=5))
    got = await (await client.get("/devices/web/next-job")).json()
    assert got["job_id"] == "w1"


async def test_capabilities_are_readable_from_match_expressions(client):
    await client.post("/devices/register",
                      json=registration("x", capabilities=["self-check", "benchmark:jssha"]))
    await client.post("/devices/register", json=registration("y", capabilities=["self-check"]))
    resp = await client.post("/jobs", json=job(
        "m", workload="self-check", targets={"match": "capabilities ~ 'jssha'"}))
    assert resp.status == 201
    assert (await client.get("/devices/y/next-job")).status == 204
    assert (await (await client.get("/devices/x/next-job")).json())["job_id"] == "m"


async def test_pools_override_wins_and_null_restores_reported(client):
    await client.post("/devices/register", json=registration("p", pools=["reported"]))
    resp = await client.patch("/api/devices/p", json={"pools": ["override"], "name": "Desk Pi",
                                                      "notes": "left of the monitor"})
    device = await resp.json()
    assert device["pools"] == ["override"] and device["name"] == "Desk Pi"
    # A later registration does not undo the operator's override.
    reply = await (await client.post("/devices/register",
                                     json=registration("p", pools=["again"]))).json()
    assert reply["pools"] == ["override"]
    device = await (await client.patch("/api/devices/p", json={"pools": None})).json()
    assert device["pools"] == ["again"]


async def test_device_edit_refusals(client):
    await client.post("/devices/register", json=registration("p"))
    resp = await client.patch("/api/devices/p", json={"descriptor": {}})
    assert resp.status == 400 and "cannot be edited" in (await resp.json())["error"]
    resp = await client.patch("/api/devices/p", json={"pools": "lab"})
    assert resp.status == 400
    resp = await client.patch("/api/devices/nope", json={"name": "x"})
    assert resp.status == 404


async def test_forget_device(client):
    await client.post("/devices/register", json=registration("gone"))
    resp = await client.delete("/api/devices/gone")
    assert resp.status == 200
    assert (await client.get("/api/devices/gone")).status == 404
    assert (await client.delete("/api/devices/gone")).status == 404


async def test_platform_inference_and_kind_never_guessed(client):
    await client.post("/devices/register", json={"device_id": "iphone",
                                                 "descriptor": {"os": "iOS 18.1"}})
    await client.post("/devices/register", json={"device_id": "phone",
                                                 "descriptor": {"os": "14"}})
    await client.post("/devices/register", json={"device_id": "mac", "descriptor": {
        "os": "macOS 15", "platform": "macos"}})
    got = {d["device_id"]: d for d in (await (await client.get("/api/devices")).json())["devices"]}
    assert got["iphone"]["platform"] == "ios"
    assert got["phone"]["platform"] == "android"
    assert got["mac"]["platform"] == "macos"
    assert all(d["kind"] is None for d in got.values())


async def test_temporary_devices_expire_but_stay_resolvable(client, db_path):
    await client.post("/devices/register", json=registration("tmp", ttl_s=60))
    await client.post("/devices/register", json=registration("shelf"))
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 61 WHERE device_id = 'tmp'")
    listing = await (await client.get("/api/devices")).json()
    assert [d["device_id"] for d in listing["devices"]] == ["shelf"]
    assert listing["expired_hidden"] == 1  # so the Devices page's count can say so
    listing = await (await client.get("/api/devices?expired=true")).json()
    assert {d["device_id"] for d in listing["devices"]} == {"tmp", "shelf"}
    assert listing["expired_hidden"] == 0
    record = await (await client.get("/api/devices/tmp")).json()
    assert record["expired"] is True and record["temporary"] is True
    # Sliding expiry: a beacon brings it back.
    await client.post("/results", json={"schema": 1, "kind": "beacon", "device_id": "tmp",
                                        "beacon": {"battery_pct": 80}})
    record = await (await client.get("/api/devices/tmp")).json()
    assert record["expired"] is False


async def test_derived_status_thresholds(client, db_path):
    for name in ("on", "st", "off"):
        await client.post("/devices/register", json=registration(name))
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 200 WHERE device_id = 'st'")
    age_rows(db_path, "UPDATE devices SET last_seen = last_seen - 1000 WHERE device_id = 'off'")
    got = {d["device_id"]: d["status"]
           for d in (await (await client.get("/api/devices")).json())["devices"]}
    assert got == {"on": "online", "st": "stale", "off": "offline"}
    overview = await (await client.get("/api/overview")).json()
    assert overview["devices"] == {"total": 3, "online": 1, "stale": 1, "offline": 1,
                                   "low_battery_devices": []}


async def test_register_refuses_bad_bodies(client):
    resp = await client.post("/devices/register", json={"descriptor": {}})
    assert resp.status == 400 and "device_id" in (await resp.json())["error"]
    resp = await client.post("/devices/register", json=registration("x", capabilities="all"))
    assert resp.status == 400 and "capabilities" in (await resp.json())["error"]
    resp = await client.post("/devices/register", data=b"{not json",
                             headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert (await client.get("/api/devices")).status == 200
    assert (await (await client.get("/api/devices")).json())["devices"] == []


async def test_descriptors_and_beacons_past_their_size_are_refused_and_change_nothing(client):
    """A descriptor and a beacon were kept at up to a request body's 1 MiB each, and every
    device listing serves them whole (a beacon twice): a hundred registrations and beacons from
    one client made GET /api/devices 300 MB. Past 16 KiB of JSON each is a 413."""
    body = registration("pi-1")
    body["descriptor"]["notes"] = "x" * 8000
    assert (await client.post("/devices/register", json=body)).status == 200
    beacon = {"schema": 1, "kind": "beacon", "device_id": "pi-1",
              "beacon": {"battery_pct": 80, "sensors": ["t"] * 2000}}
    assert (await client.post("/results", json=beacon)).status == 200
    before = await (await client.get("/api/devices/pi-1")).json()

    body["descriptor"]["notes"] = "x" * (16 << 10)
    resp = await client.post("/devices/register", json=body)
    assert resp.status == 413, await resp.text()
    assert "a collector keeps descriptors of at most 16,384" in (await resp.json())["error"]
    resp = await client.post("/devices/register", json={**registration("pi-2"),
                                                         "descriptor": body["descriptor"]})
    assert resp.status == 413
    beacon["beacon"]["sensors"] = ["t"] * 5000
    resp = await client.post("/results", json=beacon)
    assert resp.status == 413 and "beacons of at most 16,384" in (await resp.json())["error"]

    after = await (await client.get("/api/devices/pi-1")).json()
    assert after["descriptor"] == before["descriptor"]
    assert after["last_beacon"] == before["last_beacon"] == beacon["beacon"] | {
        "sensors": ["t"] * 2000}
    listing = await (await client.get("/api/devices")).json()
    assert [d["device_id"] for d in listing["devices"]] == ["pi-1"]
    history = await (await client.get("/api/devices/pi-1/beacons")).json()
    assert len(history["beacons"]) == 1

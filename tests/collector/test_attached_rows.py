"""Rows and beacons about the devices attached to a host executor (compatibility with the
executors in the field), through a real collector (in-process, real socket, real SQLite file):
a host job's row or beacon under an attached device's id, without an `executor` field, counts
for the executor the device is attached to (its descriptor's attached_to, or a lock the job
holds on it); any other stays refused."""

from __future__ import annotations

from tests.support.collector import attached_registration, executor_claim, registration
from tests.support.collector import host_job as host


async def register(client, name, **fields):
    resp = await client.post("/executors/register", json={"name": name, **fields})
    assert resp.status == 200, await resp.text()


async def enqueue(client, spec):
    resp = await client.post("/jobs", json=spec)
    assert resp.status == 201, await resp.text()


async def post(client, body):
    resp = await client.post("/results", json=body)
    return resp.status, await resp.json()


def field_row(job_id, device_id, iteration, **fields):
    """A per-device row as the executors in the field post it: under the attached device's id,
    with no executor field and no attempt."""
    return {"schema": 1, "kind": "result", "job_id": job_id, "device_id": device_id,
            "iter": iteration, **fields}


def field_beacon(device_id, job_id):
    return {"schema": 1, "kind": "beacon", "device_id": device_id, "job_id": job_id,
            "beacon": {"battery_pct": 81, "charging": True, "thermal": "nominal"}}


async def test_rows_and_beacons_under_an_attached_devices_id_count_for_its_executor(client):
    await register(client, "lab", capabilities=["cold-start"])
    await register(client, "other", capabilities=["cold-start"])
    for device_id, host_name in (("R5CT1234ABC", "lab"), ("emulator-5554", "other")):
        resp = await client.post("/devices/register",
                                 json=attached_registration(device_id, host_name))
        assert resp.status == 200
    await client.post("/devices/register", json=registration("loose-phone"))
    await enqueue(client, host("cold", "cold-start", params={"app_id": "com.example.shop"},
                               targets={"device_id": "R5CT1234ABC"}))
    assert await executor_claim(client, "lab") == "cold"

    status, reply = await post(client, field_row("cold", "R5CT1234ABC", 1, ok=True,
                                                 metrics={"ttid_ms": 812}))
    assert status == 200 and reply["duplicate"] is False and reply["attempt"] == 1
    status, reply = await post(client, field_beacon("R5CT1234ABC", "cold"))
    assert status == 200 and reply["lease_renewed"] is True
    # attached to another executor, or to none: not the claimant's
    for stranger in ("emulator-5554", "loose-phone"):
        status, reply = await post(client, field_row("cold", stranger, 1, ok=True))
        assert status == 409 and "held by the host executor that claimed it" in reply["error"]
        status, reply = await post(client, field_beacon(stranger, "cold"))
        assert status == 200 and reply["lease_renewed"] is False
    status, reply = await post(client, field_row("cold", "R5CT1234ABC", 0, ok=True, final=True))
    assert status == 200 and reply["status"] == "done"
    rows = await (await client.get("/api/results?job_id=cold")).json()
    assert sorted((r["device_id"], r["iter"]) for r in rows["results"]) == [
        ("R5CT1234ABC", 0), ("R5CT1234ABC", 1)]

"""Device locks a host job takes (issue 26), through a real collector (in-process, real socket,
real SQLite file): acquire, release and the listing; who may lock; a locked device is handed no
device job; cancelling, a lapsed lease and the job's end release the locks; a locked device is
not forgotten; rows under a locked device's id count for the job's claimant."""

from __future__ import annotations

import pytest

from tests.support.collector import age_rows, executor_claim, job, registration, result_row


async def call(client, method, path, body=None):
    resp = await client.request(method, path, json=body)
    return resp.status, await resp.json()


async def enqueue(client, spec):
    status, body = await call(client, "POST", "/jobs", spec)
    assert status == 201, body


async def device_claim(client, device_id):
    resp = await client.get(f"/devices/{device_id}/next-job")
    assert resp.status in (200, 204), await resp.text()
    return None if resp.status == 204 else (await resp.json())["job_id"]


def host(job_id):
    return job(job_id, workload="soak", executor="host", params={"app_id": "com.example"})


async def running(client, job_id, executor):
    await enqueue(client, host(job_id))
    assert await executor_claim(client, executor) == job_id


async def acquire(client, job_id, device_ids, **extra):
    return await call(client, "POST", "/locks/acquire",
                      {"job_id": job_id, "device_ids": device_ids, **extra})


async def locks(client):
    status, body = await call(client, "GET", "/api/locks")
    assert status == 200
    return {lock["device_id"]: lock for lock in body["locks"]}


@pytest.fixture
async def shelf(collector_factory):
    client = await collector_factory(long_poll_s=0.05)
    for device_id in ("d1", "d2", "d3"):
        status, _ = await call(client, "POST", "/devices/register", registration(device_id))
        assert status == 200
    return client


async def test_a_job_locks_devices_no_other_job_holds_and_gives_them_back(shelf):
    await running(shelf, "lab-soak", "lab")
    await running(shelf, "rig-soak", "rig")
    status, reply = await acquire(shelf, "lab-soak", ["d1", "d2", "d1"])
    assert status == 200 and reply["granted"] == ["d1", "d2"]
    status, reply = await acquire(shelf, "rig-soak", ["d2", "d3"])
    assert status == 200 and reply["granted"] == ["d3"] and reply["refused"] == ["d2"]
    status, reply = await acquire(shelf, "lab-soak", ["d1"])  # already its own: granted
    assert reply["granted"] == ["d1"]
    listed = await locks(shelf)
    assert {d: (lock["job_id"], lock["holder"]) for d, lock in listed.items()} == {
        "d1": ("lab-soak", "lab"), "d2": ("lab-soak", "lab"), "d3": ("rig-soak", "rig")}
    _, detail = await call(shelf, "GET", "/jobs/lab-soak")
    assert listed["d1"]["expires_at"] == detail["lease_deadline"]  # as long as its lease
    assert listed["d1"]["acquired_at"].endswith("Z")
    status, reply = await call(shelf, "POST", "/locks/release", {"job_id": "lab-soak"})
    assert status == 200 and reply["released"] == 2
    assert set(await locks(shelf)) == {"d3"}


@pytest.mark.parametrize("body, words", [
    ({"device_ids": ["d1"]}, "job_id is required"),
    ({"job_id": "lab-soak"}, "device_ids must be a list"),
    ({"job_id": "lab-soak", "device_ids": []}, "device_ids must be a list"),
    ({"job_id": "lab-soak", "device_ids": [7]}, "device_ids must be a list"),
    ({"job_id": "lab-soak", "device_ids": ["d"] * 101}, "device_ids must be a list"),
    ({"job_id": "lab-soak", "device_ids": ["d1"], "executor": ""}, "executor must be"),
])
async def test_a_malformed_acquire_is_400_and_locks_nothing(shelf, body, words):
    await running(shelf, "lab-soak", "lab")
    status, reply = await call(shelf, "POST", "/locks/acquire", body)
    assert status == 400 and words in reply["error"]
    assert await locks(shelf) == {}


async def test_only_the_claimant_of_a_running_host_job_locks_for_it(shelf):
    await running(shelf, "lab-soak", "lab")
    await enqueue(shelf, host("waiting-soak"))
    await enqueue(shelf, job("bench", targets={"device_id": "d3"}))
    assert await device_claim(shelf, "d3") == "bench"
    cases = [
        (("lab-soak", ["d1"], {"executor": "rig"}), 409, "not by 'rig'"),
        (("waiting-soak", ["d1"], {}), 409, "is queued, not claimed"),
        (("bench", ["d1"], {}), 409, "is a device job"),
        (("no-such-job", ["d1"], {}), 404, "no job"),
    ]
    for (job_id, devices, extra), wanted, words in cases:
        status, reply = await acquire(shelf, job_id, devices, **extra)
        assert (status, words in reply["error"]) == (wanted, True), (job_id, reply)
    status, reply = await call(shelf, "POST", "/locks/release",
                               {"job_id": "lab-soak", "executor": "rig"})
    assert status == 409
    assert await locks(shelf) == {}
    status, reply = await acquire(shelf, "lab-soak", ["d1"], executor="lab")
    assert status == 200 and reply["granted"] == ["d1"]


async def test_a_locked_device_is_handed_no_device_job_until_the_lock_goes(shelf):
    await running(shelf, "lab-soak", "lab")
    await acquire(shelf, "lab-soak", ["d1"])
    await enqueue(shelf, job("bench-d1", targets={"device_id": "d1"}))
    await enqueue(shelf, job("bench-any"))
    assert await device_claim(shelf, "d1") is None  # locked: neither its own nor any job
    assert await device_claim(shelf, "d2") == "bench-any"
    await call(shelf, "POST", "/locks/release", {"job_id": "lab-soak"})
    assert await device_claim(shelf, "d1") == "bench-d1"


async def test_cancelling_the_job_releases_its_locks_and_says_how_many(shelf):
    await running(shelf, "lab-soak", "lab")
    await acquire(shelf, "lab-soak", ["d1", "d2"])
    status, reply = await call(shelf, "POST", "/api/jobs/lab-soak/cancel")
    assert status == 200 and reply["locks_released"] == 2
    assert await locks(shelf) == {}


async def test_a_locked_device_is_not_forgotten(shelf):
    await running(shelf, "lab-soak", "lab")
    await acquire(shelf, "lab-soak", ["d1"])
    status, reply = await call(shelf, "DELETE", "/api/devices/d1")
    assert status == 409 and "locked by job lab-soak" in reply["error"]
    assert (await call(shelf, "GET", "/api/devices/d1"))[0] == 200
    final = result_row("lab-soak", "lab", 0, ok=True, final=True)
    assert (await call(shelf, "POST", "/results", final))[0] == 200  # its end frees it
    assert await locks(shelf) == {}
    assert (await call(shelf, "DELETE", "/api/devices/d1"))[0] == 200


async def test_a_lapsed_lease_releases_the_locks(shelf, db_path):
    await running(shelf, "lab-soak", "lab")
    await acquire(shelf, "lab-soak", ["d1"])
    age_rows(db_path, "UPDATE jobs SET lease_deadline = lease_deadline - 100000 "
             "WHERE job_id = 'lab-soak'")
    status, reply = await call(shelf, "POST", "/jobs/sweep")
    assert status == 200 and reply["requeued"] == ["lab-soak"]
    assert await locks(shelf) == {}


async def test_a_row_under_a_locked_devices_id_counts_for_the_claimant(shelf):
    await running(shelf, "lab-soak", "lab")
    row = {"schema": 1, "kind": "result", "job_id": "lab-soak", "device_id": "d2", "iter": 1,
           "ok": True, "metrics": {"rss_mb": 212}}
    status, reply = await call(shelf, "POST", "/results", row)
    assert status == 409  # not locked, not attached: not the claimant's
    await acquire(shelf, "lab-soak", ["d2"])
    status, reply = await call(shelf, "POST", "/results", row)
    assert status == 200 and reply["duplicate"] is False
    beacon = {"schema": 1, "kind": "beacon", "device_id": "d2", "job_id": "lab-soak",
              "beacon": {"battery_pct": 64}}
    status, reply = await call(shelf, "POST", "/results", beacon)
    assert status == 200 and reply["lease_renewed"] is True

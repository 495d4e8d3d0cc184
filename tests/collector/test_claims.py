"""Claiming: order, every check before a claim, constraints, busy claims, locks, long polls."""

from __future__ import annotations

import asyncio
import time

from fleet_min.collector.http.app import SERVICE
from tests.support.collector import age_rows, beacon, job, registration, wait_for_polls


async def claim(client, device_id):
    resp = await client.get(f"/devices/{device_id}/next-job")
    return None if resp.status == 204 else await resp.json()


async def finish(client, job_id, device_id, **fields):
    """A final ok row: the device holds one job at a time, so it can be offered the next."""
    resp = await client.post("/results", json={"schema": 1, "kind": "result", "job_id": job_id,
                                               "device_id": device_id, "final": True, "ok": True,
                                               **fields})
    assert resp.status == 200, await resp.text()


async def claim_and_finish(client, device_id):
    got = await claim(client, device_id)
    if got is not None:
        await finish(client, got["job_id"], device_id)
    return got


async def test_unknown_device_must_register_first(client):
    resp = await client.get("/devices/ghost/next-job")
    assert resp.status == 404
    assert "register first" in (await resp.json())["error"]


async def test_a_head_request_claims_nothing(client):
    """HEAD on a poll was answered by the GET handler: it claimed the job and dropped the body
    that carried it (the device then got 204 until the lease lapsed), and skipped the mesh
    allowlist, which keys agent routes by method. It is a 405 now."""
    await client.post("/devices/register", json=registration("d"))
    await client.post("/executors/register", json={"name": "mac"})
    await client.post("/jobs", json=job("for-d"))
    await client.post("/jobs", json=job("for-mac", workload="web-unfurl", executor="host",
                                        targets={"url": "https://example.test/"}))
    for path in ("/devices/d/next-job", "/executor/next-job?name=mac"):
        resp = await client.head(path)
        assert resp.status == 405 and "GET" in resp.headers["Allow"], path
    for job_id in ("for-d", "for-mac"):
        assert (await (await client.get(f"/jobs/{job_id}")).json())["status"] == "queued"
    assert (await (await client.get("/devices/d/next-job")).json())["job_id"] == "for-d"


async def test_claim_order_is_priority_then_creation(client):
    await client.post("/devices/register", json=registration("d"))
    for name, priority in (("low", 0), ("high-1", 5), ("mid", 2), ("high-2", 5)):
        await client.post("/jobs", json=job(name, priority=priority))
    order = [(await claim_and_finish(client, "d"))["job_id"] for _ in range(4)]
    assert order == ["high-1", "high-2", "mid", "low"]


async def test_claim_sets_lease_and_attempts(client):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("j", lease={"ttl_s": 120}))
    before = time.time()
    spec = await claim(client, "d")
    assert spec["job_id"] == "j" and spec["attempt"] == 1 and spec["lease"]["ttl_s"] == 120
    row = await (await client.get("/jobs/j")).json()
    assert row["status"] == "claimed" and row["claimed_by"] == "d" and row["attempts"] == 1
    detail = await (await client.get("/api/jobs/j")).json()
    assert detail["attempts"][0]["claimed_by"] == "d"
    assert row["lease_deadline"] > time.strftime("%Y-%m-%dT%H:%M", time.gmtime(before + 100))


async def test_pins_pools_and_match(client):
    await client.post("/devices/register", json=registration("a", pools=["lab"]))
    await client.post("/devices/register", json=registration(
        "b", descriptor={"platform": "android", "ram_mb": 12288, "soc": "Tensor G3"}))
    await client.post("/jobs", json=job("pin-b", targets={"device_id": "b"}))
    await client.post("/jobs", json=job("pool-lab", targets={"pool": "lab"}))
    await client.post("/jobs", json=job("big", targets={
        "match": "ram_mb >= 8192 && platform == 'android' && soc ~ 'tensor'"}))
    assert (await claim_and_finish(client, "a"))["job_id"] == "pool-lab"
    assert await claim(client, "a") is None
    assert (await claim_and_finish(client, "b"))["job_id"] == "pin-b"
    assert (await claim(client, "b"))["job_id"] == "big"


async def test_constraints_leave_the_job_queued_without_burning_an_attempt(client):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("c", constraints={"require_ac": True, "max_load": 1.5,
                                                          "require_idle_s": 60}))
    # No beacon yet: fail closed.
    assert await claim(client, "d") is None
    await client.post("/results", json=beacon("d", charging=False, load=0.2, idle_s=300))
    assert await claim(client, "d") is None
    await client.post("/results", json=beacon("d", ac=True, charging=False, load=3.0,
                                               idle_s=300))
    assert await claim(client, "d") is None
    await client.post("/results", json=beacon("d", ac=True, load=0.5, idle_s=10))
    assert await claim(client, "d") is None
    row = await (await client.get("/jobs/c")).json()
    assert row["status"] == "queued" and row["attempts"] == 0
    # charging stands in for ac when ac is absent.
    await client.post("/results", json=beacon("d", charging=True, load=0.5, idle_s=600))
    assert (await claim(client, "d"))["job_id"] == "c"


async def test_stale_beacon_fails_closed(client, db_path):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/results", json=beacon("d", ac=True))
    age_rows(db_path, "UPDATE devices SET last_beacon_at = last_beacon_at - 600")
    await client.post("/jobs", json=job("c", constraints={"require_ac": True}))
    assert await claim(client, "d") is None


async def test_time_window_including_midnight_crossing(client):
    await client.post("/devices/register", json=registration("d"))
    hour = time.localtime().tm_hour
    # Wraps through midnight for most hours and always leaves out the current hour.
    excluding = {"from": (hour + 1) % 24, "to": hour}
    await client.post("/jobs", json=job("out", constraints={"window": excluding}))
    assert await claim(client, "d") is None
    # Wraps through midnight for most hours and always holds the current hour.
    including = {"from": (hour - 1) % 24, "to": (hour - 2) % 24}
    await client.post("/jobs", json=job("in", constraints={"window": including}))
    assert (await claim(client, "d"))["job_id"] == "in"
    assert (await (await client.get("/jobs/out")).json())["attempts"] == 0


async def test_busy_claim_from_another_collector_blocks_until_stale(client, db_path):
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("j"))
    await client.post("/results", json=beacon(
        "d", busy={"job_id": "elsewhere", "collector": "http://other:8788"}))
    assert await claim(client, "d") is None
    age_rows(db_path, "UPDATE devices SET busy_at = busy_at - 200")
    assert (await claim(client, "d"))["job_id"] == "j"


async def test_exclusive_lock(client):
    await client.post("/devices/register", json=registration("d"))
    # A host executor drives d from outside: d runs something, though d itself holds nothing.
    await client.post("/jobs", json=job("drive", workload="install", executor="host",
                                        targets={"device_id": "d"}))
    assert (await (await client.get("/executor/next-job?name=mac")).json())["job_id"] == "drive"
    await client.post("/jobs", json=job("excl", targets={"exclusive": True}))
    await client.post("/jobs", json=job("after"))
    # The exclusive job waits while the device runs something else; the next one is offered.
    assert (await claim_and_finish(client, "d"))["job_id"] == "after"
    await finish(client, "drive", "d", executor="mac")  # the executor's row about d
    await client.post("/jobs", json=job("later"))
    assert (await claim(client, "d"))["job_id"] == "excl"
    # While the lock is held nothing else is offered, to the device or to drive it.
    await client.post("/jobs", json=job("drive-2", workload="install", executor="host",
                                        targets={"device_id": "d"}))
    assert (await client.get("/executor/next-job?name=mac")).status == 204
    await finish(client, "excl", "d")
    assert (await (await client.get("/executor/next-job?name=mac")).json())["job_id"] == "drive-2"
    assert (await claim(client, "d"))["job_id"] == "later"


async def test_host_executor_claims_by_name(client):
    await client.post("/jobs", json=job("any-host", workload="install", executor="host"))
    await client.post("/jobs", json=job("mac-only", workload="web-test", executor="host",
                                        priority=5, targets={"executor": "mac-mini"}))
    resp = await client.get("/executor/next-job")
    assert resp.status == 400
    got = await (await client.get("/executor/next-job?name=pi")).json()
    assert got["job_id"] == "any-host"
    assert (await client.get("/executor/next-job?name=pi")).status == 204
    got = await (await client.get("/executor/next-job?name=mac-mini")).json()
    assert got["job_id"] == "mac-only"
    # Device agents are never offered host jobs.
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("h2", workload="install", executor="host"))
    assert await claim(client, "d") is None


async def test_long_poll_answers_204_after_the_hold(collector_factory):
    client = await collector_factory(long_poll_s=0.3)
    await client.post("/devices/register", json=registration("d"))
    resp = await client.get("/devices/d/next-job")
    assert resp.status == 204


async def test_long_poll_wakes_on_enqueue(collector_factory):
    client = await collector_factory(long_poll_s=30)
    await client.post("/devices/register", json=registration("d"))
    poll = asyncio.create_task(client.get("/devices/d/next-job"))
    await asyncio.sleep(0.2)
    assert not poll.done()
    await client.post("/jobs", json=job("wake"))
    resp = await asyncio.wait_for(poll, 10)  # a 30 s hold: only a wake-up answers this soon
    assert resp.status == 200 and (await resp.json())["job_id"] == "wake"


async def test_long_poll_wakes_when_a_beacon_satisfies_a_constraint(collector_factory):
    client = await collector_factory(long_poll_s=30)
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("needs-ac", constraints={"require_ac": True}))
    poll = asyncio.create_task(client.get("/devices/d/next-job"))
    await asyncio.sleep(0.2)
    assert not poll.done()
    await client.post("/results", json=beacon("d", ac=True))
    resp = await asyncio.wait_for(poll, 10)
    assert (await resp.json())["job_id"] == "needs-ac"


async def test_long_poll_wakes_on_promotion_and_release(collector_factory):
    client = await collector_factory(long_poll_s=30)
    await client.post("/devices/register", json=registration("a"))
    await client.post("/devices/register", json=registration("b"))
    await client.post("/jobs", json=[job("first", targets={"device_id": "a"}),
                                     job("second", depends_on=["first"],
                                         targets={"device_id": "b"})])
    poll_b = asyncio.create_task(client.get("/devices/b/next-job"))
    await claim(client, "a")
    await asyncio.sleep(0.2)
    assert not poll_b.done()
    await client.post("/results", json={"schema": 1, "kind": "result", "job_id": "first",
                                        "device_id": "a", "iter": 0, "final": True, "ok": True})
    resp = await asyncio.wait_for(poll_b, 10)
    assert (await resp.json())["job_id"] == "second"
    await finish(client, "second", "b")
    # Release wakes a waiting poll of another device.
    await client.post("/jobs", json=job("shared"))
    got = await claim(client, "a")
    assert got["job_id"] == "shared"
    poll_b = asyncio.create_task(client.get("/devices/b/next-job"))
    await asyncio.sleep(0.2)
    await client.post("/jobs/shared/release", json={"device_id": "a"})
    resp = await asyncio.wait_for(poll_b, 10)
    assert (await resp.json())["job_id"] == "shared"


async def test_pinned_jobs_reach_their_own_waiting_polls(collector_factory):
    """An array of jobs pinned to several devices: each waiting device gets its own job at once
    (the dispatcher looks them up by claimant), a device nobody pinned keeps waiting."""
    client = await collector_factory(long_poll_s=30)
    for name in ("a", "b", "c", "idle"):
        await client.post("/devices/register", json=registration(name))
    polls = {name: asyncio.create_task(client.get(f"/devices/{name}/next-job"))
             for name in ("c", "idle", "a", "b")}
    await asyncio.sleep(0.3)
    await client.post("/jobs", json=[job(f"for-{name}", targets={"device_id": name})
                                     for name in ("a", "b", "c")])
    for name in ("a", "b", "c"):
        resp = await asyncio.wait_for(polls[name], 10)
        assert resp.status == 200 and (await resp.json())["job_id"] == f"for-{name}"
    await asyncio.sleep(0.3)
    assert not polls["idle"].done()
    polls["idle"].cancel()


async def test_many_waiting_polls_each_get_one_job(collector_factory):
    client = await collector_factory(long_poll_s=30)
    for i in range(8):
        await client.post("/devices/register", json=registration(f"d{i}"))
    polls = [asyncio.create_task(client.get(f"/devices/d{i}/next-job")) for i in range(8)]
    await asyncio.sleep(0.3)
    await client.post("/jobs", json=[job(f"j{i}") for i in range(8)])
    answers = await asyncio.wait_for(asyncio.gather(*polls), 15)
    ids = sorted([(await r.json())["job_id"] for r in answers])
    assert ids == sorted(f"j{i}" for i in range(8))


async def test_jobs_every_waiting_poll_was_offered_inside_the_enqueue_wake_no_dispatcher(
        collector_factory):
    """The enqueue claims for every poll that could take its jobs in its own transaction, and
    then the dispatcher's loop has nothing to offer anyone: it is not woken. With more takers
    than jobs, the one left out still gets the next job."""
    client = await collector_factory(long_poll_s=30)
    dispatcher = client.server.app[SERVICE].dispatcher
    for name in ("a", "b", "c"):
        await client.post("/devices/register", json=registration(name))
    passes = dispatcher.passes
    await client.post("/jobs", json=[job("nobody-waits-1"), job("nobody-waits-2")])
    poll_a = asyncio.create_task(client.get("/devices/a/next-job"))
    resp = await asyncio.wait_for(poll_a, 10)  # its first look takes a queued job at once
    assert (await resp.json())["job_id"] == "nobody-waits-1"
    await finish(client, "nobody-waits-1", "a")
    poll_a = asyncio.create_task(client.get("/devices/a/next-job"))
    assert (await (await asyncio.wait_for(poll_a, 10)).json())["job_id"] == "nobody-waits-2"
    await finish(client, "nobody-waits-2", "a")
    poll_a = asyncio.create_task(client.get("/devices/a/next-job"))
    await wait_for_polls(client, 1)
    await client.post("/jobs", json=[job("for-b", targets={"device_id": "b"}),
                                     job("for-a", targets={"device_id": "a"})])
    assert (await (await asyncio.wait_for(poll_a, 10)).json())["job_id"] == "for-a"
    assert dispatcher.passes == passes  # every taker was offered a job inside the enqueue
    await finish(client, "for-a", "a")

    polls = [asyncio.create_task(client.get(f"/devices/{name}/next-job")) for name in "bc"]
    await wait_for_polls(client, 1)  # b took its pinned job at once; c waits
    assert (await (await asyncio.wait_for(polls[0], 10)).json())["job_id"] == "for-b"
    poll_a = asyncio.create_task(client.get("/devices/a/next-job"))
    await wait_for_polls(client, 2)
    await client.post("/jobs", json=job("one-for-two"))  # two takers, one job
    done, waiting = await asyncio.wait([poll_a, polls[1]], timeout=10,
                                       return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1 and (await done.pop().result().json())["job_id"] == "one-for-two"
    await client.post("/jobs", json=job("the-other"))
    done, _ = await asyncio.wait(waiting, timeout=10)
    assert (await done.pop().result().json())["job_id"] == "the-other"

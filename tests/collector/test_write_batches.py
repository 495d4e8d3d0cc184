"""Transactions that share a commit (group commit) when one of them fails after writing: the
writer rolls the batch back and runs it again in savepoints (fleet_min.db). What a client sees
must be exactly as if each had run alone: no stray rows, no doubled events, a waiting poll
handed one job. A real collector; the transactions are started together in its event loop so
they are sure to share one batch."""

from __future__ import annotations

import asyncio

from fleet_min.collector.http.app import SERVICE
from fleet_min.collector.jobs import queue, results
from fleet_min.collector.jobs.specs import check_spec
from fleet_min.errors import Unprocessable
from fleet_min.timeutil import now
from tests.support.collector import job, registration, result_row, wait_for_polls


async def test_a_failed_enqueue_in_a_shared_batch_leaves_the_others_whole(client):
    service = client.server.app[SERVICE]
    for device in ("d1", "d2"):
        await client.post("/devices/register", json=registration(device))
    await client.post("/jobs", json=job("running", targets={"device_id": "d2"}))
    await client.get("/devices/d2/next-job")
    poll = asyncio.create_task(client.get("/devices/d1/next-job"))
    await wait_for_polls(client, 1)
    await asyncio.sleep(0.3)  # its own first look (one transaction) is over: it is parked
    published = service.hub.published
    replays = service.db.stats["replays"]

    pinned = check_spec(job("for-d1", targets={"device_id": "d1"}))
    stored_first = check_spec(job("stored-then-undone"))
    no_match = check_spec(job("fan", fanout=True, targets={"pool": "nowhere"}))
    outcomes = await asyncio.gather(
        service.transact(queue.enqueue, [pinned], now()),
        # Stores its first job, then finds no device for the fan-out: refused after writing.
        service.transact(queue.enqueue, [stored_first, no_match], now()),
        service.transact(results.post_result, result_row("running", "d2", final=True, ok=True),
                         now()),
        return_exceptions=True)

    assert service.db.stats["replays"] == replays + 1  # the batch did run twice
    enqueued, refused, posted = outcomes
    assert isinstance(enqueued, queue.Enqueued)
    assert enqueued.replies == [{"job_id": "for-d1", "status": "queued"}]
    assert isinstance(refused, Unprocessable)
    assert isinstance(posted, dict) and posted["status"] == "done"
    answer = await asyncio.wait_for(poll, 5)
    assert answer.status == 200  # handed its job by the enqueue's batch, not timed out
    handed = await answer.json()
    assert handed["job_id"] == "for-d1" and handed["attempt"] == 1
    assert (await client.get("/api/jobs/stored-then-undone")).status == 404
    jobs = {j["job_id"]: j for j in (await (await client.get("/api/jobs")).json())["jobs"]}
    assert set(jobs) == {"running", "for-d1"}
    assert jobs["for-d1"]["status"] == "claimed" and jobs["running"]["status"] == "done"
    detail = await (await client.get("/api/jobs/for-d1")).json()
    assert [a["attempt"] for a in detail["attempts"]] == [1]
    # for-d1 queued and claimed, the result row, running done: each published once.
    assert service.hub.published - published == 4

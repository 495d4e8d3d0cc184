"""A job claimed for a long poll reaches that poll's client, or goes back to the queue at once:
never claimed by a device that never heard of it (until its lease lapses, 600 s later).

The race: a poll's hold runs out in the same turn of the event loop as a job is handed to it.
Forced with a short hold, many pinned jobs enqueued a few at a time, and many real clients
polling in a loop against a real collector process."""

from __future__ import annotations

import asyncio
import contextlib
import random
import sqlite3
import threading
import time
from collections import Counter

import pytest

from fleet_min.collector.http.app import SERVICE
from fleet_min.collector.jobs import queue
from fleet_min.collector.jobs.claims import Claimant
from fleet_min.timeutil import now
from tests.support.collector import (
    CollectorProcess,
    edit_rows,
    job,
    registration,
    result_row,
    wait_for_polls,
)
from tests.support.stream import StreamReader

DEVICES = 12
JOBS_PER_DEVICE = 40


def _poller(client, device: str, received: list[str], stop: threading.Event) -> None:
    """An agent: poll, run (post the final row), poll again."""
    while not stop.is_set():
        try:
            status, spec = client.get(f"/devices/{device}/next-job", timeout=30)
        except OSError:
            continue
        if status != 200:
            continue
        received.append(spec["job_id"])
        client.post("/results", result_row(spec["job_id"], device, 0, final=True, ok=True))


def _undelivered(db_path, received: set[str]) -> list[tuple[str, str]]:
    conn = sqlite3.connect(db_path)
    try:
        claimed = conn.execute("SELECT job_id, claimed_by FROM jobs WHERE status = 'claimed'")
        return [(job_id, device) for job_id, device in claimed if job_id not in received]
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.parametrize("hold_s", ["0.05", "0.2"])
def test_every_job_is_delivered_once_when_holds_run_out_as_jobs_arrive(tmp_path, hold_s):
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_LONG_POLL_S": hold_s}).start()
    client = proc.client
    devices = [f"d{i:02d}" for i in range(DEVICES)]
    for device in devices:
        assert client.post("/devices/register", registration(device))[0] == 200
    received: dict[str, list[str]] = {device: [] for device in devices}
    stop = threading.Event()
    threads = [threading.Thread(target=_poller, args=(proc.client, d, received[d], stop))
               for d in devices]
    for thread in threads:
        thread.start()
    rng = random.Random(19)
    enqueued: list[str] = []
    try:
        # A few pinned jobs at a time, at uneven moments, so that deliveries land all over the
        # polls' holds, their ends included.
        pending = [(device, n) for device in devices for n in range(JOBS_PER_DEVICE)]
        rng.shuffle(pending)
        while pending:
            size = rng.randint(1, 4)
            batch, pending = pending[:size], pending[size:]
            specs = [job(f"{device}-{n}", targets={"device_id": device}) for device, n in batch]
            status, reply = client.post("/jobs", specs)
            assert status == 201, reply
            enqueued += [spec["job_id"] for spec in specs]
            time.sleep(rng.uniform(0, float(hold_s)))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = sum(len(jobs) for jobs in received.values())
            if got >= len(enqueued):
                break
            time.sleep(0.1)
    finally:
        stop.set()
        for thread in threads:
            thread.join(40)
        db_path = proc.data_dir / "fleet.sqlite3"
        proc.stop()
    counts = Counter(job_id for jobs in received.values() for job_id in jobs)
    lost = _undelivered(db_path, set(counts))
    assert not lost, f"claimed but never delivered (held until the lease lapses): {lost[:10]}"
    assert [job_id for job_id, n in counts.items() if n > 1] == []
    assert set(counts) == set(enqueued)
    for device, jobs in received.items():
        assert all(job_id.startswith(device + "-") for job_id in jobs)


async def _queued_again(client, job_id: str) -> dict:
    for _ in range(500):
        row = await (await client.get(f"/jobs/{job_id}")).json()
        if row["status"] == "queued":
            return row
        await asyncio.sleep(0.01)
    raise AssertionError(f"{job_id} stayed {row['status']}, claimed by {row['claimed_by']}")


async def test_a_poll_cancelled_after_its_job_was_handed_over_gives_it_back(collector_factory):
    """The client went away (aiohttp cancels the handler) just after the dispatcher put a job
    on the poll's future, before the poll's task ran again."""
    client = await collector_factory(long_poll_s=30)
    service = client.server.app[SERVICE]
    await client.post("/devices/register", json=registration("d"))
    poll = asyncio.create_task(service.dispatcher.wait(Claimant("device", "d"), 30))
    await wait_for_polls(client, 1)
    await asyncio.sleep(0.2)  # its first look found nothing: it waits on its future
    await service.transact(queue.enqueue, [job("j", targets={"device_id": "d"})], now())
    # The enqueue claimed j for the poll and put it on the poll's future; the poll has not run
    # since (no await in between). Now its client goes away.
    assert not poll.done()
    poll.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await poll
    assert poll.cancelled()
    row = await _queued_again(client, "j")
    assert row["attempts"] == 0  # handed back, attempt not burned
    detail = await (await client.get("/api/jobs/j")).json()
    assert [a["outcome"] for a in detail["attempts"]] == ["undelivered"]
    assert (await (await client.get("/devices/d/next-job")).json())["job_id"] == "j"


async def test_a_poll_cancelled_during_its_own_first_look_leaves_no_claim_behind(
        collector_factory):
    """The writer runs a transaction even after its caller was cancelled: the poll's first look
    then claims nothing, or hands back what it claimed."""
    client = await collector_factory(long_poll_s=30)
    service = client.server.app[SERVICE]
    await client.post("/devices/register", json=registration("d"))
    await client.post("/jobs", json=job("j", targets={"device_id": "d"}))
    for _ in range(20):
        poll = asyncio.create_task(service.dispatcher.wait(Claimant("device", "d"), 30))
        await asyncio.sleep(0)  # the look is with the writer, or about to be
        poll.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poll
        row = await _queued_again(client, "j")
        assert row["attempts"] == 0
    assert (await (await client.get("/devices/d/next-job")).json())["job_id"] == "j"


# A claim the database refuses: a real trigger in the collector's own SQLite file, the way a
# full disk or an I/O error would make a claim's UPDATE fail, for the claimants it names.
REFUSE_CLAIMS = ("CREATE TRIGGER refuse_claims BEFORE UPDATE OF status ON jobs "
                 "WHEN NEW.status = 'claimed' AND NEW.claimed_by IN ({}) "
                 "BEGIN SELECT RAISE(ABORT, 'claims refused by the test'); END")


async def _refuse_claims(db_path, *claimants: str) -> None:
    names = ", ".join(f"'{name}'" for name in claimants)
    await asyncio.to_thread(edit_rows, db_path, REFUSE_CLAIMS.format(names))


async def test_a_poll_whose_claim_failed_answers_when_its_hold_runs_out(collector_factory,
                                                                        db_path):
    """The enqueue's own claim for the waiting poll fails and so does the dispatcher's: the
    poll is not left reserved for a claim that will never answer; it answers 204 when its hold
    runs out, and the job is still queued for the next poll."""
    client = await collector_factory(long_poll_s=1.0)
    await client.post("/devices/register", json=registration("d"))
    poll = asyncio.create_task(client.get("/devices/d/next-job"))
    await wait_for_polls(client, 1)
    await asyncio.sleep(0.2)  # its first look found nothing: it waits
    await _refuse_claims(db_path, "d")
    assert (await client.post("/jobs", json=job("j", targets={"device_id": "d"}))).status == 201
    answer = await asyncio.wait_for(poll, 10)
    assert answer.status == 204
    await asyncio.to_thread(edit_rows, db_path, "DROP TRIGGER refuse_claims")
    assert (await (await client.get("/jobs/j")).json())["status"] == "queued"
    assert (await (await client.get("/devices/d/next-job")).json())["job_id"] == "j"


async def test_claims_undone_inside_an_enqueue_publish_nothing(collector_factory, db_path):
    """The enqueue claims for two waiting polls inside its own transaction; the second claim
    fails, so both are undone (the enqueue stands). The live stream shows the two jobs queued
    and no claim that did not happen."""
    client = await collector_factory(long_poll_s=3.0)
    polls = []
    for name in ("a", "b"):
        await client.post("/devices/register", json=registration(name))
        polls.append(asyncio.create_task(client.get(f"/devices/{name}/next-job")))
        await wait_for_polls(client, len(polls))  # a waits first, so a is claimed for first
    await asyncio.sleep(0.2)
    await _refuse_claims(db_path, "b")
    async with StreamReader(client) as reader:
        await client.post("/jobs", json=[job("for-a", targets={"device_id": "a"}),
                                         job("for-b", targets={"device_id": "b"})])
        await client.post("/devices/register", json=registration("marker"))
        seen = []
        while (event := await reader.event())["type"] != "device":
            seen.append((event["type"], event.get("job_id"), event.get("status")))
    assert seen == [("job", "for-a", "queued"), ("job", "for-b", "queued")]
    assert (await (await client.get("/jobs/for-a")).json())["status"] == "queued"
    for answer in await asyncio.wait_for(asyncio.gather(*polls), 10):
        assert answer.status == 204


async def test_holds_of_different_lengths_each_run_out_on_their_own(collector_factory):
    """The dispatcher keeps one timer per length of hold: polls of a short hold answer before
    earlier polls of a long one, and a poll that gets a job leaves the others' holds running."""
    client = await collector_factory(long_poll_s=30)
    service = client.server.app[SERVICE]
    dispatcher = service.dispatcher
    names = ("long-1", "short-1", "long-2", "short-2", "served")
    for name in names:
        await client.post("/devices/register", json=registration(name))
    loop = asyncio.get_running_loop()
    answered: dict[str, float] = {}

    async def poll(name: str, hold_s: float) -> dict | None:
        started = loop.time()
        found = await dispatcher.wait(Claimant("device", name), hold_s)
        answered[name] = loop.time() - started
        return found

    polls = {name: asyncio.create_task(poll(name, 2.0 if name.startswith("long") else 0.4))
             for name in names}
    await wait_for_polls(client, len(names))
    await asyncio.sleep(0.1)  # every first look found nothing: each holds on its future
    await service.transact(queue.enqueue, [job("j", targets={"device_id": "served"})], now())
    assert (await asyncio.wait_for(polls["served"], 5))["job_id"] == "j"
    results = await asyncio.wait_for(asyncio.gather(*polls.values()), 10)
    assert results[:4] == [None, None, None, None]
    # No poll answers before its hold (it starts after the poll's first look); the short
    # holds end first although two long ones began before them.
    assert min(answered["short-1"], answered["short-2"]) >= 0.4
    assert max(answered["short-1"], answered["short-2"]) < 2.0 <= min(answered["long-1"],
                                                                       answered["long-2"])
    assert dispatcher.waiting == 0 and dispatcher.holding == 0


async def test_many_holds_running_out_together_all_answer(collector_factory):
    """A thousand polls whose holds end in the same instant are answered by one sweep, none
    left holding."""
    client = await collector_factory(long_poll_s=30)
    dispatcher = client.server.app[SERVICE].dispatcher
    for i in range(1000):
        await client.post("/devices/register", json=registration(f"d{i}"))
    polls = [asyncio.create_task(dispatcher.wait(Claimant("device", f"d{i}"), 0.5))
             for i in range(1000)]
    await wait_for_polls(client, 1000)
    assert await asyncio.wait_for(asyncio.gather(*polls), 20) == [None] * 1000
    assert dispatcher.waiting == 0 and dispatcher.holding == 0


async def test_a_hold_ended_early_at_the_head_leaves_the_later_ones_running(collector_factory):
    """The first poll of a hold length gets a job and leaves; the timer armed for its deadline
    finds the next poll not yet due, arms itself again, and that poll answers at its own."""
    client = await collector_factory(long_poll_s=30)
    service = client.server.app[SERVICE]
    dispatcher = service.dispatcher
    for name in ("first", "second"):
        await client.post("/devices/register", json=registration(name))
    first = asyncio.create_task(dispatcher.wait(Claimant("device", "first"), 0.6))
    await wait_for_polls(client, 1)
    await asyncio.sleep(0.3)  # the second's hold starts well after the first's
    loop = asyncio.get_running_loop()
    started = loop.time()
    second = asyncio.create_task(dispatcher.wait(Claimant("device", "second"), 0.6))
    await wait_for_polls(client, 2)
    await service.transact(queue.enqueue, [job("j", targets={"device_id": "first"})], now())
    assert (await asyncio.wait_for(first, 5))["job_id"] == "j"
    assert await asyncio.wait_for(second, 5) is None
    assert loop.time() - started >= 0.6
    assert dispatcher.waiting == 0 and dispatcher.holding == 0

"""The dispatcher finds the waiting polls that could take a job through its index (by claimant,
by executor and declared workload), never by walking every waiting poll; when the poll it asked
first cannot take a job, it asks the next one instead of leaving the job to a later poll; and a
beacon wakes a waiting poll only when its last look was refused something a beacon can change.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import ClassVar

from fleet_min.collector.http.app import SERVICE
from fleet_min.collector.jobs.claims import Claimant
from fleet_min.collector.jobs.dispatch import Waiter, WaitingPolls
from fleet_min.collector.jobs.effects import JobRoute
from fleet_min.collector.jobs.kinds import Executor
from tests.support.collector import beacon, job, registration, wait_for_polls


@dataclass(eq=False)
class CountedWaiter(Waiter):
    """A real Waiter that counts the pre-checks made on it: what a wake-up looked at."""

    checks: int = 0

    def could_take(self, job: JobRoute) -> bool:
        self.checks += 1
        return super().could_take(job)


def _route(job_id: str, workload: str, executor: str = Executor.DEVICE, pin: str = ""
           ) -> JobRoute:
    return JobRoute(job_id, executor, pin, workload, None, None)


def _polls(count: int) -> tuple[WaitingPolls, list[CountedWaiter]]:
    polls, waiters = WaitingPolls(), []
    for i in range(count):
        waiter = CountedWaiter(Claimant(Executor.DEVICE, f"d{i}"), capabilities=[f"w{i % 10}"])
        polls.add(waiter)
        waiters.append(waiter)
    return polls, waiters


async def test_a_wake_up_looks_only_at_the_polls_that_could_take_its_jobs():
    polls, waiters = _polls(1000)
    anyone = CountedWaiter(Claimant(Executor.DEVICE, "never-said"))  # declared nothing: any job
    host = CountedWaiter(Claimant(Executor.HOST, "mac"))
    polls.add(anyone)
    polls.add(host)
    # A job of workload w7 for any device: the polls that declared w7 and the one that never
    # said, in arrival order; the first is all a single job needs.
    takers = list(polls.could_take_any([_route("j", "w7")]))
    assert takers == [*waiters[7::10], anyone]
    assert sum(w.checks for w in waiters) == 100
    assert host.checks == 0
    first = next(iter(polls.could_take_any([_route("k", "w3")])))
    assert first is waiters[3]
    # A beacon's wake-up and a pinned job read their claimant's polls alone.
    for waiter in (*waiters, anyone, host):
        waiter.checks = 0
    assert polls.of_claimants(["device:d5"]) == [waiters[5]]
    assert list(polls.could_take_any([_route("p", "w1", pin="d42")])) == []  # d42 declared w2
    assert list(polls.could_take_any([_route("q", "w2", pin="d42")])) == [waiters[42]]
    assert list(polls.could_take_any([_route("h", "w0", executor=Executor.HOST)])) == [host]
    assert sum(w.checks for w in (*waiters, anyone)) == 2  # d42, twice


@dataclass(eq=False)
class ComparedWaiter(Waiter):
    """A real Waiter that counts how often it is compared with another: what finding a poll
    among others (to remove it) cost."""

    comparisons: ClassVar[list[int]] = [0]

    def __eq__(self, other: object) -> bool:
        self.comparisons[0] += 1
        return self is other

    __hash__ = Waiter.__hash__


async def test_a_claimant_with_thousands_of_polls_ends_each_without_a_scan():
    """One claimant (a device lying about its id from many connections) holding 2,000 polls:
    ending them, in any order, compares no poll with the others."""
    polls = WaitingPolls()
    waiters = [ComparedWaiter(Claimant(Executor.DEVICE, "same")) for _ in range(2000)]
    for waiter in waiters:
        polls.add(waiter)
    for waiter in waiters[1::2] + waiters[::2]:
        polls.remove(waiter)
    assert len(polls) == 0 and not polls.has_claimant("device:same")
    assert ComparedWaiter.comparisons[0] < 100  # a scan each: some 500,000


async def test_a_poll_filed_again_when_its_declared_workloads_change():
    polls, waiters = _polls(3)
    waiters[0].capabilities = ["other"]
    polls.refile(waiters[0])
    assert list(polls.could_take_any([_route("j", "w0")])) == []
    assert list(polls.could_take_any([_route("j", "other")])) == [waiters[0]]
    polls.remove(waiters[0])
    assert list(polls.could_take_any([_route("j", "other")])) == []
    assert len(polls) == 2 and not polls.has_claimant("device:d0")


async def test_a_job_the_first_poll_cannot_take_goes_to_the_next_waiting_poll(collector_factory):
    """The first poll waiting is refused by the job's match expression (too little memory):
    the job is offered to the next poll at once, not left until that poll asks again."""
    client = await collector_factory(long_poll_s=30)
    polls = []
    for name, ram_mb in (("small", 2048), ("large", 8192)):
        body = registration(name)
        body["descriptor"]["ram_mb"] = ram_mb
        assert (await client.post("/devices/register", json=body)).status == 200
        polls.append(asyncio.create_task(client.get(f"/devices/{name}/next-job")))
        await wait_for_polls(client, len(polls))  # small waits first, so it is asked first
    await asyncio.sleep(0.2)  # their first looks found nothing: both wait
    spec = job("j", targets={"match": "ram_mb >= 8192"})
    assert (await client.post("/jobs", json=spec)).status == 201
    answer = await asyncio.wait_for(polls[1], 10)  # the hold is 30 s
    assert answer.status == 200
    assert (await answer.json())["job_id"] == "j"
    assert not polls[0].done()
    polls[0].cancel()


async def test_a_beacon_wakes_no_poll_whose_claimant_has_nothing_queued(collector_factory):
    client = await collector_factory(long_poll_s=30)
    dispatcher = client.server.app[SERVICE].dispatcher
    await client.post("/devices/register", json=registration("d"))
    poll = asyncio.create_task(client.get("/devices/d/next-job"))
    await wait_for_polls(client, 1)
    await asyncio.sleep(0.2)  # its first look found nothing queued for d
    passes = dispatcher.passes
    for _ in range(5):
        assert (await client.post("/results", json=beacon("d", ac=True))).status == 200
    assert dispatcher.passes == passes  # no claim made: it would look at the same empty queue
    # A job d is refused for now (it needs AC power): the next beacon meeting it wakes the poll.
    spec = job("needs-ac", targets={"device_id": "d"}, constraints={"require_ac": True})
    await client.post("/results", json=beacon("d", ac=False))
    assert (await client.post("/jobs", json=spec)).status == 201
    await asyncio.sleep(0.2)
    assert not poll.done()
    await client.post("/results", json=beacon("d", ac=True))
    answer = await asyncio.wait_for(poll, 10)
    assert (await answer.json())["job_id"] == "needs-ac"


async def test_a_beacon_clearing_a_busy_flag_wakes_the_poll(collector_factory):
    """Busy with another collector's job, the device is offered nothing; the beacon that
    clears the flag wakes its waiting poll, which takes the job queued meanwhile."""
    client = await collector_factory(long_poll_s=30)
    await client.post("/devices/register", json=registration("d"))
    busy = {"job_id": "elsewhere", "collector": "other-collector"}
    await client.post("/results", json=beacon("d", busy=busy))
    await client.post("/jobs", json=job("j", targets={"device_id": "d"}))
    poll = asyncio.create_task(client.get("/devices/d/next-job"))
    await wait_for_polls(client, 1)
    await asyncio.sleep(0.2)
    assert not poll.done()
    await client.post("/results", json=beacon("d"))
    answer = await asyncio.wait_for(poll, 10)
    assert (await answer.json())["job_id"] == "j"

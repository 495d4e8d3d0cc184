"""Event-driven hand-out of jobs to waiting long polls.

A long poll registers a Waiter and sleeps on its future; nothing re-queries on a timer. When a
transaction commits jobs that became claimable (enqueue, requeue, release, preemption, promotion)
or a beacon that may satisfy a constraint, the dispatcher picks the waiters that could take them
(executor, pin, declared workload: cheap checks in memory) and claims for them in one transaction
on the writer thread. Each claim runs the full rules against fresh rows, so the cheap pre-check
only decides who is asked, never who gets a job.

A waiter being claimed for is "reserved": its poll does not time out from under a claim in
flight. If the poll went away anyway (client gone, shutdown), the claimed job is handed back at
once instead of waiting for its lease to lapse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from fleet_min.collector.jobs import rules
from fleet_min.collector.jobs.claims import Claimant, claimant_key
from fleet_min.collector.jobs.effects import JobRoute

log = logging.getLogger(__name__)

ClaimBatch = Callable[[list[Claimant]], Awaitable[list[dict[str, Any] | None]]]
HandBack = Callable[[str, Claimant], Coroutine[Any, Any, None]]


@dataclass(eq=False)
class Waiter:
    claimant: Claimant
    capabilities: list[str] | None = None  # declared, for the cheap pre-check
    future: asyncio.Future[dict[str, Any] | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    reserved: bool = False
    missed: bool = False   # a wake-up arrived while reserved; look again
    expired: bool = False  # the poll's time ran out during a claim: answer None if it finds none

    def could_take(self, job: JobRoute) -> bool:
        if job.executor != self.claimant.executor:
            return False
        if job.pin and job.pin != self.claimant.id:
            return False
        return self.claimant.executor == "host" or rules.offers(
            self.capabilities, job.workload, job.variant)


class Dispatcher:
    def __init__(self, claim_batch: ClaimBatch, hand_back: HandBack) -> None:
        self._claim_batch = claim_batch
        self._hand_back = hand_back
        self._waiters: dict[Waiter, None] = {}  # insertion-ordered: first come, first served
        # The same waiters by claimant: a pinned job (the usual case) is looked up among its own
        # claimant's polls, not checked against every poll that is waiting.
        self._by_claimant: dict[str, dict[Waiter, None]] = {}
        self._jobs: list[JobRoute] = []
        self._claimants: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # close() waits for a claim in flight to be delivered
        self.closed = False
        self.passes = 0  # wake-ups of the dispatch loop

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="dispatcher")

    async def close(self) -> None:
        """Answer every waiting poll with nothing and stop."""
        self.closed = True
        async with self._lock:
            if self._task:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            for waiter in list(self._waiters):
                if not waiter.future.done():
                    waiter.future.set_result(None)
            self._waiters.clear()
            self._by_claimant.clear()

    def add(self, waiter: Waiter) -> None:
        if self.closed:
            waiter.future.set_result(None)
            return
        self._waiters[waiter] = None
        self._by_claimant.setdefault(waiter.claimant.key, {})[waiter] = None

    def remove(self, waiter: Waiter) -> None:
        if waiter not in self._waiters:
            return
        del self._waiters[waiter]
        key = waiter.claimant.key
        same = self._by_claimant[key]
        del same[waiter]
        if not same:
            del self._by_claimant[key]

    def _could_take_any(self, jobs: list[JobRoute]) -> list[Waiter]:
        """The waiting polls that might take one of these jobs, first come first served."""
        pinned = {claimant_key(job.executor, job.pin) for job in jobs if job.pin}
        if len(pinned) < len(jobs):  # a job for any claimant: every poll is a candidate
            return [w for w in self._waiters if any(w.could_take(job) for job in jobs)]
        same = [w for key in pinned for w in self._by_claimant.get(key, ())]
        if len(pinned) > 1:
            arrival = {w: i for i, w in enumerate(self._waiters)} if same else {}
            same.sort(key=arrival.__getitem__)
        return [w for w in same if any(w.could_take(job) for job in jobs)]

    def jobs_claimable(self, jobs: list[JobRoute]) -> None:
        if jobs:
            self._jobs.extend(jobs)
            self._wake.set()

    def claimants_changed(self, keys: list[str]) -> None:
        # Only claimants with a poll waiting: one that polls later looks for itself, after the
        # change committed. (Every closed job names its claimant here, mostly with no poll.)
        waiting = [key for key in keys if key in self._by_claimant]
        if waiting:
            self._claimants.update(waiting)
            self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self.passes += 1
            jobs, self._jobs = self._jobs, []
            keys, self._claimants = self._claimants, set()
            try:
                async with self._lock:
                    await self._dispatch(jobs, keys)
            except asyncio.CancelledError:
                raise
            except Exception:  # keep serving; the next wake-up retries
                log.exception("dispatch failed")

    def _chosen(self, jobs: list[JobRoute], keys: set[str]) -> list[Waiter]:
        chosen: list[Waiter] = []
        budget = len(jobs)
        takers = set(self._could_take_any(jobs)) if jobs else set()
        for waiter in self._waiters:
            wanted = waiter.claimant.key in keys
            if not wanted and budget > 0 and waiter in takers:
                wanted, budget = True, budget - 1
            if not wanted:
                continue
            if waiter.reserved:
                waiter.missed = True
                continue
            chosen.append(waiter)
        return chosen

    async def _dispatch(self, jobs: list[JobRoute], keys: set[str]) -> None:
        remaining = list(jobs)
        tried: set[Waiter] = set()
        while True:
            chosen = [w for w in self._chosen(remaining, keys) if w not in tried]
            if not chosen:
                return
            tried.update(chosen)
            for waiter in chosen:
                waiter.reserved = True
            results = await self._claim_batch([w.claimant for w in chosen])
            claimed = 0
            for waiter, job in zip(chosen, results, strict=True):
                waiter.reserved = False
                if job is not None:
                    claimed += 1
                    self._deliver(waiter, job)
                elif waiter.expired:
                    self.remove(waiter)
                    if not waiter.future.done():
                        waiter.future.set_result(None)
            keys = set()
            # Each claim consumed one claimable job; with jobs left, ask the next waiters.
            remaining = remaining[claimed:]
            if not remaining:
                return

    def reserve_for(self, jobs: list[JobRoute]) -> tuple[list[Waiter], bool]:
        """Waiters that could take these jobs, one per job, first come first served, reserved
        for a claim made inside the transaction that made the jobs claimable (so the enqueue and
        the claim share one commit). Call on the loop's thread; settle() them after the commit.

        Also says whether that was every waiting poll that could take one: then a claim for each
        settles the jobs' fate for the polls waiting now (a later poll looks for itself), and the
        dispatcher need not be woken to offer them again.
        """
        chosen: list[Waiter] = []
        everyone = True
        for waiter in self._could_take_any(jobs):
            if len(chosen) == len(jobs):
                everyone = False
                break
            if waiter.future.done():
                continue
            if waiter.reserved:  # its claim in flight looks again (missed) or is the dispatcher's
                waiter.missed = True
                everyone = False
                continue
            waiter.reserved = True
            chosen.append(waiter)
        return chosen, everyone

    def unreserve(self, waiters: list[Waiter]) -> None:
        """Undo reserve_for when the transaction that reserved is rolled back to run again."""
        for waiter in waiters:
            waiter.reserved = False

    def settle(self, handouts: list[tuple[Waiter, dict[str, Any] | None]]) -> None:
        """After the commit (or its failure, with None for every job): deliver or release."""
        for waiter, job in handouts:
            waiter.reserved = False
            if job is not None:
                self._deliver(waiter, job)
            elif waiter.expired:
                self.remove(waiter)
                if not waiter.future.done():
                    waiter.future.set_result(None)
            elif waiter.missed:
                self.claimants_changed([waiter.claimant.key])

    async def claim_now(self, waiter: Waiter,
                        first: Callable[[Waiter], Awaitable[dict[str, Any] | None]]
                        ) -> dict[str, Any] | None:
        """The poll's own first look, made while registered so no wake-up is lost meanwhile.

        `first` claims and also learns what the cheap pre-check needs (the capabilities); it
        looks again while a wake-up was missed meanwhile.
        """
        while True:
            waiter.reserved, waiter.missed = True, False
            try:
                job = await first(waiter)
            finally:
                waiter.reserved = False
            if job is not None or not waiter.missed:
                return job

    def _deliver(self, waiter: Waiter, job: dict[str, Any]) -> None:
        self.remove(waiter)
        if waiter.future.done():  # the poll went away while we claimed for it
            asyncio.get_running_loop().create_task(
                self._hand_back(job["job_id"], waiter.claimant))
            return
        waiter.future.set_result(job)

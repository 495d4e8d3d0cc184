"""Waiting long polls and the jobs handed to them: the one owner of a poll's wait.

A long poll calls `Dispatcher.wait`: it registers a Waiter, makes its own first look (a claim,
in one transaction), and otherwise sleeps on the waiter's future until a job is handed to it or
its hold runs out. Nothing re-queries on a timer. Jobs reach waiting polls two ways:

- inside the transaction that made them claimable (an enqueue, a requeue, a promotion, a
  release), `claim_inline` claims for the waiters that could take them, so the enqueue and the
  claim share one commit; the `Handouts` it returns are delivered after that commit;
- after a commit, `offer` takes the jobs still claimable and the claimants whose constraints may
  now hold (a beacon, an edit, a freed slot), and the dispatch loop claims for the waiters that
  could take them, in one transaction for all of them.

The waiters are picked by cheap checks in memory (executor, pin, declared workload); each claim
runs the full rules against fresh rows, so the pre-check only decides who is asked, never who
gets a job.

A waiter being claimed for is "reserved": its poll does not time out from under a claim in
flight. Every claim ends by releasing it (with the job, with nothing, or with its failure), so
a poll whose hold ran out meanwhile always answers. A job claimed for a poll that went away
(client gone, handler cancelled, shutdown) is handed back at once instead of waiting for its
lease to lapse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fleet_min.collector.jobs import claims, queue, rules
from fleet_min.collector.jobs.claims import Claimant
from fleet_min.collector.jobs.effects import Effects, JobRoute, claimant_key
from fleet_min.db import replayable
from fleet_min.timeutil import now

log = logging.getLogger(__name__)

# Service.transact: run fn(conn, *args, effects, **kwargs) as one transaction, apply its effects.
Transact = Callable[..., Awaitable[Any]]
Job = dict[str, Any]  # a claimed job as the poll's client gets it


@dataclass(eq=False)
class Waiter:
    claimant: Claimant
    capabilities: list[str] | None = None  # its device's or executor's, for the pre-check
    future: asyncio.Future[Job | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    reserved: bool = False
    missed: bool = False   # a wake-up arrived while reserved; look again
    expired: bool = False  # the poll's time ran out during a claim: answer None if it finds none

    def could_take(self, job: JobRoute) -> bool:
        if job.executor != self.claimant.executor:
            return False
        if job.pin and job.pin != self.claimant.id:
            return False
        return rules.offers(self.capabilities, job.workload, job.variant)


class _PollLook:
    """What a poll's own claim transaction knows of its poll: whether the poll was abandoned
    before the transaction ran, and the job the transaction claimed."""

    __slots__ = ("abandoned", "job")

    def __init__(self) -> None:
        self.abandoned = False
        self.job: Job | None = None


@replayable
def _poll_look(conn: sqlite3.Connection, claimant: Claimant, current: float, poll: _PollLook,
               effects: Effects, caller: str | None = None
               ) -> tuple[list[str] | None, Job | None]:
    """claims.first_claim for a poll that is still there (see Dispatcher._look)."""
    if poll.abandoned:
        return None, None
    capabilities, poll.job = claims.first_claim(conn, claimant, current, effects, caller)
    return capabilities, poll.job


def _job_on(future: asyncio.Future[Job | None]) -> Job | None:
    """The job a poll's future holds, if it was handed one."""
    if future.done() and not future.cancelled():
        return future.result()
    return None


class Handouts:
    """The claims one transaction made for waiting polls (Dispatcher.claim_inline). Their
    waiters stay reserved until the transaction's outcome is known: `deliver` after its commit,
    `fail` when it failed, `undo` when the writer runs it again."""

    __slots__ = ("_dispatcher", "claims", "everyone")

    def __init__(self, dispatcher: Dispatcher, claims: list[tuple[Waiter, Job | None]],
                 everyone: bool) -> None:
        self._dispatcher = dispatcher
        self.claims = claims
        # Every poll waiting now that could take one of the jobs was claimed for: the jobs' fate
        # is settled for them (a later poll looks for itself), so they need no offer.
        self.everyone = everyone

    def deliver(self, effects: Effects) -> None:
        """After the commit: hand each claimed job to its poll; the jobs left to offer are
        those nobody took, unless every poll that could take one was asked."""
        if self.everyone:
            effects.claimable = []
        if not self.claims:  # the usual enqueue: no poll waiting could take its jobs
            return
        taken = {job["job_id"] for _, job in self.claims if job is not None}
        if taken and effects.claimable:
            effects.claimable = [r for r in effects.claimable if r.job_id not in taken]
        self._dispatcher.settle(self.claims)

    def fail(self) -> None:
        """The transaction did not commit: nothing was claimed."""
        self._dispatcher.settle([(waiter, None) for waiter, _ in self.claims])

    def undo(self) -> None:
        """The writer rolled the transaction back to run it again (see fleet_min.db)."""
        for waiter, _ in self.claims:
            waiter.reserved = False


class Dispatcher:
    def __init__(self, transact: Transact) -> None:
        self._transact = transact
        self._waiters: dict[Waiter, None] = {}  # insertion-ordered: first come, first served
        # The same waiters by claimant: a pinned job (the usual case) is looked up among its own
        # claimant's polls, not checked against every poll that is waiting.
        self._by_claimant: dict[str, dict[Waiter, None]] = {}
        self._jobs: list[JobRoute] = []
        self._claimants: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._hand_backs: set[asyncio.Task[None]] = set()
        self._nobody = Handouts(self, [], True)  # no poll waits that could take the jobs
        self._lock = asyncio.Lock()  # close() waits for a claim in flight to be delivered
        self.closed = False
        self.passes = 0  # wake-ups of the dispatch loop

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def waiting_for(self, executor: str) -> set[str]:
        """The ids of the claimants of this kind with a poll waiting now."""
        prefix = claimant_key(executor, "")
        return {key[len(prefix):] for key in self._by_claimant if key.startswith(prefix)}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="dispatcher")

    async def close(self) -> None:
        """Answer every waiting poll with nothing, stop, and let the hand-backs in flight
        finish (the database is still open)."""
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
        await asyncio.gather(*self._hand_backs, return_exceptions=True)

    # -- a poll ---------------------------------------------------------------------------

    async def wait(self, claimant: Claimant, hold_s: float, caller: str | None = None
                   ) -> Job | None:
        """Hold a poll until a job is claimed for it or hold_s passes (then None).

        A job claimed for this poll is returned, or handed back at once: also when the hold
        runs out in the same turn of the loop as the job is handed over, and when the poll is
        cancelled (its client went away) after that. Raises NotFound when a device polls before
        registering, Forbidden when `caller` (the mesh node the poll came from) may not act for
        the claimant: checked by the first look, before anything is claimed for the poll.
        """
        waiter = Waiter(claimant)
        self._add(waiter)
        try:
            if waiter.future.done():  # shutting down
                return None
            job = await self._first_look(waiter, caller)
            if job is not None:
                return job
            # asyncio.wait, not wait_for: it never cancels the future, so a job set on it just
            # as the hold ran out is seen below instead of being lost with the cancellation.
            await asyncio.wait((waiter.future,), timeout=hold_s)
            if not waiter.future.done() and waiter.reserved:
                waiter.expired = True  # a claim for this poll is in flight: take its answer
                await asyncio.wait((waiter.future,))
            return _job_on(waiter.future)
        except BaseException:
            if (job := _job_on(waiter.future)) is not None:
                self._hand_back(job, claimant)
            raise
        finally:
            self._remove(waiter)
            if not waiter.future.done():
                waiter.future.cancel()

    async def _first_look(self, waiter: Waiter, caller: str | None) -> Job | None:
        """The poll's own look, made while registered so no wake-up is lost meanwhile; it
        looks again while a wake-up was missed during the look."""
        while True:
            waiter.reserved, waiter.missed = True, False
            try:
                job = await self._look(waiter, caller)
            finally:
                waiter.reserved = False
            if job is not None or not waiter.missed:
                return job

    async def _look(self, waiter: Waiter, caller: str | None) -> Job | None:
        """One look: its device's capabilities (for the pre-check) and a claim, in one
        transaction.

        The writer runs a transaction even when its caller was cancelled meanwhile (its client
        went away): a transaction that has not run yet claims nothing then, and a job claimed by
        one that has run goes back at once."""
        poll = _PollLook()
        try:
            capabilities, job = await (
                self._transact(_poll_look, waiter.claimant, now(), poll) if caller is None
                else self._transact(_poll_look, waiter.claimant, now(), poll, caller=caller))
        except asyncio.CancelledError:
            poll.abandoned = True
            if poll.job is not None:
                self._hand_back(poll.job, waiter.claimant)
            raise
        waiter.capabilities = capabilities
        return job

    def _hand_back(self, job: Job, claimant: Claimant) -> None:
        """Give back a job claimed for a poll that cannot deliver it (its client went away)."""
        task = asyncio.get_running_loop().create_task(
            self._give_back(job["job_id"], claimant), name="hand back")
        self._hand_backs.add(task)
        task.add_done_callback(self._hand_backs.discard)

    async def _give_back(self, job_id: str, claimant: Claimant) -> None:
        log.info("poll for %s went away before job %s was delivered; handing it back",
                 claimant.key, job_id)
        try:
            await self._transact(queue.hand_back_undelivered, job_id, claimant.id, now())
        except Exception:  # its lease lapses instead
            log.exception("handing back job %s failed", job_id)

    def _add(self, waiter: Waiter) -> None:
        if self.closed:
            waiter.future.set_result(None)
            return
        self._waiters[waiter] = None
        self._by_claimant.setdefault(waiter.claimant.key, {})[waiter] = None

    def _remove(self, waiter: Waiter) -> None:
        if waiter not in self._waiters:
            return
        del self._waiters[waiter]
        key = waiter.claimant.key
        same = self._by_claimant[key]
        del same[waiter]
        if not same:
            del self._by_claimant[key]

    # -- inside a transaction ---------------------------------------------------------------

    def claim_inline(self, conn: sqlite3.Connection, effects: Effects) -> Handouts | None:
        """Claims for the waiting polls that could take the jobs this transaction made
        claimable (effects.claimable), inside the same transaction: one commit for both.

        Runs on the loop's thread inside the writer's open transaction (see fleet_min.db). The
        claims share a savepoint: if one fails, all of them are undone, with what they recorded
        in `effects`, and the enqueue stands (the dispatch loop offers its jobs instead).
        """
        waiters, everyone = self._reserve_for(effects.claimable)
        if not waiters:
            return self._nobody if everyone else None
        current = now()
        recorded = effects.mark()
        conn.execute("SAVEPOINT inline_claim")
        try:
            handouts = [(w, claims.claim(conn, w.claimant, current, effects)) for w in waiters]
        except Exception:
            conn.execute("ROLLBACK TO inline_claim")
            conn.execute("RELEASE inline_claim")
            effects.rewind(recorded)  # those claims did not happen: no event, no figure
            log.exception("claiming for waiting polls inside the transaction failed")
            return Handouts(self, [(w, None) for w in waiters], False)
        conn.execute("RELEASE inline_claim")
        return Handouts(self, handouts, everyone)

    def _reserve_for(self, jobs: list[JobRoute]) -> tuple[list[Waiter], bool]:
        """Waiters that could take these jobs, one per job, first come first served, reserved
        for an inline claim; and whether that was every waiting poll that could take one."""
        chosen: list[Waiter] = []
        everyone = True
        for waiter in self._could_take_any(jobs):
            if len(chosen) == len(jobs):
                everyone = False
                break
            if waiter.future.done():
                continue
            if waiter.reserved:  # its claim in flight looks again (missed) or is the loop's
                waiter.missed = True
                everyone = False
                continue
            waiter.reserved = True
            chosen.append(waiter)
        return chosen, everyone

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

    # -- after a commit ---------------------------------------------------------------------

    def settle(self, handouts: list[tuple[Waiter, Job | None]]) -> None:
        """The outcome of claims made for reserved waiters (None: nothing claimed, or the claim
        failed): deliver or release each."""
        for waiter, job in handouts:
            waiter.reserved = False
            if job is not None:
                self._deliver(waiter, job)
            elif waiter.expired:
                self._remove(waiter)
                if not waiter.future.done():
                    waiter.future.set_result(None)
            elif waiter.missed:
                self.offer([], [waiter.claimant.key])

    def offer(self, jobs: list[JobRoute], claimants: list[str]) -> None:
        """Jobs a commit made claimable, and claimants whose constraints may now hold (a
        beacon, an edit, a freed slot): the dispatch loop claims for the waiters that could
        take them."""
        if jobs:
            self._jobs.extend(jobs)
            self._wake.set()
        # Only claimants with a poll waiting: one that polls later looks for itself, after the
        # change committed. (Every closed job names its claimant here, mostly with no poll.)
        waiting = [key for key in claimants if key in self._by_claimant]
        if waiting:
            self._claimants.update(waiting)
            self._wake.set()

    def _deliver(self, waiter: Waiter, job: Job) -> None:
        self._remove(waiter)
        if waiter.future.done():  # the poll went away while we claimed for it
            self._hand_back(job, waiter.claimant)
            return
        waiter.future.set_result(job)

    # -- the dispatch loop ------------------------------------------------------------------

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
            try:
                results = await self._claim_batch([w.claimant for w in chosen])
            except BaseException:
                # Nothing was claimed: release the waiters, so that a poll whose hold ran out
                # meanwhile answers instead of waiting for a claim that will never come.
                self._release(chosen)
                raise
            claimed = 0
            for waiter, job in zip(chosen, results, strict=True):
                waiter.reserved = False
                if job is not None:
                    claimed += 1
                    self._deliver(waiter, job)
                elif waiter.expired:
                    self._remove(waiter)
                    if not waiter.future.done():
                        waiter.future.set_result(None)
            keys = set()
            # Each claim consumed one claimable job; with jobs left, ask the next waiters.
            remaining = remaining[claimed:]
            if not remaining:
                return

    def _release(self, waiters: list[Waiter]) -> None:
        """A batch claim failed: the waiters are free again, and those whose hold ran out get
        their answer (nothing)."""
        for waiter in waiters:
            waiter.reserved = False
            if waiter.expired:
                self._remove(waiter)
                if not waiter.future.done():
                    waiter.future.set_result(None)

    async def _claim_batch(self, claimants: list[Claimant]) -> list[Job | None]:
        result: list[Job | None] = await self._transact(claims.claim_many, claimants, now())
        return result

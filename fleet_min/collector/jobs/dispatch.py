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
gets a job. The waiting polls are indexed (`WaitingPolls`) by claimant and by declared workload,
so a wake-up looks only at the polls that could take its jobs: with thousands of agents holding
polls, a beacon's wake-up costs the same as with one.

A waiter being claimed for is "reserved": its poll does not time out from under a claim in
flight. Every claim ends by releasing it (with the job, with nothing, or with its failure), so
a poll whose hold ran out meanwhile always answers. A job claimed for a poll that went away
(client gone, handler cancelled, shutdown) is handed back at once instead of waiting for its
lease to lapse.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import logging
import sqlite3
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fleet_min.collector.jobs import claims, queue, rules
from fleet_min.collector.jobs.claims import Claimant
from fleet_min.collector.jobs.effects import Effects, JobRoute, claimant_key
from fleet_min.db import replayable, rows_only
from fleet_min.timeutil import now

log = logging.getLogger(__name__)

# Service.transact: run fn(conn, *args, effects, **kwargs) as one transaction, apply its effects.
Transact = Callable[..., Awaitable[Any]]
Job = dict[str, Any]  # a claimed job as the poll's client gets it


_arrivals = itertools.count()


@dataclass(eq=False, slots=True)  # slots: thousands are held at once
class Waiter:
    claimant: Claimant
    capabilities: list[str] | None = None  # its device's or executor's, for the pre-check
    seq: int = field(default_factory=_arrivals.__next__)  # arrival order: first come, first served
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


Bucket = tuple[str, str | None]  # (executor, declared workload); None: offered any workload


def _buckets(waiter: Waiter) -> tuple[Bucket, ...]:
    """Where a waiter is filed for jobs pinned to nobody: under each workload it declared, or
    under None when it takes any (it never said: a device or a host executor alike)."""
    executor = waiter.claimant.executor
    if waiter.capabilities is None:
        return _any_workload(executor)
    return tuple((executor, name) for name in rules.declared_workloads(waiter.capabilities) or ())


@functools.cache
def _any_workload(executor: str) -> tuple[Bucket, ...]:
    """The one bucket of a waiter that takes any workload, shared by all of them."""
    return ((executor, None),)


class WaitingPolls:
    """The waiting polls, in arrival order, by claimant, and by (executor, declared workload):
    a wake-up reads only the polls that could take its jobs, never every poll."""

    __slots__ = ("_all", "_by_bucket", "_by_claimant", "_filed")

    def __init__(self) -> None:
        self._all: dict[Waiter, None] = {}  # insertion-ordered: first come, first served
        # Dicts, not lists, though a claimant mostly has one poll (a list would save 170 bytes
        # a poll): one that opens thousands must not make each poll's end cost a scan.
        self._by_claimant: dict[str, dict[Waiter, None]] = {}
        self._by_bucket: dict[Bucket, dict[Waiter, None]] = {}
        self._filed: dict[Waiter, tuple[Bucket, ...]] = {}

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, waiter: Waiter) -> bool:
        return waiter in self._all

    def __iter__(self) -> Iterator[Waiter]:
        return iter(self._all)

    def has_claimant(self, key: str) -> bool:
        return key in self._by_claimant

    def claimant_keys(self) -> Iterator[str]:
        """The keys of the claimants with a poll waiting."""
        return iter(self._by_claimant)

    def add(self, waiter: Waiter) -> None:
        self._all[waiter] = None
        self._by_claimant.setdefault(waiter.claimant.key, {})[waiter] = None
        self._file(waiter)

    def remove(self, waiter: Waiter) -> None:
        if waiter not in self._all:
            return
        del self._all[waiter]
        _discard(self._by_claimant, waiter.claimant.key, waiter)
        for bucket in self._filed.pop(waiter):
            _discard(self._by_bucket, bucket, waiter)

    def refile(self, waiter: Waiter) -> None:
        """The waiter's declared capabilities changed (its look read them)."""
        if waiter in self._all:
            for bucket in self._filed.pop(waiter):
                _discard(self._by_bucket, bucket, waiter)
            self._file(waiter)

    def clear(self) -> None:
        self._all.clear()
        self._by_claimant.clear()
        self._by_bucket.clear()
        self._filed.clear()

    def _file(self, waiter: Waiter) -> None:
        buckets = self._filed[waiter] = _buckets(waiter)
        for bucket in buckets:
            self._by_bucket.setdefault(bucket, {})[waiter] = None

    def of_claimants(self, keys: Iterable[str]) -> list[Waiter]:
        return [w for key in keys for w in self._by_claimant.get(key, ())]

    def could_take_any(self, jobs: list[JobRoute]) -> Iterator[Waiter]:
        """The waiting polls that might take one of these jobs, first come first served, read
        lazily: a caller that needs one poll stops at the first."""
        sources: dict[object, Iterable[Waiter]] = {}
        for job in jobs:
            if job.pin:
                key = claimant_key(job.executor, job.pin)
                sources[key] = self._by_claimant.get(key, ())
            else:
                for bucket in ((job.executor, job.workload), (job.executor, None)):
                    sources[bucket] = self._by_bucket.get(bucket, ())
        # A bucket filed after a look may hold a later arrival before an earlier one: the merge
        # then yields nearly, not strictly, in arrival order, which is all fairness needs here.
        # Read synchronously: nothing adds or removes a poll while a caller walks this.
        found = [source for source in sources.values() if source]
        merged: Iterable[Waiter] = (found[0] if len(found) == 1
                                    else heapq.merge(*found, key=_arrival))
        seen: set[Waiter] = set()
        for waiter in merged:
            if waiter not in seen and any(waiter.could_take(job) for job in jobs):
                seen.add(waiter)
                yield waiter


def _arrival(waiter: Waiter) -> int:
    return waiter.seq


def _discard(index: dict[Any, dict[Waiter, None]], key: Any, waiter: Waiter) -> None:
    same = index[key]
    del same[waiter]
    if not same:
        del index[key]


class _Holds:
    """The polls whose hold is running; each is answered (see `_hold_over`) when it runs out.

    One timer for each length of hold, armed for the earliest deadline, rather than a timer a
    poll: a timer costs about half a KiB (the loop's handle and its libuv timer), thousands of
    polls are held at once, and a poll that gets a job stops its hold early. The holds of one
    length start in order, so their deadlines are in insertion order and the earliest is first.
    """

    __slots__ = ("_queues", "_timers")

    def __init__(self) -> None:
        # Ordered dicts: the earliest found, and any poll taken out, in constant time.
        self._queues: dict[float, OrderedDict[Waiter, float]] = {}
        self._timers: dict[float, asyncio.TimerHandle] = {}

    def start(self, waiter: Waiter, hold_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + hold_s
        self._queues.setdefault(hold_s, OrderedDict())[waiter] = deadline
        if hold_s not in self._timers:
            self._timers[hold_s] = loop.call_at(deadline, self._sweep, hold_s)

    def stop(self, waiter: Waiter, hold_s: float) -> None:
        """Take a poll out (it ended before its hold did). Its timer, if armed for it, finds an
        earlier-due poll or none when it fires, and re-arms or ends."""
        holding = self._queues.get(hold_s)
        if holding is not None:
            holding.pop(waiter, None)

    def __len__(self) -> int:
        return sum(len(holding) for holding in self._queues.values())

    def clear(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._queues.clear()

    def _sweep(self, hold_s: float) -> None:
        del self._timers[hold_s]
        holding = self._queues.get(hold_s)
        loop = asyncio.get_running_loop()
        current = loop.time()
        while holding:
            waiter, deadline = next(iter(holding.items()))
            if deadline > current:
                self._timers[hold_s] = loop.call_at(deadline, self._sweep, hold_s)
                return
            del holding[waiter]
            _hold_over(waiter)
        self._queues.pop(hold_s, None)


class _PollLook:
    """What a poll's own claim transaction knows of its poll: whether the poll was abandoned
    before the transaction ran, and the job the transaction claimed."""

    __slots__ = ("abandoned", "job")

    def __init__(self) -> None:
        self.abandoned = False
        self.job: Job | None = None


@replayable
@rows_only
def _poll_look(conn: sqlite3.Connection, claimant: Claimant, current: float, poll: _PollLook,
               effects: Effects, caller: str | None = None
               ) -> tuple[list[str] | None, Job | None]:
    """claims.first_claim for a poll that is still there (see Dispatcher._look)."""
    if poll.abandoned:
        return None, None
    capabilities, poll.job = claims.first_claim(conn, claimant, current, effects, caller)
    return capabilities, poll.job


def _hold_over(waiter: Waiter) -> None:
    """A poll's hold ran out: it answers None, unless a claim for it is in flight; then it is
    marked expired and the claim's outcome answers it (a job it claimed is delivered, since
    the claim reserved the poll before the hold ran out)."""
    if waiter.future.done():
        return
    if waiter.reserved:
        waiter.expired = True
    else:
        waiter.future.set_result(None)


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
        self._polls = WaitingPolls()
        self._holds = _Holds()
        self._jobs: list[JobRoute] = []
        self._claimants: set[str] = set()
        # Claimants with a poll waiting whose last claim found nothing queued for them at all:
        # their beacons wake nobody (a job that could be theirs is offered when it is queued).
        self._nothing_queued: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._hand_backs: set[asyncio.Task[None]] = set()
        self._nobody = Handouts(self, [], True)  # no poll waits that could take the jobs
        self._lock = asyncio.Lock()  # close() waits for a claim in flight to be delivered
        self.closed = False
        self.passes = 0  # wake-ups of the dispatch loop

    @property
    def waiting(self) -> int:
        return len(self._polls)

    @property
    def holding(self) -> int:
        """Polls whose hold is running (their first look found nothing)."""
        return len(self._holds)

    def waiting_for(self, executor: str) -> set[str]:
        """The ids of the claimants of this kind with a poll waiting now."""
        prefix = claimant_key(executor, "")
        return {key[len(prefix):] for key in self._polls.claimant_keys()
                if key.startswith(prefix)}

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
            for waiter in list(self._polls):
                if not waiter.future.done():
                    waiter.future.set_result(None)
            self._polls.clear()
            self._holds.clear()
            self._nothing_queued.clear()
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
            # The hold ends through _Holds rather than asyncio.wait with a timeout: that costs
            # a set, a closure, a second future, two coroutine frames and a timer per held
            # poll, some 1.6 KiB each while thousands are held (bench/idle_polls.py).
            self._holds.start(waiter, hold_s)
            try:
                return await waiter.future
            finally:
                self._holds.stop(waiter, hold_s)
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
        # A poll that got its job is taken out next, with no await between: nothing to refile.
        if job is None and capabilities != waiter.capabilities:
            waiter.capabilities = capabilities
            self._polls.refile(waiter)
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
        self._polls.add(waiter)

    def _remove(self, waiter: Waiter) -> None:
        self._polls.remove(waiter)
        if not self._polls.has_claimant(waiter.claimant.key):
            self._nothing_queued.discard(waiter.claimant.key)

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
        for waiter in self._polls.could_take_any(jobs):
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

    # -- after a commit ---------------------------------------------------------------------

    def settle(self, handouts: list[tuple[Waiter, Job | None]]) -> None:
        """The outcome of claims made for reserved waiters (None: nothing claimed, or the claim
        failed): deliver or release each."""
        for waiter, job in handouts:
            waiter.reserved = False
            if job is not None:
                self._deliver(waiter, job)
            elif waiter.expired:
                self._answer_expired(waiter)
            elif waiter.missed:
                self.offer([], [waiter.claimant.key])

    def looked(self, outcomes: list[tuple[str, bool]]) -> None:
        """Claims that found no job, each with whether anything stood in the way (see
        claims.claim): a claimant with nothing queued for it at all is not woken by a beacon."""
        for key, stood_in_the_way in outcomes:
            if stood_in_the_way:
                self._nothing_queued.discard(key)
            elif self._polls.has_claimant(key):
                self._nothing_queued.add(key)

    def offer(self, jobs: list[JobRoute], claimants: Iterable[str],
              beacons: Iterable[str] = ()) -> None:
        """Jobs a commit made claimable, claimants whose constraints may now hold (an edit, a
        freed slot) and claimants that beaconed: the dispatch loop claims for the waiters that
        could take them."""
        if jobs:
            self._jobs.extend(jobs)
            self._wake.set()
        # Only claimants with a poll waiting: one that polls later looks for itself, after the
        # change committed. (Every closed job names its claimant here, mostly with no poll.)
        waiting = [key for key in claimants if self._polls.has_claimant(key)]
        # A beacon changes only what a claim was refused for: with nothing queued for the
        # claimant, it would look at the same empty queue (with thousands of agents beaconing,
        # that was a claim transaction a beacon).
        waiting += [key for key in beacons if self._polls.has_claimant(key)
                    and key not in self._nothing_queued]
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

    def _chosen(self, jobs: list[JobRoute], keys: set[str], tried: set[Waiter]) -> list[Waiter]:
        """The waiters to claim for, first come first served: every poll of the claimants in
        `keys`, and one poll not tried yet for each job (reserved ones count: their claim in
        flight looks again). Read from the index, never by walking every waiting poll."""
        wanted = {w: None for w in self._polls.of_claimants(keys)}
        budget = len(jobs)
        if budget:
            for waiter in self._polls.could_take_any(jobs):
                if waiter in wanted or waiter in tried:
                    continue
                wanted[waiter] = None
                budget -= 1
                if not budget:
                    break
        chosen: list[Waiter] = []
        for waiter in sorted(wanted, key=_arrival) if len(wanted) > 1 else wanted:
            if waiter in tried:
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
            chosen = self._chosen(remaining, keys, tried)
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
                    self._answer_expired(waiter)
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
                self._answer_expired(waiter)

    def _answer_expired(self, waiter: Waiter) -> None:
        """A poll whose hold ran out while a claim for it was in flight, and the claim brought
        it nothing: it answers now, with nothing."""
        self._remove(waiter)
        if not waiter.future.done():
            waiter.future.set_result(None)

    async def _claim_batch(self, claimants: list[Claimant]) -> list[Job | None]:
        result: list[Job | None] = await self._transact(claims.claim_many, claimants, now())
        return result

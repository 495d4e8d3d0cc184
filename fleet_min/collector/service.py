"""The running collector: its database, dispatcher, event hub, identity and background loops.

Handlers reach domain code through `Service.transact`, which runs a transaction function on the
writer thread and, only after it has committed, publishes its events and wakes waiting polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import platform
import secrets
import socket
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fleet_min import filemodes, jsonio
from fleet_min.collector.jobs import claims, queue
from fleet_min.collector.jobs.claims import Claimant
from fleet_min.collector.jobs.dispatch import Dispatcher, Waiter
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.storage.schema import MIGRATIONS
from fleet_min.config import Config
from fleet_min.db import Database, replayable
from fleet_min.sse import EventHub
from fleet_min.timeutil import iso, now

log = logging.getLogger("fleet_min.collector")


def stable_id(data_dir: Path) -> str:
    """The collector's id: made once, kept in the data directory, never overridable."""
    path = data_dir / "collector-id"
    try:
        existing = path.read_text().strip()
        if existing:
            return existing
    except FileNotFoundError:
        pass
    value = "col-" + secrets.token_hex(8)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    filemodes.create_file(tmp, filemodes.COLLECTOR_FILE)
    tmp.write_text(value + "\n")
    os.replace(tmp, path)
    return value


CLOCK_JUMP_S = 10.0  # wall-clock moves beyond elapsed monotonic time by more than this: a jump


class ClockWatch:
    """Notices the host's wall clock being stepped (NTP catching up, an operator, a VM resumed)
    by comparing how far it moved with how far the monotonic clock moved."""

    def __init__(self) -> None:
        self._wall, self._mono = time.time(), time.monotonic()

    def jump(self) -> float:
        """Seconds the wall clock was stepped since the last look (0.0 when it was not)."""
        wall, mono = time.time(), time.monotonic()
        stepped = (wall - self._wall) - (mono - self._mono)
        self._wall, self._mono = wall, mono
        return stepped if abs(stepped) > CLOCK_JUMP_S else 0.0


def rebase_clock(conn: sqlite3.Connection, jump: float, effects: Effects) -> None:
    """Move stored wall-clock times that measure elapsed time by a detected clock jump.

    Lease deadlines and last-seen times mean "so long after that moment"; a stepped clock must
    neither expire every lease at once (forward) nor stretch a dead agent's lease (backward), nor
    make every device look silent. Schedules stay on the wall clock: a job due at 09:00 runs at
    the new 09:00 (the scheduler handles both directions).
    """
    conn.execute("UPDATE jobs SET lease_deadline = lease_deadline + ? WHERE status = 'claimed' "
                 "AND lease_deadline IS NOT NULL", (jump,))
    conn.execute("UPDATE devices SET last_seen = last_seen + ?, "
                 "last_beacon_at = last_beacon_at + ?, busy_at = busy_at + ?",
                 (jump, jump, jump))
    conn.execute("UPDATE executor_nodes SET seen_at = seen_at + ?", (jump,))
    effects.emit("clock", jump_s=round(jump, 3))


class _PollLook:
    """What a poll's own claim transaction knows of its poll: whether the poll was abandoned
    before the transaction ran, and the job the transaction claimed."""

    __slots__ = ("abandoned", "job")

    def __init__(self) -> None:
        self.abandoned = False
        self.job: dict[str, Any] | None = None


@replayable
def _poll_look(conn: sqlite3.Connection, claimant: Claimant, current: float, poll: _PollLook,
               effects: Effects, caller: str | None = None
               ) -> tuple[list[str] | None, dict[str, Any] | None]:
    """claims.first_claim for a poll that is still there (see Service._first_claim)."""
    if poll.abandoned:
        return None, None
    capabilities, poll.job = claims.first_claim(conn, claimant, current, effects, caller)
    return capabilities, poll.job


def _job_on(future: asyncio.Future[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The job a poll's future holds, if it was handed one."""
    if future.done() and not future.cancelled():
        return future.result()
    return None


def _speedups() -> list[str]:
    """The optional compiled speed-ups in use (the `fast` extra), for /api/health."""
    active = []
    if type(asyncio.get_running_loop()).__module__.split(".")[0] == "uvloop":
        active.append("uvloop")
    if jsonio.FAST:
        active.append("orjson")
    return active


class Service:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.data_dir = Path(config.data_dir)
        self.db = Database(self.data_dir / "fleet.sqlite3", MIGRATIONS, config.synchronous,
                           filemodes.COLLECTOR_FILE)
        self.hub = EventHub()
        self.dispatcher = Dispatcher(self._claim_batch, self._hand_back)
        self.collector_id = ""
        self.instance = uuid.uuid4().hex
        self.name = config.name or socket.gethostname()
        self.started_at = now()
        self.clock = ClockWatch()
        self.guarded = False
        self._tasks: list[asyncio.Task[None]] = []
        # Called with every event after its transaction committed (CI status, alerts, ...).
        # A listener must not block: it schedules its own work with Service.spawn or a task.
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        # Extra fields merged into /api/health by features (e.g. the CI status flag).
        self.health_extras: list[Callable[[], dict[str, Any]]] = []
        # Coroutine functions run once the database is open (features start their loops here).
        self.on_started: list[Callable[[], Awaitable[None]]] = []
        # Called with the effects of every committed transaction (the metrics read the claim
        # waits and lease expiries there). Runs on the loop's thread; must be quick.
        self.on_applied: list[Callable[[Effects], None]] = []

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        # Nothing in the data directory is for other users (the database holds job specs and
        # results; artifacts may be unreleased builds): 0750 and 0640, tightened when looser.
        filemodes.private_dir(self.data_dir, filemodes.COLLECTOR_DIR)
        filemodes.tighten_children(self.data_dir, filemodes.COLLECTOR_DIR,
                                   filemodes.COLLECTOR_FILE)
        self.collector_id = stable_id(self.data_dir)
        await self.db.open()
        try:
            await self._start_loops()
        except BaseException:
            # aiohttp runs no on_cleanup after a failed start-up, and the database's threads
            # would otherwise keep the process alive after it reported the failure.
            await self.stop()
            raise

    async def _start_loops(self) -> None:
        self.dispatcher.start()
        swept = await self.sweep()
        if swept.requeued or swept.failed:
            log.info("start-up sweep: requeued %d, failed %d", len(swept.requeued),
                     len(swept.failed))
        self._tasks.append(asyncio.create_task(self._sweep_loop(), name="sweep"))
        self._tasks.append(asyncio.create_task(self._clock_loop(), name="clock-watch"))
        for hook in self.on_started:
            await hook()

    async def stop(self) -> None:
        """Answer open long polls, stop the loops, close the database."""
        await self.dispatcher.close()
        self.hub.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.db.close()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_s)
            try:
                await self.sweep()
            except Exception:
                log.exception("lease sweep failed; it runs again in %s s", self.config.sweep_s)

    async def sweep(self) -> queue.Swept:
        """The lease sweep, after making sure no clock jump is pending."""
        await self.check_clock()
        swept: queue.Swept = await self.transact(queue.sweep, now())
        return swept

    async def check_clock(self) -> None:
        """Rebase stored times if the wall clock was stepped since the last look. Called every
        second and before anything that compares stored times with now (sweep, alert tick)."""
        jump = self.clock.jump()
        if jump:
            await self._rebase(jump)

    async def _rebase(self, jump: float) -> None:
        log.warning("the wall clock was stepped by %+.0f s; lease deadlines and last-seen "
                    "times are moved with it", jump)
        effects = Effects()
        await self.db.write(rebase_clock, jump, effects)
        self.apply(effects)

    async def _clock_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.check_clock()
            except Exception:
                log.exception("clock check failed")

    def spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        """A background task owned by the service (cancelled when it stops)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        task.add_done_callback(self._forget_task)
        return task

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        if task in self._tasks:
            self._tasks.remove(task)

    # -- transactions -----------------------------------------------------------------------

    async def transact(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run fn(conn, *args, effects, **kwargs) as one transaction, then apply its effects.

        Jobs the transaction made claimable are claimed for waiting polls in the same
        transaction, so a dispatch costs one commit, not two (the enqueue's, then the claim's).
        """
        # A write stamped on a stepped clock would be moved again by the rebase: look first.
        jump = self.clock.jump()
        if jump:
            await self._rebase(jump)
        effects = Effects()
        handouts: list[tuple[Waiter, dict[str, Any] | None]] = []
        offered = False  # every poll that could take a claimable job was claimed for inline
        runs = 0

        def run(conn: sqlite3.Connection) -> Any:
            nonlocal runs, offered
            if runs:  # again, after the writer rolled its batch back (see fleet_min.db)
                self.dispatcher.unreserve([waiter for waiter, _ in handouts])
                handouts.clear()
                effects.clear()
                offered = False
            runs += 1
            result = fn(conn, *args, effects, **kwargs)
            if effects.claimable:
                claims, offered = self._claim_inline(conn, effects)
                handouts.extend(claims)
            return result

        try:
            result = await self.db.write(run, replay=getattr(fn, "replayable", False))
        except BaseException:
            self.dispatcher.settle([(waiter, None) for waiter, _ in handouts])
            raise
        if offered:  # nobody waiting now is left to offer the rest to: no dispatcher pass
            effects.claimable = []
        if handouts:
            taken = {job["job_id"] for _, job in handouts if job is not None}
            if taken and effects.claimable:
                effects.claimable = [r for r in effects.claimable if r.job_id not in taken]
            self.dispatcher.settle(handouts)
        self.apply(effects)
        return result

    def _claim_inline(self, conn: sqlite3.Connection, effects: Effects
                      ) -> tuple[list[tuple[Waiter, dict[str, Any] | None]], bool]:
        """Claims for the waiting polls that could take the jobs this transaction made
        claimable, and whether those were all of them (see Dispatcher.reserve_for). Runs inside
        the writer's transaction, on the loop's thread (see fleet_min.db)."""
        waiters, everyone = self.dispatcher.reserve_for(effects.claimable)
        if not waiters:
            return [], everyone
        current = now()
        waits = len(effects.claim_waits)
        conn.execute("SAVEPOINT inline_claim")
        try:
            handouts = [(w, claims.claim(conn, w.claimant, current, effects)) for w in waiters]
        except Exception:  # the enqueue stands; the dispatcher's own pass claims instead
            conn.execute("ROLLBACK TO inline_claim")
            conn.execute("RELEASE inline_claim")
            del effects.claim_waits[waits:]  # those claims were rolled back
            log.exception("claiming for waiting polls inside the transaction failed")
            return [(w, None) for w in waiters], False
        conn.execute("RELEASE inline_claim")
        return handouts, everyone

    def apply(self, effects: Effects) -> None:
        for hook in self.on_applied:
            try:
                hook(effects)
            except Exception:  # a figure missed must not keep events from being published
                log.exception("an effects hook failed")
        for event in effects.events:
            self.hub.publish(event)
            self._notify(event)
        for event in effects.unstreamed:
            self._notify(event)
        if effects.claimable:
            self.dispatcher.jobs_claimable(effects.claimable)
        if effects.claimants:
            self.dispatcher.claimants_changed(effects.claimants)

    def _notify(self, event: dict[str, Any]) -> None:
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:
                log.exception("event listener failed on %s", event.get("type"))

    async def _claim_batch(self, claimants: list[Claimant]) -> list[dict[str, Any] | None]:
        result: list[dict[str, Any] | None] = await self.transact(claims.claim_many, claimants,
                                                                  now())
        return result

    async def _first_claim(self, waiter: Waiter, caller: str | None = None
                           ) -> dict[str, Any] | None:
        """A poll's own look (its device's capabilities and a claim, in one transaction).

        The writer runs a transaction even when its caller was cancelled meanwhile (its client
        went away): a transaction that has not run yet claims nothing then, and a job claimed by
        one that has run goes back at once. `caller` is the mesh node the poll came from."""
        poll = _PollLook()
        try:
            capabilities, job = await self.transact(_poll_look, waiter.claimant, now(), poll,
                                                    caller=caller)
        except asyncio.CancelledError:
            poll.abandoned = True
            if poll.job is not None:
                self.hand_back_later(poll.job, waiter.claimant)
            raise
        waiter.capabilities = capabilities
        return job

    async def _hand_back(self, job_id: str, claimant: Claimant) -> None:
        log.info("poll for %s went away before job %s was delivered; handing it back",
                 claimant.key, job_id)
        await self.transact(queue.hand_back_undelivered, job_id, claimant.id, now())

    # -- long polls -------------------------------------------------------------------------

    async def next_job(self, claimant: Claimant, hold_s: float, caller: str | None = None
                       ) -> dict[str, Any] | None:
        """Hold a poll until a job is claimed for it or hold_s passes (then None).

        A job claimed for this poll is returned, or handed back at once: also when the hold
        runs out in the same turn of the loop as the job is handed over, and when the poll is
        cancelled (its client went away) after that. Raises NotFound when a device polls before
        registering, Forbidden when `caller` (the mesh node the poll came from) may not act for
        the claimant: checked by the first look, before anything is claimed for the poll.
        """
        waiter = Waiter(claimant)
        self.dispatcher.add(waiter)
        first = (self._first_claim if caller is None
                 else functools.partial(self._first_claim, caller=caller))
        try:
            if waiter.future.done():  # shutting down
                return None
            job = await self.dispatcher.claim_now(waiter, first)
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
                self.hand_back_later(job, claimant)
            raise
        finally:
            self.dispatcher.remove(waiter)
            if not waiter.future.done():
                waiter.future.cancel()

    def hand_back_later(self, job: dict[str, Any], claimant: Claimant) -> None:
        """Give back a job claimed for a poll that cannot deliver it (its client went away)."""
        self.spawn(self._hand_back(job["job_id"], claimant), name="hand back")

    # -- health -----------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        current = now()
        return {
            "ok": True,
            "collector": self.collector_id,
            "name": self.name,
            "instance": self.instance,
            "started_at": iso(self.started_at),
            "uptime_s": round(current - self.started_at, 3),
            "now": iso(current),
            "node": f"Python {platform.python_version()}",
            "speedups": _speedups(),
            "pid": os.getpid(),
            "stream_clients": self.hub.clients,
            "guard": self.guarded,
            "waiting_polls": self.dispatcher.waiting,
            "writer": self.db.stats,
            **{k: v for extra in self.health_extras for k, v in extra().items()},
        }

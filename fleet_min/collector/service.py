"""The running collector: its database, dispatcher, event hub, identity and background loops.

Handlers reach domain code through `Service.transact`, which runs a transaction function inside
the writer's open transaction (on the event loop's thread: see fleet_min.db) and, only after it
has committed, publishes its events and hands the dispatcher the jobs it made claimable. Waiting
long polls belong to the dispatcher (fleet_min.collector.jobs.dispatch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import socket
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fleet_min import filemodes, jsonio
from fleet_min.collector.jobs import queue, sightings
from fleet_min.collector.jobs.dispatch import Dispatcher, Handouts
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.storage import identity, restore
from fleet_min.collector.storage.schema import MIGRATIONS
from fleet_min.config import CollectorConfig
from fleet_min.db import Database, Periodic, StorageError
from fleet_min.sse import EventHub
from fleet_min.timeutil import iso, now

log = logging.getLogger("fleet_min.collector")


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


def _speedups() -> list[str]:
    """The optional compiled speed-ups in use (the `fast` extra), for /api/health."""
    active = []
    if type(asyncio.get_running_loop()).__module__.split(".")[0] == "uvloop":
        active.append("uvloop")
    if jsonio.FAST:
        active.append("orjson")
    return active


class Service:
    def __init__(self, config: CollectorConfig) -> None:
        self.config = config
        self.data_dir = Path(config.data_dir)
        self.db = Database(self.data_dir / "fleet.sqlite3", MIGRATIONS, config.synchronous,
                           filemodes.COLLECTOR_FILE)
        self.hub = EventHub()
        self.dispatcher = Dispatcher(self.transact)
        self.sightings = sightings.Sightings()
        self.collector_id = ""
        self.instance = uuid.uuid4().hex
        self.name = config.name or socket.gethostname()
        self.started_at = now()
        self.clock = ClockWatch()
        self.guarded = False
        self._tasks: list[asyncio.Task[None]] = []
        # The hooks features add in their setup (fleet_min.collector.http):
        # called with every event after its transaction committed (CI status, topic polls, the
        # metrics). A listener must not block: it schedules its own work with Service.spawn.
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        # Extra fields merged into /api/health (e.g. the CI status flag).
        self.health_extras: list[Callable[[], dict[str, Any]]] = []
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
        # Before anything is made: a new id or an empty database on a half-restored directory
        # would hide the data the interrupted restore had moved aside.
        for problem in (restore.interrupted(self.data_dir), restore.orphan_log(self.data_dir)):
            if problem:
                raise StorageError(problem)
        try:
            self.collector_id = identity.stable_id(self.data_dir)
        except ValueError as exc:
            raise StorageError(f"{exc}; restore it from a backup, or remove it to make a new "
                               "id (peers that pinned the old one then list this collector "
                               "as changed)") from None
        await self.db.open()
        try:
            await self._start_loops()
        except BaseException:
            # A start-up that failed leaves no cleanup behind it (aiohttp completes only the
            # cleanup contexts that were entered), and the database's threads would otherwise
            # keep the process alive after it reported the failure.
            await self.stop()
            raise

    async def _start_loops(self) -> None:
        self.dispatcher.start()
        swept = await self.sweep()
        if swept.requeued or swept.failed:
            log.info("start-up sweep: requeued %d, failed %d", len(swept.requeued),
                     len(swept.failed))
        loops = (("sweep", Periodic("the lease sweep", log), self.config.sweep_s, self.sweep),
                 ("clock-watch", Periodic("the clock check", log), 1.0, self.check_clock),
                 # what fails to be written is kept for the next try
                 ("sightings", Periodic("the devices' last_seen from their polls", log),
                  sightings.FLUSH_EVERY_S, self.write_sightings))
        for name, periodic, period_s, work in loops:
            self._tasks.append(asyncio.create_task(periodic.every(period_s, work), name=name))

    async def stop(self) -> None:
        """Answer open long polls, stop the loops, write the last sightings, close the
        database."""
        await self.dispatcher.close()
        self.hub.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        # A failure is said and stopping goes on: what is lost is a second of sightings.
        await Periodic("the devices' last sightings", log).run(self.write_sightings)
        await self.db.close()

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
        self.sightings.shift(jump)
        self.apply(effects)

    async def write_sightings(self) -> None:
        """Write the devices seen by polls since the last time (see jobs.sightings)."""
        seen = self.sightings.take()
        if not seen:
            return
        try:
            await self.db.write(sightings.record, seen)
        except BaseException:
            self.sightings.note(seen)  # kept for the next try (newer sightings win)
            raise

    def spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        """A background task owned by the service (cancelled when it stops, if its feature did
        not stop it before: see stop_tasks)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        task.add_done_callback(self._forget_task)
        return task

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        if task in self._tasks:
            self._tasks.remove(task)

    async def stop_tasks(self, tasks: Iterable[asyncio.Task[None]]) -> None:
        """Cancel a feature's tasks and wait until each has ended (a feature's cleanup)."""
        tasks = list(tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- transactions -----------------------------------------------------------------------

    async def transact(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run fn(conn, *args, effects, **kwargs) as one transaction, then apply its effects.

        Jobs the transaction made claimable are claimed for waiting polls in the same
        transaction (Dispatcher.claim_inline), so a dispatch costs one commit, not two (the
        enqueue's, then the claim's); the claimed jobs are handed over after the commit.
        """
        # A write stamped on a stepped clock would be moved again by the rebase: look first.
        jump = self.clock.jump()
        if jump:
            await self._rebase(jump)
        effects = Effects()
        handouts: Handouts | None = None
        runs = 0

        def run(conn: sqlite3.Connection) -> Any:
            nonlocal runs, handouts
            if runs:  # again, after the writer rolled its batch back (see fleet_min.db)
                if handouts is not None:
                    handouts.undo()
                    handouts = None
                effects.clear()
            runs += 1
            result = fn(conn, *args, effects, **kwargs)
            if effects.claimable:
                handouts = self.dispatcher.claim_inline(conn, effects)
            return result

        try:
            result = await self.db.write(run, replay=getattr(fn, "replayable", False),
                                         rows_only=getattr(fn, "rows_only", False))
        except BaseException:
            if handouts is not None:
                handouts.fail()
            raise
        if handouts is not None:
            handouts.deliver(effects)
        self.apply(effects)
        return result

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
        if effects.sightings:
            self.sightings.note(effects.sightings)
        if effects.looked:
            self.dispatcher.looked(effects.looked)
        if effects.claimable or effects.claimants or effects.beacons:
            self.dispatcher.offer(effects.claimable, effects.claimants, effects.beacons)

    def _notify(self, event: dict[str, Any]) -> None:
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:
                log.exception("event listener failed on %s", event.get("type"))

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

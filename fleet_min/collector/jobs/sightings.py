"""Devices seen by their long polls, written to `last_seen` together, once a second.

An agent keeps a long poll open and renews it every 25 s; its look for a job usually finds
none and writes nothing, except the device's `last_seen`, which a renewal finds a hold's
length old. Written in the look's own transaction, that made every renewal a durable COMMIT
(an fsync, a write to an SD card's flash) and a hand-off to the COMMIT thread and back: the
larger part of what a fleet of idle agents costs the collector. A look now records its
sighting here instead, and the service writes what gathered in one transaction a second
(a `Periodic` task the service starts), so a look that claims nothing is answered without a COMMIT
(`fleet_min.db.rows_only`).

What that gives up: `last_seen` may lag a poll by up to a second and a transaction (statuses
change at 3 and 15 minutes), and a crash loses the last second's sightings, which no client
was ever told were stored. Beacons, results and registrations still touch `last_seen` in their
own transactions.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable

from fleet_min.collector.jobs.devices import TOUCH_EVERY_S
from fleet_min.db import replayable

FLUSH_EVERY_S = 1.0


class Sightings:
    """The newest sighting of each device not yet written, by device id."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def note(self, seen: Iterable[tuple[str, float]]) -> None:
        pending = self._pending
        for device_id, at in seen:
            if at > pending.get(device_id, 0.0):
                pending[device_id] = at

    def shift(self, jump: float) -> None:
        """Move the pending times with a stepped wall clock, as the stored ones are moved
        (`fleet_min.collector.service.rebase_clock`)."""
        for device_id in self._pending:
            self._pending[device_id] += jump

    def take(self) -> list[tuple[str, float]]:
        """Everything pending, forgotten here: the caller writes it (or notes it again)."""
        taken = list(self._pending.items())
        self._pending.clear()
        return taken


@replayable
def record(conn: sqlite3.Connection, seen: list[tuple[str, float]]) -> None:
    """Write sightings to `last_seen`, under the rule of `devices.touch`: never backwards (a
    beacon may have written a newer time since), and not for less than TOUCH_EVERY_S. A
    device deleted meanwhile matches no row."""
    conn.executemany("UPDATE devices SET last_seen = ? WHERE device_id = ? AND last_seen < ?",
                     [(at, device_id, at - TOUCH_EVERY_S) for device_id, at in seen])

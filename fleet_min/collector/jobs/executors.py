"""Host executors as the collector knows them: each name that polled /executor/next-job, when
it last did and how many jobs it said it may hold (`?slots=`). Executors do not register; this
is what a fan-out over executors reaches (queue.fanout_executors)."""

from __future__ import annotations

import sqlite3

from fleet_min.collector.jobs import rules

# A second's precision is plenty for a 15-minute horizon; an executor polling in a tight loop
# does not rewrite its row every time.
SEEN_EVERY_S = 1.0


def seen(conn: sqlite3.Connection, name: str, slots: int, now: float) -> None:
    """Record a poll by this executor (a statement of the poll's own transaction)."""
    conn.execute(
        "INSERT INTO executors (name, first_seen, last_poll, slots) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (name) DO UPDATE SET last_poll = excluded.last_poll, "
        "slots = excluded.slots WHERE executors.last_poll < excluded.last_poll - ? "
        "OR executors.slots != excluded.slots",
        (name, now, now, slots, SEEN_EVERY_S))


# Executors that polled within EXECUTOR_RECENT_S, or hold a claimed host job now (a busy
# executor with one slot does not poll until its job is done), in name order. One parameter:
# the horizon (recent_since).
RECENT_SQL = ("SELECT name FROM executors WHERE last_poll >= ? UNION "
              "SELECT claimed_by FROM jobs WHERE status = 'claimed' AND executor = 'host' "
              "ORDER BY 1")


def recent_since(now: float) -> float:
    return now - rules.EXECUTOR_RECENT_S


def recent(conn: sqlite3.Connection, now: float) -> list[str]:
    return [row[0] for row in conn.execute(RECENT_SQL, (recent_since(now),))]


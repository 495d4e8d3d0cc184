"""Pipeline topics: publish JSON payloads to a named topic and read them back with a cursor.

A topic is only a name on stored events (table topic_events); it exists once something has
been published to it. Every event gets a `seq` from one collector-wide counter that never goes
back (AUTOINCREMENT), so a reader's cursor is simply the last seq it has seen.

Reading the next events is a long poll that wakes the moment an event is published: each
waiting poll parks a future under its topic, and the post-commit listener resolves them. The
future is parked before the database is read, so an event committed between the read and the
wait still wakes the poll.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
from typing import Any

from fleet_min.collector.jobs.effects import Effects
from fleet_min.db import Database
from fleet_min.errors import BadRequest
from fleet_min.timeutil import iso

TOPIC_NAME = re.compile(r"[A-Za-z0-9._:-]{1,100}")
MAX_PAYLOAD_BYTES = 64 * 1024
# Payloads up to this size ride along on the live stream's "topic" event; larger ones are
# announced without it (the stream's replay buffer holds 1000 events, so it stays small).
STREAM_PAYLOAD_BYTES = 4096
MAX_SOURCE_CHARS = 200
RECENT_DEFAULT, RECENT_MAX = 50, 500
NEXT_DEFAULT, NEXT_MAX = 100, 500
MAX_WAIT_S = 25.0
LISTED_TOPICS = 500  # GET /api/events lists the most recently active topics, at most this many
PREVIEW_PAYLOADS = 3
# Payloads a read of one topic carries, in bytes of stored JSON: the events past it are left
# for the next page (the cursor goes on from the last one given). At 500 events of 64 KiB a
# read was 31 MiB, and a parsed payload takes many times its text in memory.
READ_PAYLOAD_BYTES = 1 << 20


def check_topic(name: str) -> str:
    if not TOPIC_NAME.fullmatch(name):
        raise BadRequest("a topic name is 1 to 100 characters from A-Z a-z 0-9 . _ : -")
    return name


def check_source(raw: str | None) -> str | None:
    if raw is None or raw == "":
        return None
    if len(raw) > MAX_SOURCE_CHARS or not raw.isprintable():
        raise BadRequest(f"source must be printable text of at most {MAX_SOURCE_CHARS} "
                         "characters (a device or job id)")
    return raw


def encode_payload(payload: Any) -> str:
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    if len(text.encode()) > MAX_PAYLOAD_BYTES:
        raise BadRequest(f"a topic payload is at most {MAX_PAYLOAD_BYTES} bytes of JSON")
    return text


# -- writes ------------------------------------------------------------------------------------


def publish(conn: sqlite3.Connection, topic: str, payload_text: str, source: str | None,
            now: float, effects: Effects) -> dict[str, Any]:
    """Store one event; the live stream and waiting readers hear of it after the commit."""
    cursor = conn.execute(
        "INSERT INTO topic_events (topic, payload, source, at) VALUES (?, ?, ?, ?)",
        (topic, payload_text, source, now))
    seq = int(cursor.lastrowid or 0)
    event: dict[str, Any] = {"topic": topic, "seq": seq, "source": source}
    if len(payload_text) <= STREAM_PAYLOAD_BYTES:
        event["payload"] = json.loads(payload_text)
    else:
        event["payload_omitted"] = True
    effects.emit("topic", **event)
    # `id` is the original's name for the cursor (its clients poll with ?after=<id>).
    return {"ok": True, "topic": topic, "seq": seq, "id": seq, "at": iso(now)}


# -- reads -------------------------------------------------------------------------------------


def event_record(row: sqlite3.Row) -> dict[str, Any]:
    return {"seq": row["seq"], "at": iso(row["at"]), "source": row["source"],
            "payload": json.loads(row["payload"])}


def _within_bytes(page: str) -> str:
    """The rows of `page` (a SELECT of seq, at, source, payload in reading order) while their
    payloads add up to READ_PAYLOAD_BYTES, the first row always: counted by SQLite, so the
    payloads past the bound are never handed to Python."""
    return ("SELECT seq, at, source, payload FROM (SELECT *, SUM(length(CAST(payload AS BLOB))) "
            f"OVER (ROWS UNBOUNDED PRECEDING) - length(CAST(payload AS BLOB)) AS before FROM "
            f"({page})) WHERE before < {READ_PAYLOAD_BYTES}")


async def events_after(db: Database, topic: str, after: int, limit: int
                       ) -> list[dict[str, Any]]:
    rows = await db.read(_within_bytes("SELECT seq, at, source, payload FROM topic_events "
                                       "WHERE topic = ? AND seq > ? ORDER BY seq LIMIT ?"),
                         (topic, after, limit))
    return [event_record(r) for r in rows]


async def recent(db: Database, topic: str, limit: int, before: int | None) -> dict[str, Any]:
    """The newest events of one topic (newest first), optionally older than `before`."""
    summary = await db.read_one("SELECT COUNT(*) AS count, MAX(seq) AS last_seq, "
                                "MAX(at) AS last_at FROM topic_events WHERE topic = ?", (topic,))
    rows = await db.read(_within_bytes("SELECT seq, at, source, payload FROM topic_events "
                                       "WHERE topic = ? AND seq < ? ORDER BY seq DESC LIMIT ?"),
                         (topic, before if before is not None else 2**62, limit))
    return {"topic": topic, "count": summary["count"] if summary else 0,
            "last_seq": summary["last_seq"] if summary else None,
            "last_at": iso(summary["last_at"]) if summary else None,
            "events": [event_record(r) for r in rows]}


async def list_topics(db: Database) -> dict[str, Any]:
    """Topics, most recently active first, with counts and their newest payloads."""
    listed = await db.read(
        "SELECT topic, COUNT(*) AS count, MAX(seq) AS last_seq, MAX(at) AS last_at "
        "FROM topic_events GROUP BY topic ORDER BY last_seq DESC LIMIT ?", (LISTED_TOPICS,))
    if not listed:
        return {"topics": []}
    names = [row["topic"] for row in listed]
    # The seq of each topic's third-newest event bounds an index range scan per topic.
    previews = await db.read(
        """
        WITH cut AS (
            SELECT t.value AS topic,
                   COALESCE((SELECT seq FROM topic_events i WHERE i.topic = t.value
                             ORDER BY seq DESC LIMIT 1 OFFSET ?), 0) AS low
            FROM json_each(?) t
        )
        SELECT e.topic, e.seq, e.at, e.source, length(CAST(e.payload AS BLOB)) AS size,
               CASE WHEN length(CAST(e.payload AS BLOB)) <= ? THEN e.payload END AS payload
        FROM cut JOIN topic_events e ON e.topic = cut.topic AND e.seq >= cut.low
        ORDER BY e.seq DESC
        """, (PREVIEW_PAYLOADS - 1, json.dumps(names), STREAM_PAYLOAD_BYTES))
    # A preview carries a payload the live stream would carry (up to 4 KiB), as the stream
    # does: at 1,500 events of 64 KiB the listing was 93 MiB, and the dashboard reloads it at
    # every topic event.
    recent_by_topic: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for row in previews:
        recent_by_topic[row["topic"]].append(
            event_record(row) if row["payload"] is not None else
            {"seq": row["seq"], "at": iso(row["at"]), "source": row["source"],
             "payload_omitted": True, "payload_bytes": row["size"]})
    return {"topics": [
        {"topic": row["topic"], "count": row["count"], "last_seq": row["last_seq"],
         "last_at": iso(row["last_at"]), "recent": recent_by_topic[row["topic"]]}
        for row in listed]}


# -- long polls --------------------------------------------------------------------------------


class TopicWaiters:
    """Futures of the long polls waiting on each topic, resolved when the topic gets an event."""

    def __init__(self) -> None:
        self._waiting: dict[str, set[asyncio.Future[None]]] = {}
        self.closed = False

    @property
    def waiting(self) -> int:
        return sum(len(futures) for futures in self._waiting.values())

    def watch(self, topic: str) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.closed:
            future.set_result(None)
        else:
            self._waiting.setdefault(topic, set()).add(future)
        return future

    def forget(self, topic: str, future: asyncio.Future[None]) -> None:
        futures = self._waiting.get(topic)
        if futures is not None:
            futures.discard(future)
            if not futures:
                del self._waiting[topic]
        if not future.done():
            future.cancel()

    def wake(self, topic: str) -> None:
        for future in self._waiting.pop(topic, set()):
            if not future.done():
                future.set_result(None)

    def close(self) -> None:
        """Shutting down: answer every waiting poll now."""
        self.closed = True
        for topic in list(self._waiting):
            self.wake(topic)

    def on_event(self, event: dict[str, Any]) -> None:
        """A Service listener: called with every event after its transaction committed."""
        if event.get("type") == "topic":
            self.wake(str(event.get("topic")))


async def next_events(db: Database, waiters: TopicWaiters, topic: str, after: int, limit: int,
                      wait_s: float) -> list[dict[str, Any]]:
    """Events of `topic` after the cursor, waiting up to wait_s for the first (else [])."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        woken = waiters.watch(topic)  # parked before the read: no event slips between them
        try:
            events = await events_after(db, topic, after, limit)
            remaining = deadline - loop.time()
            if events or remaining <= 0 or waiters.closed:
                return events
            try:
                await asyncio.wait_for(woken, remaining)
            except TimeoutError:
                return []
        finally:
            waiters.forget(topic, woken)

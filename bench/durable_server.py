"""A second ceiling: the bare server made durable, and nothing more. Each of the collector's
three lifecycle requests parses its JSON body and runs the statements no durable queue can do
without (insert the job; claim it; store the result and close the job), and is answered only
after the COMMIT that holds them (WAL, synchronous=FULL). One writer thread commits whatever
requests are waiting as one transaction, so COMMITs are shared as the collector shares them.

There is no validation, no dispatcher or long poll, no leases, attempts, events or metrics: its
CPU a job is what aiohttp and sqlite3 alone need for a durable lifecycle, the floor under any
collector built on them (docs/performance.md, "Ceilings the remaining targets meet").

    python bench/durable_server.py PORT DATA_DIR
"""

from __future__ import annotations

import asyncio
import json
import queue
import sqlite3
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from bench.bare_server import lifecycle_app, serve

SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (device_id TEXT PRIMARY KEY, descriptor TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (seq INTEGER PRIMARY KEY, job_id TEXT NOT NULL UNIQUE,
    device_id TEXT, status TEXT NOT NULL, spec TEXT NOT NULL, claimed_at REAL);
CREATE INDEX IF NOT EXISTS jobs_queued ON jobs (device_id, seq) WHERE status = 'queued';
CREATE TABLE IF NOT EXISTS results (job_id TEXT NOT NULL, iter INTEGER NOT NULL,
    device_id TEXT NOT NULL, final INTEGER NOT NULL, ok INTEGER, metrics TEXT NOT NULL,
    at REAL NOT NULL, PRIMARY KEY (job_id, iter));
"""

Work = Callable[[sqlite3.Connection], Any]


class Writer:
    """One thread, one connection: takes every waiting piece of work, runs them in one
    transaction, COMMITs, then hands each caller its answer in one call into the loop."""

    def __init__(self, path: Path, loop: asyncio.AbstractEventLoop, schema: str) -> None:
        self.loop = loop
        self.inbox: queue.SimpleQueue[tuple[Work, asyncio.Future[Any]]] = queue.SimpleQueue()
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.executescript(schema)
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, work: Work) -> asyncio.Future[Any]:
        future = self.loop.create_future()
        self.inbox.put((work, future))
        return future

    def _run(self) -> None:
        while True:
            batch = [self.inbox.get()]
            while not self.inbox.empty():
                batch.append(self.inbox.get_nowait())
            self.conn.execute("BEGIN")
            answers = [work(self.conn) for work, _ in batch]
            self.conn.execute("COMMIT")
            self.loop.call_soon_threadsafe(_settle, batch, answers)


def _settle(batch: list[tuple[Work, asyncio.Future[Any]]], answers: list[Any]) -> None:
    for (_, future), answer in zip(batch, answers, strict=True):
        future.set_result(answer)


WRITER = web.AppKey("writer", Writer)
DATA_FILE = web.AppKey("data_file", Path)
SCHEMA_TEXT = web.AppKey("schema", str)  # the tables, when not this server's own


def writer(request: web.Request) -> Writer:
    return request.app[WRITER]


async def register(request: web.Request) -> web.Response:
    body = json.loads(await request.read())
    text = json.dumps(body.get("descriptor"))
    await writer(request).submit(lambda c: c.execute(
        "INSERT OR REPLACE INTO devices VALUES (?, ?)", (body["device_id"], text)))
    return web.json_response({"ok": True})


async def enqueue(request: web.Request) -> web.Response:
    raw = await request.read()
    spec = json.loads(raw)
    device = (spec.get("targets") or {}).get("device_id")
    await writer(request).submit(lambda c: c.execute(
        "INSERT INTO jobs (job_id, device_id, status, spec) VALUES (?, ?, 'queued', ?)",
        (spec["job_id"], device, raw.decode())))
    return web.json_response({"ok": True, "job_id": spec["job_id"], "status": "queued"},
                             status=201)


def _claim(conn: sqlite3.Connection, device: str) -> str | None:
    row = conn.execute("SELECT seq, spec FROM jobs WHERE device_id = ? AND status = 'queued' "
                       "ORDER BY seq LIMIT 1", (device,)).fetchone()
    if row is None:
        return None
    conn.execute("UPDATE jobs SET status = 'claimed', claimed_at = ? WHERE seq = ?",
                 (time.time(), row[0]))
    return str(row[1])


def next_job_with(claim: Callable[[sqlite3.Connection, str], str | None]
                  ) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The poll's handler: `claim` runs in the writer's transaction, the spec it returns is
    the answer (204 when it returns None)."""
    async def next_job(request: web.Request) -> web.Response:
        device = request.match_info["device_id"]
        spec = await writer(request).submit(lambda c: claim(c, device))
        if spec is None:
            return web.Response(status=204)
        return web.Response(text=spec, content_type="application/json")

    return next_job


next_job = next_job_with(_claim)


def _store(conn: sqlite3.Connection, row: dict[str, Any]) -> None:
    conn.execute("INSERT INTO results VALUES (?, ?, ?, ?, ?, ?, ?)",
                 (row["job_id"], row["iter"], row["device_id"], int(row["final"]),
                  int(row["ok"]), json.dumps(row["metrics"]), time.time()))
    if row["final"]:
        conn.execute("UPDATE jobs SET status = ? WHERE job_id = ?",
                     ("succeeded" if row["ok"] else "failed", row["job_id"]))


async def results(request: web.Request) -> web.Response:
    row = json.loads(await request.read())
    await writer(request).submit(lambda c: _store(c, row))
    return web.json_response({"ok": True})


async def start_writer(app: web.Application) -> None:
    app[WRITER] = Writer(app[DATA_FILE], asyncio.get_running_loop(),
                         app.get(SCHEMA_TEXT, SCHEMA))


def main() -> None:
    app = lifecycle_app(enqueue, next_job, results, register)
    app[DATA_FILE] = Path(sys.argv[2]) / "durable.db"
    app.on_startup.append(start_writer)
    serve(app, int(sys.argv[1]))

if __name__ == "__main__":
    main()

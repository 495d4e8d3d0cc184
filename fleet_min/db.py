"""SQLite access: one writer thread with group commit, one read connection through aiosqlite.

Why a writer thread of our own rather than aiosqlite for writes: a write in this project is a whole
transaction (a Python function that runs several statements), and it must reach the database in
one hop. The writer takes every transaction waiting in its queue, runs each inside its own
SAVEPOINT (so one failing rolls back alone), and commits them together: one fsync for the batch.
That is group commit; it is how throughput is found without lowering `synchronous`.

Reads go through aiosqlite on a second connection; WAL lets them run while the writer commits.
Migrations are applied in order by PRAGMA user_version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite

log = logging.getLogger(__name__)

T = TypeVar("T")
Params = Sequence[Any] | dict[str, Any]

_STOP = object()
_MAX_BATCH = 512
_SYNCHRONOUS = {"OFF", "NORMAL", "FULL", "EXTRA"}


def like_escape(text: str) -> str:
    """Escape LIKE's wildcards so text matches literally (use with ESCAPE '\\')."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


class StorageError(RuntimeError):
    """The database refused a commit (disk full, read-only file, I/O error)."""


def _connect(path: Path, synchronous: str, *, readonly: bool = False) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA busy_timeout = 30000")
    if not readonly:
        conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute("PRAGMA temp_store = MEMORY")
    if readonly:
        conn.execute("PRAGMA query_only = ON")
    return conn


def migrate(conn: sqlite3.Connection, migrations: Sequence[str]) -> int:
    """Apply the migrations past PRAGMA user_version, each in its own transaction."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > len(migrations):
        raise StorageError(
            f"the database is at schema version {version}, newer than this program knows "
            f"({len(migrations)}); upgrade fleet_min or restore a matching backup")
    for number, script in enumerate(migrations[version:], start=version + 1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _split_sql(script):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {number}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return len(migrations)


def _split_sql(script: str) -> list[str]:
    statements, buffer = [], ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            statements.append(buffer.strip())
            buffer = ""
    if buffer.strip():
        statements.append(buffer.strip())
    return statements


class _Writer(threading.Thread):
    def __init__(self, conn: sqlite3.Connection) -> None:
        super().__init__(name="fleet-db-writer", daemon=True)
        self.conn = conn
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.batches = 0
        self.transactions = 0

    def run(self) -> None:
        while True:
            first = self.jobs.get()
            if first is _STOP:
                break
            batch = [first]
            while len(batch) < _MAX_BATCH:
                try:
                    item = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    self.jobs.put(_STOP)
                    break
                batch.append(item)
            self._run_batch(batch)
        self.conn.close()

    def _run_batch(self, batch: list[Any]) -> None:
        outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        conn = self.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            self._deliver(batch[0][3], [(fut, None, _storage(exc)) for _, _, fut, _ in batch])
            return
        for fn, args, fut, _loop in batch:
            conn.execute("SAVEPOINT tx")
            try:
                result = fn(conn, *args)
            except BaseException as exc:  # the caller gets it; the others in the batch go on
                conn.execute("ROLLBACK TO tx")
                conn.execute("RELEASE tx")
                outcomes.append((fut, None, exc))
            else:
                conn.execute("RELEASE tx")
                outcomes.append((fut, result, None))
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            error = _storage(exc)
            outcomes = [(fut, None, error) for fut, _, _ in outcomes]
        self.batches += 1
        self.transactions += len(batch)
        self._deliver(batch[0][3], outcomes)

    @staticmethod
    def _deliver(loop: asyncio.AbstractEventLoop,
                 outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
        # A loop closed under us at shutdown raises RuntimeError: nobody is waiting then.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_resolve_all, outcomes)


def _storage(exc: sqlite3.Error) -> StorageError:
    text = str(exc)
    if "full" in text:
        return StorageError("the disk holding the database is full; free space and retry")
    if "readonly" in text or "read-only" in text:
        return StorageError("the database file is read-only; check its permissions")
    return StorageError(f"the database refused the write: {text}")


def _resolve_all(outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for fut, result, exc in outcomes:
        if fut.cancelled():
            continue
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)


class Database:
    """The one way to the database: `await db.write(fn, ...)` and `await db.read(sql, ...)`."""

    def __init__(self, path: Path | str, migrations: Sequence[str],
                 synchronous: str = "FULL") -> None:
        self.path = Path(path)
        self.migrations = migrations
        self.synchronous = synchronous.upper()
        if self.synchronous not in _SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {sorted(_SYNCHRONOUS)}")
        self._writer: _Writer | None = None
        self._reader: aiosqlite.Connection | None = None

    async def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = await asyncio.to_thread(_connect, self.path, self.synchronous)
        await asyncio.to_thread(migrate, conn, self.migrations)
        self._writer = _Writer(conn)
        self._writer.start()
        self._reader = await aiosqlite.connect(self.path, isolation_level=None)
        self._reader.row_factory = sqlite3.Row
        await self._reader.execute("PRAGMA query_only = ON")
        await self._reader.execute("PRAGMA busy_timeout = 30000")

    async def close(self) -> None:
        if self._reader is not None:
            await self._reader.close()
            self._reader = None
        if self._writer is not None:
            self._writer.jobs.put(_STOP)
            await asyncio.to_thread(self._writer.join)
            self._writer = None

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(conn, *args) as one transaction on the writer thread; return its result.

        The result is only returned after the batch holding it has committed (and, with
        synchronous=FULL, reached the disk).
        """
        if self._writer is None:
            raise StorageError("the database is closed")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._writer.jobs.put((fn, args, fut, loop))
        return await fut

    async def read(self, sql: str, params: Params = ()) -> list[sqlite3.Row]:
        if self._reader is None:
            raise StorageError("the database is closed")
        return list(await self._reader.execute_fetchall(sql, params))

    async def read_one(self, sql: str, params: Params = ()) -> sqlite3.Row | None:
        rows = await self.read(sql, params)
        return rows[0] if rows else None

    @property
    def stats(self) -> dict[str, int]:
        writer = self._writer
        return {"batches": writer.batches if writer else 0,
                "transactions": writer.transactions if writer else 0}

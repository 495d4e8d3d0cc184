"""SQLite access: one writer with group commit, one read connection through aiosqlite.

Why a writer of our own rather than aiosqlite for writes: a write in this project is a whole
transaction (a Python function that runs several statements) that must run with no await in
between. The writer runs each transaction as soon as it arrives, one after another inside one
open SQLite transaction, and commits all of them together when its COMMIT thread gets to it: one
fsync for the lot. That is group commit; it is how throughput is found without lowering
`synchronous`. One transaction failing must roll back alone; see `_OpenTransaction` for how that
is done without paying a SAVEPOINT for every transaction.

Reads go through aiosqlite on a second connection; WAL lets them run while the writer commits.
Migrations are applied in order by PRAGMA user_version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import shutil
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard, TypeVar

import aiosqlite

from fleet_min import filemodes

log = logging.getLogger(__name__)

T = TypeVar("T")
Params = Sequence[Any] | dict[str, Any]

_MAX_BATCH = 512
_SYNCHRONOUS = {"OFF", "NORMAL", "FULL", "EXTRA"}


def like_escape(text: str) -> str:
    """Escape LIKE's wildcards so text matches literally (use with ESCAPE '\\')."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def quote_identifier(name: str) -> str:
    """A table or column name as SQL reads it, whatever it holds (a name read from a database's
    own catalogue may hold a quote)."""
    return '"' + name.replace('"', '""') + '"'


class StorageError(RuntimeError):
    """The database refused a commit (disk full, read-only file, I/O error)."""


class Periodic:
    """One periodic task's runs (the lease sweep, the scheduler tick, ...). While the database
    refuses its writes it says so once, in a sentence, and once when it takes them again, not
    with a traceback every period: a full disk fails every write until space returns, and
    requests meanwhile get a 503 with a sentence. Any other failure is logged with its
    traceback. The task goes on either way."""

    def __init__(self, what: str, logger: logging.Logger) -> None:
        self.what = what
        self.log = logger
        self.failing = False

    async def run(self, work: Callable[[], Awaitable[Any]]) -> None:
        """One period's work."""
        try:
            await work()
        except StorageError as exc:
            if not self.failing:
                self.log.warning("%s cannot write to the database: %s; it is tried again each "
                                 "period", self.what, exc)
            self.failing = True
        except Exception:
            self.log.exception("%s failed; it runs again at the next period", self.what)
        else:
            if self.failing:
                self.log.info("%s writes to the database again", self.what)
            self.failing = False

    async def every(self, period_s: float, work: Callable[[], Awaitable[Any]]) -> None:
        """Run `work` every `period_s` seconds, the first time one period from now, until
        cancelled."""
        while True:
            await asyncio.sleep(period_s)
            await self.run(work)


F = TypeVar("F", bound=Callable[..., Any])


def replayable(fn: F) -> F:
    """Mark a transaction function as safe to run a second time.

    The writer may roll a batch back and run it again (see `_Writer`), so such a function must
    change nothing but the database and the objects it is handed for its results (Service's
    `Effects`), and must not mutate its arguments in a way a second run would notice.
    """
    fn.replayable = True  # type: ignore[attr-defined]
    return fn


def rows_only(fn: F) -> F:
    """Mark a transaction function that changes the database only by inserting, updating and
    deleting rows (no DDL, no PRAGMA that writes, no VACUUM), so that `conn.total_changes`
    tells whether it wrote anything. When it wrote nothing, and nothing before it in the open
    transaction did, the writer answers it at once instead of after the next COMMIT (see
    `_OpenTransaction`): a long poll's look that finds nothing is the common case."""
    fn.rows_only = True  # type: ignore[attr-defined]
    return fn


def _connect(path: Path, synchronous: str, *, readonly: bool = False) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA busy_timeout = 30000")
    if not readonly and conn.execute("PRAGMA page_count").fetchone()[0] == 0:
        # Only a new, empty file can take this: it lets retention give space back to the disk
        # (PRAGMA incremental_vacuum) instead of only reusing freed pages.
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
    if not readonly:
        conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute("PRAGMA temp_store = MEMORY")
    # Debian and others build SQLite with SECURE_DELETE on: every page a DELETE frees is
    # rewritten with zeros and the copy goes through the WAL. Forgetting 2,167 devices of 57 KB
    # took 0.36 s of transaction and a 1.3 s COMMIT of 161 MB (0.04 s and 1 MB with FAST, which
    # still zeroes what a DELETE leaves inside the pages it writes anyway); at the registry's
    # bound that held the event loop a minute and took 1.7 GB. Nothing kept here is a secret
    # whose freed pages need scrubbing (tokens live in files of their own).
    conn.execute("PRAGMA secure_delete = FAST")
    if readonly:
        conn.execute("PRAGMA query_only = ON")
    return conn


def _directory_problem(directory: Path) -> str | None:
    """Name what is wrong with the data directory, when something plainly is."""
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return "its directory is on a read-only file system"
        if not os.access(directory, os.W_OK):
            return "its directory is read-only for this user"
        if shutil.disk_usage(directory).free < 64 * 1024:
            return "the disk holding it is full"
    except OSError:
        return None
    return None


def _probe_writable(conn: sqlite3.Connection) -> None:
    """Fail now, with a sentence, on a file SQLite could only open read-only (an immutable file,
    a read-only mount), rather than later on every write."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    conn.execute(f"PRAGMA user_version = {int(version)}")


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


class _Writer:
    """Group commit on the event loop's thread, with only the COMMIT sent to a worker thread.

    Why not a writer thread: every sqlite3 call releases the GIL, and a writer thread must then
    win it back from a busy event loop, once per statement. Measured under load that convoy cost
    more than the work itself (a batch of 20 transactions took ~15 ms for a 2 ms fsync). Here
    transactions run back to back on the loop's thread, all plain Python and SQLite with no
    hand-offs, and only the COMMIT, which waits for the disk, runs in a thread of its own. While
    it syncs, the loop goes on serving requests and the next batch gathers. Results are handed
    out only after the COMMIT returned, so an acknowledged write is on disk. The COMMIT thread is
    a plain one fed by a queue rather than asyncio.to_thread: a batch's hand-off then costs a
    queue put and one call back to the loop, not an executor's futures and context copy.

    The COMMIT takes whatever ran before it started (see `_OpenTransaction`). Asking the thread
    to commit is quick, but the thread then has to be scheduled and win the GIL from the busy
    loop: 1 to 2 ms under the lifecycle load on two cores, longer than the COMMIT itself. The
    transactions that arrive in that time run at once inside the same open SQLite transaction
    and are committed with it, instead of waiting for the next COMMIT. The connection is held
    under `lock` by whichever side uses it; the loop never waits for it (a transaction arriving
    during a COMMIT waits in `pending` for the next one).
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.pending: list[_Pending] = []
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.batches = 0     # COMMITs
        self.transactions = 0
        self.replays = 0     # open transactions run a second time, in savepoints, after a failure
        self.run_s = 0.0     # time spent running transaction bodies (on the loop's thread)
        self.commit_s = 0.0  # from asking for a COMMIT until its answer reached the loop
        self.closing = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.lock = threading.Lock()
        self.open = _OpenTransaction(conn)
        self.commit_asked = False  # the COMMIT thread was told to commit and has not started
        self._asked_at = 0.0
        self._commits: queue.SimpleQueue[bool | None] = queue.SimpleQueue()
        self._committer = threading.Thread(target=self._commit_loop, name="db-commit",
                                           daemon=True)

    @property
    def in_flight(self) -> bool:
        """Something has run and no COMMIT has taken it yet."""
        return self.commit_asked or bool(self.open.outcomes)

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._committer.start()
        self.task = self.loop.create_task(self._run(), name="db-writer")

    def _commit_loop(self) -> None:
        """The COMMIT thread: commit what has run so far when told, then hand the answers to
        the loop."""
        loop = self.loop
        assert loop is not None
        while self._commits.get() is not None:
            with self.lock:
                self.commit_asked = False
                asked_at, outcomes = self._asked_at, self.open.take()
                error: BaseException | None = None
                try:
                    self.conn.execute("COMMIT")
                except BaseException as exc:  # handed to the loop, which answers every caller
                    error = exc
                    if self.conn.in_transaction:
                        with contextlib.suppress(sqlite3.Error):  # the thread must go on
                            self.conn.execute("ROLLBACK")
            loop.call_soon_threadsafe(self._committed, outcomes, error, asked_at)

    def _committed(self, outcomes: list[_Outcome], error: BaseException | None,
                   asked_at: float) -> None:
        self.commit_s += time.perf_counter() - asked_at
        self.batches += 1
        self.transactions += len(outcomes)
        if error is not None:
            failure = _whole_failure(error, "the commit")
            outcomes = [(fut, None, failure) for fut, _, _ in outcomes]
        _resolve_all(outcomes)
        if self.pending:
            self.wake.set()

    async def stop(self) -> None:
        # Every accepted write runs and is taken by a COMMIT; the thread's queue is first in,
        # first out, so joining it lets the last COMMIT finish (and its answers reach the loop
        # meanwhile) before the connection is closed.
        self.closing = True
        while self.pending or self.in_flight:
            self.wake.set()
            await asyncio.sleep(0.001)
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self._committer.is_alive():
            self._commits.put(None)
            await asyncio.to_thread(self._committer.join)
        await asyncio.to_thread(self.conn.close)

    async def _run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            # Not taken: the COMMIT thread is committing; its answer wakes us again.
            while self.pending and self.lock.acquire(blocking=False):
                try:
                    self._run_pending()
                finally:
                    self.lock.release()

    def _run_pending(self) -> None:
        """Run what is pending inside the open transaction and make sure a COMMIT is asked
        for. Called holding `lock`."""
        batch, self.pending = self.pending[:_MAX_BATCH], self.pending[_MAX_BATCH:]
        started = time.perf_counter()
        try:
            self.replays += self.open.run(batch)
            self.open.end_if_clean()
        finally:
            self.run_s += time.perf_counter() - started
        if self.open.outcomes and not self.commit_asked:
            self.commit_asked = True
            self._asked_at = time.perf_counter()
            self._commits.put(True)


class _OpenTransaction:
    """The writes run since the last COMMIT, inside one SQLite transaction, with their answers.

    One transaction failing must leave the others alone. A SAVEPOINT around each does that, but
    it costs two statements and, worse, a copy of every page a transaction changes that an
    earlier one had already changed: about 5 % of the collector's CPU per result row, measured.
    So replayable transactions (see `replayable`) run without savepoints. One that fails before
    writing anything (the usual refusal: an unknown job, a duplicate id) needs nothing undone.
    One that fails after writing, or with an error from SQLite itself, makes the whole open
    transaction roll back and run again, each write in its own savepoint: rare, and correct
    either way. Once a write that may not run twice has joined, everything after it in the same
    transaction runs in savepoints too, so a later failure never replays it.

    A transaction marked `rows_only` that changes no row while nothing before it in the open
    transaction has changed any (a long poll's look that finds nothing) read only what is
    committed already: it is answered at once, with no COMMIT to wait for, and an open
    transaction left with nothing else in it is ended on the spot (a COMMIT with nothing to
    write touches no file). A poll renewing its hold then costs no hand-off to the COMMIT
    thread and back, which on two busy cores cost more than the look itself.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.writes: list[_Pending] = []
        self.outcomes: list[_Outcome] = []
        self.guarded = False
        self.changes_at_begin = 0  # conn.total_changes when the open transaction began
        self.answered_early = 0  # transactions answered as they ran (they wrote nothing)

    def run(self, batch: list[_Pending]) -> int:
        """Run a batch inside the open transaction, opening one if none is open; how many
        replays that took (0 or 1). Every failure becomes an answer: a write's own failure is
        its caller's, a failure of the transaction is every caller's in it, answered at once."""
        conn = self.conn
        try:
            if not conn.in_transaction:
                conn.execute("BEGIN IMMEDIATE")
                self.changes_at_begin = conn.total_changes
            self.guarded = self.guarded or not all(item.replay for item in batch)
            ran = _run_bodies(conn, batch, guarded=self.guarded,
                              clean_since=self.changes_at_begin)
            if ran is not None:
                outcomes, clean = ran
                # Answered now: they ran before anything was written, so what they read is
                # committed; their callers resume only after this batch (and any COMMIT on
                # the spot) has returned to the loop.
                _resolve_all(outcomes[:clean])
                self.answered_early += clean
                self.writes.extend(batch[clean:])
                self.outcomes.extend(outcomes[clean:])
                return 0
            # A write failed after writing: undo everything since the last COMMIT, run it again.
            batch = self.writes + batch
            self._discard()
            conn.execute("ROLLBACK")
            conn.execute("BEGIN IMMEDIATE")
            self.guarded = True
            replayed = _run_bodies(conn, batch, guarded=True, clean_since=None)
            assert replayed is not None
            self.writes, self.outcomes = batch, replayed[0]
            return 1
        except Exception as exc:  # the transaction itself failed: nothing of it stands
            failure = _whole_failure(exc, "the write")
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):  # the writer must go on regardless
                    conn.execute("ROLLBACK")
            _resolve_all([(fut, None, failure) for fut, _, _ in self.outcomes]
                         + [(item.future, None, failure) for item in batch])
            self._discard()
            return 0

    def end_if_clean(self) -> None:
        """End the open transaction on the spot when nothing in it changed a row and every
        transaction in it has been answered: there is nothing for a COMMIT to make durable."""
        conn = self.conn
        if self.outcomes or not conn.in_transaction or conn.total_changes != self.changes_at_begin:
            return
        try:
            conn.execute("COMMIT")
        except sqlite3.Error:  # nothing to lose: end it the other way, the writer must go on
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        self._discard()

    def take(self) -> list[_Outcome]:
        """The answers of everything run since the last COMMIT, which is about to happen."""
        outcomes = self.outcomes
        self._discard()
        return outcomes

    def _discard(self) -> None:
        self.writes, self.outcomes, self.guarded = [], [], False


class _Pending(NamedTuple):
    """A write waiting for the writer."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]
    replay: bool  # may run a second time (see `replayable`)
    rows_only: bool = False  # total_changes tells whether it wrote (see `rows_only`)


_Outcome = tuple["asyncio.Future[Any]", Any, BaseException | None]


def _run_bodies(conn: sqlite3.Connection, batch: list[_Pending], *, guarded: bool,
                clean_since: int | None) -> tuple[list[_Outcome], int] | None:
    """Run each transaction of a batch inside the open transaction: the outcome of each and how
    many of the first ones ran with nothing changed since `clean_since` (conn.total_changes when
    the open transaction began; None counts none), or None when an unguarded one failed in a way
    only a rollback of the whole attempt can undo."""
    outcomes: list[_Outcome] = []
    clean = 0
    for fn, args, fut, _, only_rows in batch:
        if guarded:
            conn.execute("SAVEPOINT tx")
        changes = conn.total_changes
        try:
            result = fn(conn, *args)
        except Exception as exc:  # the caller gets it; the others in the batch go on
            if guarded:
                conn.execute("ROLLBACK TO tx")
                conn.execute("RELEASE tx")
            elif (conn.total_changes != changes or isinstance(exc, sqlite3.Error)
                  or not conn.in_transaction):
                return None  # it wrote something (or SQLite itself failed): undo all, replay
            # SQLite's own refusals (read-only file, full disk, I/O) are storage errors: the
            # client gets 503 with a sentence, not a 500.
            outcomes.append((fut, None, _storage(exc) if _is_storage(exc) else exc))
        else:
            if guarded:
                conn.execute("RELEASE tx")
            outcomes.append((fut, result, None))
        if not conn.in_transaction:
            # SQLite ends the whole transaction by itself on some failures (a full disk, an I/O
            # error) even when the statement's error was caught: nothing of the batch stands.
            raise StorageError("the database abandoned the transaction (a full disk or an I/O "
                               "error); the batch was not committed")
        if only_rows and clean == len(outcomes) - 1 and conn.total_changes == clean_since:
            clean += 1  # total_changes counts rows a savepoint rolled back too: never too many
    return outcomes, clean


# SQLite's answers that mean the storage is at fault (not our SQL): full, read-only, I/O, ...
_STORAGE_CODES = ("SQLITE_FULL", "SQLITE_READONLY", "SQLITE_IOERR", "SQLITE_CANTOPEN",
                  "SQLITE_PERM", "SQLITE_CORRUPT", "SQLITE_NOTADB")


def _is_storage(exc: BaseException) -> TypeGuard[sqlite3.Error]:
    return isinstance(exc, sqlite3.Error) and str(
        getattr(exc, "sqlite_errorname", "")).startswith(_STORAGE_CODES)


def _whole_failure(exc: BaseException, what: str) -> StorageError:
    """What every caller of a transaction or COMMIT that failed as a whole is told: SQLite's
    refusals in a sentence, anything else (a bug of ours) logged with its traceback."""
    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, sqlite3.Error):
        return _storage(exc)
    log.error("the database writer failed: %s", what, exc_info=exc)
    return StorageError(f"{what} failed: {exc}")


def _storage(exc: sqlite3.Error) -> StorageError:
    text = str(exc)
    if "full" in text:
        return StorageError("the disk holding the database is full; free space and retry")
    if "readonly" in text or "read-only" in text:
        return StorageError("the database file is read-only; check its permissions and mount")
    if "unable to open" in text:
        return StorageError("the database file cannot be opened; check that its directory is "
                            "writable and has free space")
    if "disk I/O" in text:
        return StorageError("the disk holding the database reported an I/O error")
    return StorageError(f"the database refused the write: {text}")


def _resolve(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():  # its caller went away (cancelled)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _resolve_all(outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for fut, result, exc in outcomes:
        _resolve(fut, result, exc)


class Database:
    """The one way to the database: `await db.write(fn, ...)` and `await db.read(sql, ...)`."""

    def __init__(self, path: Path | str, migrations: Sequence[str],
                 synchronous: str = "FULL", file_mode: int | None = None) -> None:
        self.path = Path(path)
        self.migrations = migrations
        self.file_mode = file_mode  # the most the database and its -wal and -shm may allow
        self.synchronous = synchronous.upper()
        if self.synchronous not in _SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {sorted(_SYNCHRONOUS)}")
        self._writer: _Writer | None = None
        self._reader: aiosqlite.Connection | None = None
        self._slots: dict[str, asyncio.Semaphore] = {}

    def slots(self, kind: str, count: int) -> asyncio.Semaphore:
        """The semaphore of one kind of costly read (`async with db.slots(kind, n):`): at most
        `count` of that kind run at once, so a client repeating one queues behind itself rather
        than taking every worker thread (read_in_thread) and the memory of each answer."""
        slots = self._slots.get(kind)
        if slots is None:
            slots = self._slots[kind] = asyncio.Semaphore(count)
        return slots

    async def open(self) -> None:
        """Open (creating if needed) and migrate; StorageError with a sentence when it cannot."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # SQLite follows links: one planted while the directory was loose would move the
            # database, and what it holds, wherever it points.
            for path in filemodes.database_files(self.path):
                filemodes.refuse_link(path)
            await asyncio.to_thread(self._keep_modes)
            conn = await asyncio.to_thread(_connect, self.path, self.synchronous)
            await asyncio.to_thread(migrate, conn, self.migrations)
            await asyncio.to_thread(_probe_writable, conn)
        except sqlite3.Error as exc:
            why = _directory_problem(self.path.parent) or _storage(exc).args[0]
            raise StorageError(f"cannot open the database {self.path}: {why}") from None
        except OSError as exc:
            raise StorageError(f"cannot open the database {self.path}: {exc.strerror or exc}"
                               ) from None
        self._writer = _Writer(conn)
        self._writer.start()
        await asyncio.to_thread(self._keep_modes)  # the -wal and -shm SQLite made just now
        self._reader = await aiosqlite.connect(self.path, isolation_level=None)
        self._reader.row_factory = sqlite3.Row
        await self._reader.execute("PRAGMA query_only = ON")
        await self._reader.execute("PRAGMA busy_timeout = 30000")

    def _keep_modes(self) -> None:
        """Create the database file with file_mode before SQLite does (SQLite then gives -wal
        and -shm the same mode), and take looser bits away from files that exist."""
        if self.file_mode is None:
            return
        with contextlib.suppress(OSError):  # SQLite's own attempt then words the problem
            filemodes.create_file(self.path, self.file_mode)
        for path in filemodes.database_files(self.path):
            filemodes.tighten(path, self.file_mode)

    async def close(self) -> None:
        """Answer and commit every write already accepted, then close both connections."""
        if self._writer is not None:
            await self._writer.stop()
            self._writer = None
        if self._reader is not None:
            await self._reader.close()
            self._reader = None

    async def write(self, fn: Callable[..., T], *args: Any, replay: bool | None = None,
                    rows_only: bool | None = None) -> T:
        """Run fn(conn, *args) as one transaction; return its result once committed.

        fn runs synchronously, with no await between its statements, in one SQLite transaction
        with the other writes that arrive until its COMMIT starts; the result is returned only
        after that COMMIT has returned (with synchronous=FULL: after it reached the disk).
        `replay` says whether fn may be run a second time (default: whether it is marked
        `replayable`). A fn marked `rows_only` (or given rows_only=True) that wrote nothing is
        answered without waiting for a COMMIT when nothing before it in the open transaction
        wrote either: what it read was committed already.
        """
        writer = self._writer
        if writer is None or writer.closing:
            raise StorageError("the database is closed")
        assert writer.loop is not None
        fut: asyncio.Future[T] = writer.loop.create_future()
        if replay is None:
            replay = getattr(fn, "replayable", False)
        if rows_only is None:
            rows_only = getattr(fn, "rows_only", False)
        writer.pending.append(_Pending(fn, args, fut, replay, rows_only))
        writer.wake.set()
        return await fut

    async def read(self, sql: str, params: Params = ()) -> list[sqlite3.Row]:
        if self._reader is None:
            raise StorageError("the database is closed")
        return list(await self._reader.execute_fetchall(sql, params))

    async def read_in_thread(self, fn: Callable[..., T], *args: Any, named: bool = False) -> T:
        """fn(conn, *args) in a worker thread, on a read-only connection of its own (rows as
        plain tuples, or with `named` as sqlite3.Row, read by column name like the writer's
        and the shared reader's), closed after. For reports over many rows: the rows and what
        is made of them never pass through the event loop's thread, and the shared reader stays
        free for other requests meanwhile. fn must not hand a row-sized structure back to be
        freed on the loop's thread (freeing a million objects is one call that holds the GIL)."""
        if self._reader is None:
            raise StorageError("the database is closed")
        return await asyncio.to_thread(self._in_thread, fn, args, named)

    def _in_thread(self, fn: Callable[..., T], args: tuple[Any, ...], named: bool) -> T:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        if named:
            conn.row_factory = sqlite3.Row
        try:
            conn.execute("PRAGMA query_only = ON")
            return fn(conn, *args)
        finally:
            conn.close()

    async def read_one(self, sql: str, params: Params = ()) -> sqlite3.Row | None:
        rows = await self.read(sql, params)
        return rows[0] if rows else None

    @property
    def queue_depth(self) -> tuple[int, int]:
        """Transactions waiting for the writer to run them, and those run inside the open SQLite
        transaction that no COMMIT has taken yet. Two lengths: cheap enough to read per scrape."""
        writer = self._writer
        if writer is None:
            return 0, 0
        return len(writer.pending), len(writer.open.outcomes)

    @property
    def stats(self) -> dict[str, float]:
        """Group-commit figures since start: batches (COMMITs), transactions committed,
        transactions answered with no COMMIT (they wrote nothing), open transactions replayed in
        savepoints after a failed write, seconds running transaction bodies and from asking for
        each COMMIT until its answer."""
        writer = self._writer
        if writer is None:
            return {"batches": 0, "transactions": 0, "answered_early": 0, "replays": 0,
                    "run_s": 0.0, "commit_s": 0.0}
        return {"batches": writer.batches, "transactions": writer.transactions,
                "answered_early": writer.open.answered_early,
                "replays": writer.replays, "run_s": round(writer.run_s, 3),
                "commit_s": round(writer.commit_s, 3)}

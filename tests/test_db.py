"""The database writer (fleet_min.db): group commit, writes joining the open transaction until
its COMMIT starts, and one failing transaction rolling back alone, with and without
savepoints. A real SQLite file in WAL mode, synchronous=FULL."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet_min.db import (
    Database,
    Periodic,
    StorageError,
    _connect,
    _OpenTransaction,
    _Pending,
    _resolve_all,
    migrate,
    replayable,
    rows_only,
)

SCHEMA = ["CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL UNIQUE)"]


class Refusal(Exception):
    pass


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    database = Database(tmp_path / "notes.sqlite3", SCHEMA)
    await database.open()
    yield database
    await database.close()


runs: Counter[str] = Counter()


@replayable
def add(conn: sqlite3.Connection, text: str) -> int:
    runs[text] += 1
    return int(conn.execute("INSERT INTO notes (text) VALUES (?) RETURNING id",
                            (text,)).fetchone()[0])


@replayable
def refuse_first(conn: sqlite3.Connection, text: str) -> None:
    """Fails before writing anything: nothing to undo."""
    runs[text] += 1
    if conn.execute("SELECT 1 FROM notes WHERE text = 'gate'").fetchone() is None:
        raise Refusal("no gate")


@replayable
def write_then_refuse(conn: sqlite3.Connection, text: str) -> None:
    """Fails after writing: its row must not survive."""
    runs[text] += 1
    conn.execute("INSERT INTO notes (text) VALUES (?)", (text,))
    raise Refusal("changed my mind")


def write_then_refuse_once_only(conn: sqlite3.Connection, text: str) -> None:
    """The same, but not marked replayable: it must never run twice."""
    runs[text] += 1
    conn.execute("INSERT INTO notes (text) VALUES (?)", (text,))
    raise Refusal("changed my mind")


async def texts(db: Database) -> set[str]:
    return {row["text"] for row in await db.read("SELECT text FROM notes")}


async def in_one_batch(*writes: Any) -> list[Any]:
    """Start the writes together: all are pending before the writer wakes, so one batch."""
    return await asyncio.gather(*writes, return_exceptions=True)


async def test_concurrent_writes_share_one_commit(db: Database) -> None:
    runs.clear()
    ids = await in_one_batch(*(db.write(add, f"note {i}") for i in range(20)))
    assert sorted(ids) == list(range(1, 21))
    assert await texts(db) == {f"note {i}" for i in range(20)}
    assert db.stats["batches"] == 1 and db.stats["transactions"] == 20
    assert db.stats["replays"] == 0


async def test_a_refusal_before_any_write_needs_no_replay(db: Database) -> None:
    runs.clear()
    outcomes = await in_one_batch(db.write(add, "a"), db.write(refuse_first, "r"),
                                  db.write(add, "b"))
    assert outcomes[0] == 1 and outcomes[2] == 2
    assert isinstance(outcomes[1], Refusal)
    assert await texts(db) == {"a", "b"}
    assert db.stats["replays"] == 0
    assert runs == {"a": 1, "r": 1, "b": 1}


async def test_a_failure_after_writing_is_undone_and_the_rest_replayed(db: Database) -> None:
    runs.clear()
    outcomes = await in_one_batch(db.write(add, "a"), db.write(write_then_refuse, "w"),
                                  db.write(add, "b"))
    assert isinstance(outcomes[1], Refusal)
    assert await texts(db) == {"a", "b"}  # the failed one's row is gone, the others kept
    assert db.stats["replays"] == 1
    # The attempt stopped at the failure; the batch then ran again, each in a savepoint.
    assert runs == {"a": 2, "w": 2, "b": 1}
    # The replay is a new attempt, not a second copy: the ids follow on from each other.
    assert outcomes[0] == 1 and outcomes[2] == 2


async def test_sqlite_refusing_a_statement_rolls_back_that_transaction_only(db: Database) -> None:
    await db.write(add, "taken")
    outcomes = await in_one_batch(db.write(add, "a"), db.write(add, "taken"),
                                  db.write(add, "b"))
    assert isinstance(outcomes[1], sqlite3.IntegrityError)  # the caller sees why
    assert await texts(db) == {"taken", "a", "b"}
    assert db.stats["replays"] == 1


async def test_a_batch_with_a_transaction_not_replayable_runs_each_in_a_savepoint(
        db: Database) -> None:
    runs.clear()
    outcomes = await in_one_batch(db.write(add, "a"), db.write(write_then_refuse_once_only, "o"),
                                  db.write(add, "b"))
    assert isinstance(outcomes[1], Refusal)
    assert await texts(db) == {"a", "b"}
    assert db.stats["replays"] == 0
    assert runs == {"a": 1, "o": 1, "b": 1}  # nothing ran twice


async def test_replay_can_be_refused_per_call(db: Database) -> None:
    runs.clear()
    outcomes = await in_one_batch(db.write(add, "a"),
                                  db.write(write_then_refuse, "w", replay=False))
    assert isinstance(outcomes[1], Refusal)
    assert await texts(db) == {"a"}
    assert runs == {"a": 1, "w": 1}


async def test_an_acknowledged_write_survives_a_reopen(db: Database, tmp_path: Path) -> None:
    await in_one_batch(db.write(add, "kept"), db.write(write_then_refuse, "dropped"))
    await db.close()
    again = Database(tmp_path / "notes.sqlite3", SCHEMA)
    await again.open()
    try:
        assert await texts(again) == {"kept"}
    finally:
        await again.close()


async def test_a_delete_does_not_rewrite_the_pages_it_frees(db: Database) -> None:
    """SQLite built with SECURE_DELETE (Debian's is) zeroes every page a DELETE frees and
    writes each through the WAL: deleting rows of 57 KB wrote their size again, at the
    registry's bound 1.3 GB in one COMMIT. The writer's connection takes FAST: only what the
    delete changes is written."""
    def fill(conn: sqlite3.Connection) -> None:
        conn.executemany("INSERT INTO notes (text) VALUES (?)",
                         [(f"{i:04d}" + "x" * 60_000,) for i in range(100)])

    def empty(conn: sqlite3.Connection) -> None:
        conn.execute("DELETE FROM notes")

    await db.write(fill)
    wal = Path(f"{db.path}-wal")
    await db.read_in_thread(lambda conn: conn.execute("PRAGMA wal_checkpoint(TRUNCATE)"))
    before = wal.stat().st_size
    await db.write(empty)
    written = wal.stat().st_size - before
    assert written < 1_000_000, f"the delete wrote {written} bytes to the WAL (6 MB of rows)"


@replayable
def end_the_transaction(conn: sqlite3.Connection, text: str) -> None:
    """Stands for SQLite rolling the transaction back on its own (a full disk, an I/O error)
    under a function that caught the statement's error and went on."""
    conn.execute("INSERT INTO notes (text) VALUES (?)", (text,))
    conn.execute("ROLLBACK")


@pytest.mark.parametrize("replay", [True, False])
async def test_a_transaction_the_database_abandoned_fails_the_batch(db: Database,
                                                                   replay: bool) -> None:
    outcomes = await in_one_batch(db.write(add, "a"),
                                  db.write(end_the_transaction, "x", replay=replay))
    assert all(isinstance(o, StorageError) for o in outcomes), outcomes
    assert await texts(db) == set()
    assert await db.write(add, "after") == 1  # the writer goes on with the next batch
    assert await texts(db) == {"after"}


# -- writes arriving before the COMMIT starts join it (fleet_min.db._OpenTransaction) ---------
#
# The open transaction is driven here directly, on a real connection, so that two runs are
# certain to land in one SQLite transaction; the COMMIT thread decides that under load.


def add_once(conn: sqlite3.Connection, text: str) -> int:
    """Like `add`, but not marked replayable: it must never run twice."""
    runs[text] += 1
    return int(conn.execute("INSERT INTO notes (text) VALUES (?) RETURNING id",
                            (text,)).fetchone()[0])


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    connection = _connect(tmp_path / "open.sqlite3", "FULL")
    migrate(connection, SCHEMA)
    yield connection
    connection.close()


def pending(fn: Any, text: str, replay: bool | None = None) -> _Pending:
    replay = getattr(fn, "replayable", False) if replay is None else replay
    return _Pending(fn, (text,), asyncio.get_running_loop().create_future(), replay,
                    getattr(fn, "rows_only", False))


def committed_texts(conn: sqlite3.Connection) -> set[str]:
    return {row[0] for row in conn.execute("SELECT text FROM notes")}


def answers(writes: list[_Pending]) -> list[Any]:
    """What each caller heard: its result, its exception, or "unanswered" while it waits."""
    return [w.future.exception() or w.future.result() if w.future.done() else "unanswered"
            for w in writes]


async def test_writes_run_before_the_commit_are_answered_only_by_it(
        conn: sqlite3.Connection) -> None:
    runs.clear()
    txn = _OpenTransaction(conn)
    first, second = [pending(add, "a")], [pending(add, "b"), pending(add, "c")]
    assert txn.run(first) == 0 and txn.run(second) == 0
    assert conn.in_transaction  # one transaction for both runs
    assert not any(w.future.done() for w in first + second)
    outcomes = txn.take()
    conn.execute("COMMIT")
    _resolve_all(outcomes)
    assert answers(first + second) == [1, 2, 3]
    assert committed_texts(conn) == {"a", "b", "c"}
    assert txn.take() == []  # taken once


async def test_a_failure_after_writing_replays_the_earlier_runs_of_the_transaction(
        conn: sqlite3.Connection) -> None:
    runs.clear()
    txn = _OpenTransaction(conn)
    first, second = [pending(add, "a")], [pending(add, "b"), pending(write_then_refuse, "w")]
    txn.run(first)
    assert txn.run(second) == 1
    outcomes = txn.take()
    conn.execute("COMMIT")
    _resolve_all(outcomes)
    assert runs == {"a": 2, "b": 2, "w": 2}
    a, b, w = answers(first + second)
    assert (a, b) == (1, 2) and isinstance(w, Refusal)  # the replay's answers, not the first's
    assert committed_texts(conn) == {"a", "b"}


async def test_a_write_that_may_not_run_twice_makes_the_rest_of_its_transaction_guarded(
        conn: sqlite3.Connection) -> None:
    runs.clear()
    txn = _OpenTransaction(conn)
    first, second = [pending(add_once, "o")], [pending(write_then_refuse, "w")]
    txn.run(first)
    assert txn.run(second) == 0  # undone in its own savepoint, no replay of "o"
    outcomes = txn.take()
    conn.execute("COMMIT")
    _resolve_all(outcomes)
    assert runs == {"o": 1, "w": 1}
    o, w = answers(first + second)
    assert o == 1 and isinstance(w, Refusal)
    assert committed_texts(conn) == {"o"}
    # Guarding ends with its transaction: the next one runs without savepoints again.
    assert txn.run([pending(add, "n")]) == 0 and not txn.guarded


async def test_a_transaction_abandoned_later_fails_the_writes_run_earlier_in_it(
        conn: sqlite3.Connection) -> None:
    txn = _OpenTransaction(conn)
    first, second = [pending(add, "a")], [pending(end_the_transaction, "x")]
    txn.run(first)
    txn.run(second)
    # Answered at once, with nothing left to commit.
    assert all(isinstance(answer, StorageError) for answer in answers(first + second))
    assert txn.take() == [] and not conn.in_transaction
    assert committed_texts(conn) == set()


async def test_every_write_is_committed_when_its_caller_hears_back(db: Database) -> None:
    """Writers that keep coming while COMMITs are on their way: whatever batch a write joined,
    another connection sees it by the time its caller resumes."""
    unseen: list[str] = []

    async def writer(n: int) -> None:
        for i in range(25):
            text = f"w{n}-{i}"
            await db.write(add, text)
            other = sqlite3.connect(db.path)
            try:
                if other.execute("SELECT 1 FROM notes WHERE text = ?", (text,)).fetchone() is None:
                    unseen.append(text)
            finally:
                other.close()

    await asyncio.gather(*(writer(n) for n in range(8)))
    assert unseen == []
    assert db.stats["transactions"] == 200 and db.stats["batches"] < 200


async def test_closing_answers_and_keeps_every_write_already_accepted(tmp_path: Path) -> None:
    """close() while writes are pending, running or committing: each is answered and stored."""
    database = Database(tmp_path / "drain.sqlite3", SCHEMA)
    await database.open()
    writes = [asyncio.ensure_future(database.write(add, f"late {i}")) for i in range(60)]
    await asyncio.sleep(0)  # the first of them start running; the rest are still pending
    await database.close()
    assert all(w.done() and not w.cancelled() and w.exception() is None for w in writes)
    again = Database(tmp_path / "drain.sqlite3", SCHEMA)
    await again.open()
    try:
        assert await texts(again) == {f"late {i}" for i in range(60)}
    finally:
        await again.close()


# -- transactions that wrote nothing ---------------------------------------------------------

@replayable
@rows_only
def look(conn: sqlite3.Connection, text: str) -> bool:
    """A long poll's look in small: reads, and writes a row only when there is one to take."""
    runs[text] += 1
    return conn.execute("SELECT 1 FROM notes WHERE text = ?", (text,)).fetchone() is not None


@replayable
@rows_only
def look_or_add(conn: sqlite3.Connection, text: str) -> int | None:
    """Writes when the note is missing: a look that claims something."""
    runs[text] += 1
    if conn.execute("SELECT 1 FROM notes WHERE text = ?", (text,)).fetchone():
        return None
    return add(conn, text)


@replayable
def unmarked_look(conn: sqlite3.Connection, text: str) -> bool:
    """The same read without the mark: the writer cannot tell it wrote nothing (a PRAGMA that
    frees pages changes the file and no row), so it waits for a COMMIT like any write."""
    return conn.execute("SELECT 1 FROM notes WHERE text = ?", (text,)).fetchone() is not None


async def test_a_look_that_writes_nothing_is_answered_without_a_commit(db: Database) -> None:
    await db.write(add, "there")
    before = dict(db.stats)
    assert await db.write(look, "there") is True
    assert await db.write(look, "missing") is False
    assert db.stats["batches"] == before["batches"]  # no COMMIT was asked for
    assert db.stats["answered_early"] == before["answered_early"] + 2
    # The empty transaction was ended on the spot: another connection can write at once.
    other = sqlite3.connect(db.path, timeout=0)
    try:
        other.execute("INSERT INTO notes (text) VALUES ('from elsewhere')")
        other.commit()
    finally:
        other.close()
    assert "from elsewhere" in await texts(db)


async def test_a_look_that_writes_waits_for_the_commit_like_any_write(db: Database) -> None:
    before = db.stats["batches"]
    assert await db.write(look_or_add, "new") == 1
    assert db.stats["batches"] == before + 1
    other = sqlite3.connect(db.path)
    try:  # on disk by the time the caller heard back
        assert other.execute("SELECT text FROM notes").fetchall() == [("new",)]
    finally:
        other.close()


async def test_an_unmarked_transaction_that_writes_nothing_still_waits_for_a_commit(
        db: Database) -> None:
    before = dict(db.stats)
    assert await db.write(unmarked_look, "missing") is False
    assert db.stats["batches"] == before["batches"] + 1
    assert db.stats["answered_early"] == before["answered_early"]


async def test_a_look_after_a_write_in_the_same_transaction_waits_for_its_commit(
        db: Database) -> None:
    """The look reads the write's row before it is durable: answering it early would tell a
    caller of a row a failed COMMIT could still take away."""
    runs.clear()
    write = asyncio.ensure_future(db.write(add, "fresh"))
    seen = asyncio.ensure_future(db.write(look, "fresh"))
    assert await seen is True
    assert write.done() and write.result() == 1  # answered together, by the COMMIT
    assert db.stats["answered_early"] == 0


async def test_a_look_before_a_write_is_answered_before_the_writes_commit(
        db: Database) -> None:
    """It read only committed rows, so it need not wait for a COMMIT of what ran after it; the
    write is still answered only once committed."""
    seen = asyncio.ensure_future(db.write(look, "later"))
    write = asyncio.ensure_future(db.write(add, "later"))
    assert await seen is False
    assert not write.done()  # its COMMIT is still to come
    assert await write == 1
    assert db.stats["answered_early"] == 1 and db.stats["batches"] == 1


async def test_a_look_in_a_batch_replayed_after_a_failure_is_answered_once_after_the_commit(
        conn: sqlite3.Connection) -> None:
    """[look, add, write-then-refuse] in one batch: the failure rolls everything back and runs
    it again in savepoints, so the look is not answered from its first run."""
    runs.clear()
    txn = _OpenTransaction(conn)
    batch = [pending(look, "a"), pending(add, "a"), pending(write_then_refuse, "w")]
    assert txn.run(batch) == 1
    txn.end_if_clean()
    assert answers(batch) == ["unanswered"] * 3
    outcomes = txn.take()
    conn.execute("COMMIT")
    _resolve_all(outcomes)
    seen, added, refused = answers(batch)
    assert (seen, added) == (False, 1) and isinstance(refused, Refusal)
    assert runs == {"a": 4, "w": 2} and txn.answered_early == 0
    assert committed_texts(conn) == {"a"}


async def test_looks_answered_early_are_not_run_again_by_a_later_replay(
        conn: sqlite3.Connection) -> None:
    runs.clear()
    txn = _OpenTransaction(conn)
    first = [pending(look, "x"), pending(add, "a")]
    assert txn.run(first) == 0
    assert answers(first)[0] is False  # answered as it ran
    second = [pending(write_then_refuse, "w")]
    assert txn.run(second) == 1  # "a" runs again; the look is no longer part of it
    outcomes = txn.take()
    conn.execute("COMMIT")
    _resolve_all(outcomes)
    seen, added, refused = answers(first + second)
    assert (seen, added) == (False, 1) and isinstance(refused, Refusal)
    assert runs == {"x": 1, "a": 2, "w": 2}
    assert committed_texts(conn) == {"a"}


async def test_a_periodic_task_says_an_outage_once_and_its_end_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """A full disk refuses every period's write: one warning and one line when it ends, not a
    traceback each time; a bug of ours keeps its traceback every time."""
    logger = logging.getLogger("tests.periodic")
    periodic = Periodic("the test task", logger)
    outcomes: list[BaseException | None] = [StorageError("the disk is full")] * 3 + [None]

    async def work() -> None:
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    with caplog.at_level(logging.INFO, logger="tests.periodic"):
        for _ in range(4):
            await periodic.run(work)
        outcomes[:] = [ValueError("a bug"), ValueError("a bug")]
        await periodic.run(work)
        await periodic.run(work)
    said = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert said == [
        ("WARNING", "the test task cannot write to the database: the disk is full; it is tried "
                    "again each period", False),
        ("INFO", "the test task writes to the database again", False),
        ("ERROR", "the test task failed; it runs again at the next period", True),
        ("ERROR", "the test task failed; it runs again at the next period", True)]

"""What is checked in a backup before restore changes anything, and how its files are read.

A backup directory may come from anyone who could write to it (a USB stick, a network share), so
nothing in it is trusted:

- every file is opened once, with O_NOFOLLOW and O_NONBLOCK, and read only when it is a regular
  file (a link to /dev/zero, a FIFO or a device is refused, never read or waited on), and at
  most as many bytes as it may hold (the manifest, the collector id) or as its size said when it
  was opened (the database, which is copied: never read into memory);
- the database is checked on restore's own copy, the one it then installs: a file swapped in the
  backup after the copy changes nothing;
- the copy's schema is compared with the one the collector's own migrations make at the copy's
  schema version before any query reads a table: every table is a table with the same columns,
  every index is there, and there are no views or triggers (the collector makes none; a view in
  a table's place could make a count run forever, a trigger would run on the collector's writes);
- every statement on the copy runs under a time budget (a progress handler), and the manifest's
  row counts must be the database's;
- restore then installs no schema object of the backup (a CHECK, a COLLATE, a foreign key's
  action or an index definition in the copy's SQL would otherwise rule the collector's writes):
  `rebuild` makes a fresh database with the collector's own migrations and copies only the rows
  into it, and that file is what is counted and installed.
"""

from __future__ import annotations

import os
import re
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fleet_min import filemodes
from fleet_min.collector.storage import row_check
from fleet_min.db import migrate, quote_identifier

_CHUNK = 1 << 20
COUNTED = ("jobs", "results", "devices", "artifacts", "schedules")
# A second of checking per 2 MiB of database on top of two minutes: far beyond what a sound
# database needs on a Raspberry Pi, a bound on what a hostile one can take.
_BUDGET_S = 120.0
_BUDGET_BYTES_PER_S = 2 << 20


class Refused(ValueError):
    """The backup cannot be restored; the message is a sentence for the operator."""


_BACKUP_SENTENCE = {
    "link": "{path} is a symbolic link; a backup holds only regular files, and none is read "
            "through a link",
    "special": "{path} is not a regular file (a FIFO, a device or a folder); the backup is "
               "damaged",
    "large": "{path} is larger than such a file can be ({cap} bytes); the backup is damaged",
}


def _refused(exc: filemodes.NotRegular) -> Refused:
    return Refused(_BACKUP_SENTENCE[exc.what].format(path=exc.path, cap=exc.cap))


def open_regular(path: Path) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file at `path` and its stat; FileNotFoundError when there is
    none, Refused for a link or anything but a regular file."""
    try:
        return filemodes.open_regular(path)
    except filemodes.NotRegular as exc:
        raise _refused(exc) from None


def read_small(path: Path, cap: int) -> bytes:
    """The whole regular file at `path` when it holds at most `cap` bytes; Refused when larger
    (at most cap + 1 bytes are read, whatever its size says)."""
    try:
        return filemodes.read_regular(path, cap)
    except filemodes.NotRegular as exc:
        raise _refused(exc) from None


def copy_regular(src: Path, dest_fd: int | None, limit: int | None = None,
                 seen: Callable[[bytes], None] | None = None) -> int:
    """Copy the regular file at `src` into the open descriptor `dest_fd`, fsynced; the bytes
    copied. At most `limit` bytes (default: the size the file had when opened); Refused when
    there are more (it grew, or it is not the size it should be). `seen` gets every chunk.
    `dest_fd` None: read (and show `seen`) without writing anywhere."""
    fd, st = open_regular(src)
    cap = st.st_size if limit is None else limit
    copied = 0
    try:
        while chunk := os.read(fd, min(_CHUNK, cap + 1 - copied)):
            copied += len(chunk)
            if copied > cap:
                raise Refused(f"{src} is longer than it should be ({cap} bytes) or grew while "
                              "it was copied; the backup is damaged or being changed")
            if seen is not None:
                seen(chunk)
            if dest_fd is None:
                continue
            view = memoryview(chunk)
            while view:
                view = view[os.write(dest_fd, view):]
        if dest_fd is not None:
            os.fsync(dest_fd)
    finally:
        os.close(fd)
    return copied


# -- the database ---------------------------------------------------------------------------


@dataclass
class Checked:
    version: int
    counts: dict[str, int]
    artifacts: list[tuple[str, int]]  # the artifact index: (sha256, size), by hash
    # Rows the rebuild left out (restore --leave-out-bad-rows), by table: not in `counts`.
    left_out: list[row_check.LeftOut] = field(default_factory=list)


def _budget(conn: sqlite3.Connection, size: int) -> float:
    seconds = _BUDGET_S + size / _BUDGET_BYTES_PER_S
    deadline = time.monotonic() + seconds
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    return seconds


def expected_schema(version: int) -> dict[str, tuple[str, str, list[tuple[object, ...]]]]:
    """What the collector's migrations make up to `version`: by name, (type, table, columns)."""
    from fleet_min.collector.storage.schema import MIGRATIONS

    fresh = sqlite3.connect(":memory:", isolation_level=None)
    try:
        migrate(fresh, MIGRATIONS[:version])
        return _schema(fresh)
    finally:
        fresh.close()


def _schema(conn: sqlite3.Connection) -> dict[str, tuple[str, str, list[tuple[object, ...]]]]:
    found = {}
    for kind, name, table in conn.execute("SELECT type, name, tbl_name FROM sqlite_master"):
        columns = []
        if kind == "table":
            # name, declared type, NOT NULL, default, primary-key position
            columns = [tuple(row[1:6]) for row in conn.execute(
                "SELECT * FROM pragma_table_info(?)", (name,))]
        found[name] = (kind, table, columns)
    return found


def _compare_schema(path: Path, conn: sqlite3.Connection, version: int) -> None:
    want, have = expected_schema(version), _schema(conn)
    for name, (kind, table, _) in have.items():
        if kind in ("view", "trigger"):
            raise Refused(f"{path} defines a {kind} ({name[:60]!r} on {table[:60]!r}), which a "
                          "collector's database never holds; the backup is not one this "
                          "program made")
    for name, (kind, table, columns) in want.items():
        if name not in have:
            raise Refused(f"{path} has no {kind} {name!r}, which schema version {version} "
                          "needs; the backup is damaged")
        got_kind, got_table, got_columns = have[name]
        if (got_kind, got_table) != (kind, table):
            raise Refused(f"{path} has {name!r} as a {got_kind} on {got_table[:60]!r}, not the "
                          f"{kind} on {table!r} that schema version {version} makes; the backup "
                          "is damaged")
        if got_columns != columns:
            raise Refused(f"{path}'s table {name!r} does not have the columns schema version "
                          f"{version} gives it; the backup is damaged")
    extra = sorted(name for name in have if name not in want and not name.startswith("sqlite_"))
    if extra:
        raise Refused(f"{path} holds {len(extra)} tables or indexes the collector does not make "
                      f"({', '.join(repr(name[:60]) for name in extra[:3])}); the backup is not "
                      "one this program made")


def check_database(path: Path, known: int, shown: Path | None = None) -> Checked:
    """The database copy at `path` checked: schema version (at most `known`, the newest this
    program knows), schema, integrity, row counts and artifact index. Refused when wrong, naming
    it as `shown` (default: path), the file it was copied from."""
    named = shown or path
    try:
        conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error as exc:
        raise Refused(f"{named} is not a readable SQLite database ({exc}); the backup is "
                      "damaged") from None
    seconds = _budget(conn, path.stat().st_size)
    try:
        return _check(named, conn, known)
    except sqlite3.OperationalError as exc:
        if "interrupted" in str(exc):
            raise Refused(f"checking {named} took longer than {seconds:.0f} s; the backup is "
                          "damaged or hostile") from None
        raise Refused(f"{named} is not a readable SQLite database ({exc}); the backup is "
                      "damaged") from None
    except sqlite3.Error as exc:
        raise Refused(f"{named} is not a readable SQLite database ({exc}); the backup is "
                      "damaged") from None
    finally:
        conn.close()


def _check(path: Path, conn: sqlite3.Connection, known: int) -> Checked:
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version > known:
        raise Refused(f"the backup is at schema version {version}, newer than this program "
                      f"knows ({known}); restore it with a newer fleet-min")
    if version < 1:
        raise Refused(f"{path} holds no collector schema (schema version 0); the backup is "
                      "damaged")
    _compare_schema(path, conn, version)
    verdict = [row[0] for row in conn.execute("PRAGMA integrity_check")]
    if verdict != ["ok"]:
        raise Refused(f"{path} fails SQLite's integrity check: {'; '.join(verdict[:3])}")
    # Only tables the schema check found to be the collector's (an old version has fewer).
    counts, artifacts = _contents(conn)
    return Checked(version, counts, artifacts)


def rebuild(copy: Path, dest: Path, version: int, shown: Path | None = None, *,
            leave_out: bool = False) -> Checked:
    """Make the database at `dest` (an empty file) with the collector's own migrations up to
    `version` and copy into it every table's rows from the checked copy at `copy` (attached
    read-only), under the same time budget as the checks: no table, index, CHECK or COLLATE of
    the copy is installed, only its rows. The rowid is carried for every table that has one and
    AUTOINCREMENT sequences continue from the copy's. What the rebuilt database holds (counts,
    artifact index); Refused, naming the copy as `shown`, when its rows do not fit the schema or
    it takes too long. `leave_out`: the rows of record tables that the readers cannot take are
    left out, and said in `left_out` (row_check.LEAVE_OUT_TABLES), instead of refused. The
    caller fsyncs dest."""
    from fleet_min.collector.storage.schema import MIGRATIONS

    named = shown or copy
    conn = sqlite3.connect(f"{dest.absolute().as_uri()}?mode=rw", uri=True, timeout=5,
                           isolation_level=None)
    seconds = _budget(conn, copy.stat().st_size)
    try:
        # what a collector gives a database it makes (fleet_min.db): only an empty file takes it
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        migrate(conn, MIGRATIONS[:version])
        conn.execute("ATTACH DATABASE ? AS backup", (f"{copy.absolute().as_uri()}?mode=ro",))
        conn.execute("BEGIN IMMEDIATE")
        try:
            _copy_rows(conn)
            _check_numbering(conn, named)
            left_out = row_check.check_rows(conn, leave_out_records=leave_out)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("DETACH DATABASE backup")
        counts, artifacts = _contents(conn)
        return Checked(int(conn.execute("PRAGMA user_version").fetchone()[0]), counts, artifacts,
                       left_out)
    except row_check.BadRow as exc:
        if exc.table not in row_check.LEAVE_OUT_TABLES:
            way_out = "restore a copy" + (
                " (--leave-out-bad-rows leaves out only records that no other row names, and "
                "other rows name those of this table)" if leave_out else "")
        else:  # not reached with leave_out: such rows were deleted, not checked
            way_out = ("run restore again with --leave-out-bad-rows to restore without such "
                       "rows of that table (each one left out is listed), or restore a copy")
        raise Refused(f"{named} holds a row the collector's readers cannot take ({exc}): the "
                      "backup is damaged or hostile, or an older version let that value in; "
                      f"{way_out} of the backup with that row corrected (sqlite3 on the "
                      "copy's fleet.sqlite3: an UPDATE keeps the manifest's counts true)"
                      ) from None
    except sqlite3.IntegrityError as exc:
        raise Refused(f"{named}'s rows do not fit the collector's own schema at version "
                      f"{version} ({exc}); the backup is damaged or hostile") from None
    except sqlite3.OperationalError as exc:
        if "interrupted" in str(exc):
            raise Refused(f"copying the rows of {named} took longer than {seconds:.0f} s; the "
                          "backup is damaged or hostile") from None
        raise Refused(f"the rows of {named} cannot be copied into the collector's own schema "
                      f"({exc}); the backup is damaged") from None
    except sqlite3.Error as exc:
        raise Refused(f"the rows of {named} cannot be copied into the collector's own schema "
                      f"({exc}); the backup is damaged") from None
    finally:
        conn.close()


# Row numbers a collector hands out grow by one a row: a table's largest rowid or sequence past
# this (2**53, where a JSON number stops being exact) is no collector's, and one set near 2**63
# would make every later insert into an AUTOINCREMENT table fail (SQLITE_FULL).
MAX_ROW_NUMBER = 1 << 53


def _check_numbering(conn: sqlite3.Connection, named: Path) -> None:
    """Refused when a table's largest rowid or AUTOINCREMENT sequence is past MAX_ROW_NUMBER."""
    numbered = [name for (name, sql) in conn.execute(
        "SELECT name, sql FROM main.sqlite_master WHERE type = 'table' "
        "AND name NOT LIKE 'sqlite^_%' ESCAPE '^'")
        if not re.search(r"\)\s*WITHOUT\s+ROWID\s*;?\s*$", sql, re.IGNORECASE)]
    found = [(name, conn.execute(
        f"SELECT max(rowid) FROM main.{quote_identifier(name)}").fetchone()[0])
             for name in numbered]
    if conn.execute("SELECT 1 FROM main.sqlite_master WHERE name = 'sqlite_sequence'"
                    ).fetchone():
        found += conn.execute("SELECT name, seq FROM main.sqlite_sequence").fetchall()
    for name, number in found:
        if number is not None and number > MAX_ROW_NUMBER:
            raise Refused(f"{named} numbers the rows of {name[:60]!r} up to {number}, past any "
                          "a collector reaches (a later row could not be stored); the backup "
                          "is damaged or hostile")



def _copy_rows(conn: sqlite3.Connection) -> None:
    """INSERT ... SELECT every table of main (the collector's own) from the attached backup,
    by the columns of main's table (the check proved the copy's are the same)."""
    tables = conn.execute("SELECT name, sql FROM main.sqlite_master WHERE type = 'table' "
                          "AND name NOT LIKE 'sqlite^_%' ESCAPE '^' ORDER BY name").fetchall()
    autoincrement = []
    for name, sql in tables:
        info = conn.execute("SELECT name, type, pk FROM pragma_table_info(?, 'main')",
                            (name,)).fetchall()
        columns = [quote_identifier(column) for column, _, _ in info]
        keys = [kind for _, kind, pk in info if pk]
        without_rowid = re.search(r"\)\s*WITHOUT\s+ROWID\s*;?\s*$", sql, re.IGNORECASE)
        alias = not without_rowid and len(keys) == 1 and keys[0].upper() == "INTEGER"
        if not without_rowid and not alias:
            columns.insert(0, "rowid")  # ORDER BY created_at DESC, rowid DESC reads it
        if re.search(r"\bAUTOINCREMENT\b", sql, re.IGNORECASE):
            autoincrement.append(name)
        listed = ", ".join(columns)
        order = "" if without_rowid else " ORDER BY rowid"
        conn.execute(f"INSERT INTO main.{quote_identifier(name)} ({listed}) "
                     f"SELECT {listed} FROM backup.{quote_identifier(name)}{order}")
    # The copy's sequences, so a number handed out before the backup is never handed again
    # (SQLite itself never goes below a table's largest rowid); the migrations' own go.
    if autoincrement:
        conn.execute("DELETE FROM main.sqlite_sequence")
    if autoincrement and conn.execute("SELECT 1 FROM backup.sqlite_master WHERE type = 'table' "
                                      "AND name = 'sqlite_sequence'").fetchone():
        marks = ", ".join("?" * len(autoincrement))
        conn.execute("INSERT INTO main.sqlite_sequence (name, seq) SELECT name, max(seq) FROM "
                     f"backup.sqlite_sequence WHERE name IN ({marks}) AND typeof(seq) = "
                     "'integer' GROUP BY name ORDER BY name", autoincrement)


def _contents(conn: sqlite3.Connection) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """The row counts and the artifact index of main, of the tables it has (an old version has
    fewer)."""
    tables = {row[0] for row in conn.execute(
        "SELECT name FROM main.sqlite_master WHERE type = 'table'")}
    counts = {table: int(conn.execute(f"SELECT count(*) FROM main.{table}").fetchone()[0])
              for table in COUNTED if table in tables}
    artifacts = [(str(row[0]), int(row[1])) for row in
                 conn.execute("SELECT sha256, size FROM main.artifacts ORDER BY sha256")
                 ] if "artifacts" in tables else []
    return counts, artifacts


def compare_manifest(where: Path, manifest: dict[str, object], checked: Checked) -> None:
    """Refused when the manifest's schema version or row counts are not the database's."""
    version = manifest.get("schema_version")
    if version is not None and version != checked.version:
        raise Refused(f"{where} says schema version {version}, but the database is at "
                      f"{checked.version}; the backup is damaged or was changed")
    counts = manifest.get("counts") or {}
    assert isinstance(counts, dict)  # checked by manifest_artifacts
    left = {entry.table: entry.count for entry in checked.left_out}
    for table, count in counts.items():
        if table not in checked.counts:
            raise Refused(f"{where} counts rows of {str(table)[:40]!r}, which the collector "
                          "does not count; the backup is damaged")
        held = checked.counts[table] + left.get(table, 0)  # as backed up: with those left out
        if count != held:
            raise Refused(f"{where} says {count} {table}, but the database holds "
                          f"{held}; the backup is damaged or was changed")

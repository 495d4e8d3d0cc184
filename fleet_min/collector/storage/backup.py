"""`fleet-min collector backup PATH` and `fleet-min collector restore PATH --data DIR`.

A backup is a directory:

    PATH/fleet.sqlite3    the database, copied with SQLite's online backup API
    PATH/collector-id     the collector's stable id
    PATH/artifacts/       (with --with-artifacts) the bytes of every artifact the copy names
    PATH/manifest.json    what was copied: counts, schema version, each artifact's hash and size

The copy is taken through a read-only connection in one step of the backup API, which reads one
consistent snapshot of the database (WAL lets the running collector go on writing meanwhile).
The `artifacts` table inside that copy is the artifact index; its rows are listed in the
manifest. Artifact bytes are copied after the snapshot and each file is hashed while it is
copied, so a file that does not match its name is never put in a backup. The directory is built
under a temporary name and renamed into place only when complete and checked, so a backup that
was interrupted never looks finished. A backup holds what the data directory holds, so it gets
the data directory's modes (fleet_min.filemodes: directories 0750, files 0640), whatever the
umask.

Restore refuses to touch a data directory in use. It takes the directory's lock, the one a
running collector holds for its whole life (fleet_min.dirlock), and keeps it until it is done,
so a collector cannot start half-way through either. It also asks the operating system whether
anything else has the database open: every connection to a WAL database holds a shared lock on
the "dead man switch" byte of its `-shm` file for as long as it is open, so a sqlite3 shell, or
a collector older than the lock, is seen too. An existing database is moved aside into
`DIR/pre-restore-<time>/`, never deleted, and only with --force.

Everything about the backup is checked before the data directory is touched (the manifest's
every field, the database, the collector id), so a damaged backup changes nothing. The data
directory is made private as the collector makes it (refused when another user owns it), and a
symbolic link where restore would write (the database, its -wal and -shm, the collector id, an
artifact or its folder) is refused before anything is written: every file is written under a
new name with mode 0640 and renamed into place, never opened through a link.

Backup takes no lock: it is an online backup, meant to run beside the live collector.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import sqlite3
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet_min import dirlock, filemodes
from fleet_min.collector.storage import identity
from fleet_min.collector.storage.identity import ID_NAME
from fleet_min.timeutil import iso

DB_NAME = "fleet.sqlite3"
MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 1 << 20
# Byte 128 of the -shm file: SQLite's unix VFS keeps a shared lock there per open connection
# (UNIX_SHM_DMS = (22 + SQLITE_SHM_NLOCK) * 4 + SQLITE_SHM_NLOCK, with SQLITE_SHM_NLOCK = 8).
_SHM_DMS_BYTE = 128
_HEX64 = re.compile(r"[0-9a-f]{64}")


class BackupError(RuntimeError):
    """A backup or restore that cannot go on; the message is a sentence for the operator."""


@dataclass
class Report:
    path: str
    counts: dict[str, int] = field(default_factory=dict)
    artifacts_copied: int = 0
    artifacts_bytes: int = 0
    artifacts_missing: list[str] = field(default_factory=list)
    moved_aside: str | None = None
    schema_version: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in (None, [])}


# -- shared ---------------------------------------------------------------------------------


def known_schema_version() -> int:
    from fleet_min.collector.storage.schema import MIGRATIONS
    return len(MIGRATIONS)


def database_in_use(db_path: Path) -> bool:
    """True when some process has the WAL database open (holds its -shm dead-man-switch lock)."""
    shm = Path(str(db_path) + "-shm")
    try:
        fd = os.open(shm, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return False  # a WAL database that nobody has open has no -shm (or a stale one)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _SHM_DMS_BYTE)
    except OSError:
        return True
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, _SHM_DMS_BYTE)
        return False
    finally:
        os.close(fd)


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_hashed(src: Path, dest: Path, expected: str) -> int:
    """Copy src to dest (0640, in a 0750 folder), hashing on the way; refuse (and leave nothing)
    when the hash differs."""
    digest, size = hashlib.sha256(), 0
    for folder in (dest.parent.parent, dest.parent):
        folder.mkdir(mode=filemodes.COLLECTOR_DIR, exist_ok=True)
    filemodes.refuse_link(dest.parent)
    part = dest.with_name(dest.name + ".part")
    with open(src, "rb") as reader, \
            os.fdopen(filemodes.open_new(part, filemodes.COLLECTOR_FILE), "wb") as writer:
        for chunk in iter(lambda: reader.read(_CHUNK), b""):
            digest.update(chunk)
            writer.write(chunk)
            size += len(chunk)
        writer.flush()
        os.fsync(writer.fileno())
    if digest.hexdigest() != expected:
        part.unlink()
        raise BackupError(f"artifact file {src} does not match its SHA-256 name; the store is "
                          "damaged there (the file was left out)")
    os.replace(part, dest)
    return size


def _check_database(path: Path) -> tuple[int, dict[str, int]]:
    """Integrity-check a database file; its schema version and row counts."""
    if not path.is_file():
        raise BackupError(f"{path} is missing (or not a file); the backup is damaged")
    try:
        return _checked(path)
    except sqlite3.Error as exc:
        raise BackupError(f"{path} is not a readable SQLite database ({exc}); the backup is "
                          "damaged") from None


def read_only(path: Path) -> sqlite3.Connection:
    """A read-only connection to the database at `path`. The URI is built by pathlib, which
    percent-encodes what a URI would read otherwise: a `?` or `#` in a folder's name began
    the query or the fragment, and `%` an escape."""
    return sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=30)


def _checked(path: Path) -> tuple[int, dict[str, int]]:
    conn = read_only(path)
    try:
        verdict = [row[0] for row in conn.execute("PRAGMA integrity_check")]
        if verdict != ["ok"]:
            raise BackupError(f"{path} fails SQLite's integrity check: {'; '.join(verdict[:3])}")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        counts = {}
        for table in ("jobs", "results", "devices", "artifacts", "schedules"):
            with contextlib.suppress(sqlite3.OperationalError):
                counts[table] = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        return int(version), counts
    finally:
        conn.close()


def _artifact_rows(db_path: Path) -> list[tuple[str, int]]:
    conn = read_only(db_path)
    try:
        return [(row[0], int(row[1])) for row in
                conn.execute("SELECT sha256, size FROM artifacts ORDER BY sha256")]
    except sqlite3.OperationalError:
        return []
    finally:
        conn.close()


def _artifact_file(root: Path, sha256: str) -> Path:
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise BackupError(f"the artifact index names {sha256[:80]!r}, which is not a SHA-256")
    return root / sha256[:2] / sha256


# -- backup ---------------------------------------------------------------------------------


def backup(data_dir: Path, dest: Path, with_artifacts: bool = False) -> Report:
    """Write a consistent backup of data_dir's collector into the new directory dest."""
    started = time.monotonic()
    source = data_dir / DB_NAME
    if not source.is_file():
        raise BackupError(f"there is no collector database at {source}; pass the collector's "
                          "data directory with --data")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BackupError(f"{dest} already exists; a backup goes into a new (or empty) directory")
    work = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(mode=filemodes.COLLECTOR_DIR, parents=True)
    try:
        report = _fill(data_dir, source, work, with_artifacts)
        if dest.exists():
            dest.rmdir()
        os.replace(work, dest)
        _fsync_path(dest.parent, directory=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    report.path = str(dest)
    report.seconds = round(time.monotonic() - started, 3)
    return report


def _snapshot(source: Path, target: Path) -> None:
    """The whole database as of one read transaction, through SQLite's backup API."""
    try:
        reader = read_only(source)
    except sqlite3.Error as exc:
        raise BackupError(f"cannot open {source} for reading: {exc}") from None
    try:
        # Made with its mode before SQLite opens it: SQLite's own default is 0644, and its
        # journal takes the database file's mode.
        filemodes.create_file(target, filemodes.COLLECTOR_FILE)
        writer = sqlite3.connect(target)
    except BaseException:
        reader.close()
        raise
    try:
        reader.execute("PRAGMA busy_timeout = 30000")
        # pages=-1: one step, so the copy is one snapshot even while the collector writes.
        reader.backup(writer, pages=-1)
        writer.execute("PRAGMA journal_mode = DELETE")  # one self-contained file
    except sqlite3.Error as exc:
        raise BackupError(f"the backup of {source} failed: {exc}") from None
    finally:
        writer.close()
        reader.close()
    _fsync_path(target)


def _fill(data_dir: Path, source: Path, work: Path, with_artifacts: bool) -> Report:
    copy = work / DB_NAME
    _snapshot(source, copy)
    version, counts = _check_database(copy)
    report = Report(path=str(work), counts=counts, schema_version=version)
    try:
        collector_id = identity.read_id(data_dir / ID_NAME)
    except ValueError as exc:
        raise BackupError(f"{exc}; a backup would carry it on") from None
    if collector_id:
        filemodes.write_new(work / ID_NAME, (collector_id + "\n").encode(),
                            filemodes.COLLECTOR_FILE)
    rows = _artifact_rows(copy)
    included: list[dict[str, Any]] = []
    for sha256, size in rows:
        entry: dict[str, Any] = {"sha256": sha256, "size": size}
        if with_artifacts:
            src = _artifact_file(data_dir / "artifacts", sha256)
            try:
                report.artifacts_bytes += _copy_hashed(src, _artifact_file(work / "artifacts",
                                                                           sha256), sha256)
                report.artifacts_copied += 1
                entry["included"] = True
            except FileNotFoundError:  # deleted after the snapshot was taken
                report.artifacts_missing.append(sha256)
                entry["included"] = False
        included.append(entry)
    manifest = {
        "format": FORMAT, "kind": "fleet-min collector backup", "created_at": iso(time.time()),
        "source": str(data_dir.resolve()), "collector_id": collector_id,
        "schema_version": version, "counts": counts, "with_artifacts": with_artifacts,
        "artifacts": included,
    }
    filemodes.write_new(work / MANIFEST,
                        (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode(),
                        filemodes.COLLECTOR_FILE)
    for path in _walk(work):
        _fsync_path(path)
    _fsync_path(work, directory=True)
    return report


def _walk(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            yield path


# -- restore --------------------------------------------------------------------------------


def read_manifest(src: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((src / MANIFEST).read_text())
    except FileNotFoundError:
        raise BackupError(f"{src} is not a fleet-min collector backup (no {MANIFEST})") from None
    except (ValueError, UnicodeDecodeError):
        raise BackupError(f"{src / MANIFEST} is not valid JSON; the backup is damaged") from None
    if not isinstance(manifest, dict) or type(manifest.get("format")) is not int \
            or manifest["format"] != FORMAT:
        raise BackupError(f"{src} is a backup format this program does not know")
    return manifest


# What backup writes into a manifest, by field: the type each must have when present.
_FIELDS: dict[str, tuple[type, str]] = {
    "kind": (str, "a string"), "created_at": (str, "a string"), "source": (str, "a string"),
    "collector_id": (str, "a string"), "schema_version": (int, "an integer"),
    "counts": (dict, "an object"), "with_artifacts": (bool, "true or false"),
    "artifacts": (list, "a list"),
}


def _typed(value: Any, kind: type) -> bool:
    # JSON's true is no count and 1 is no flag, though Python's bool is an int.
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def manifest_artifacts(src: Path, manifest: dict[str, Any]) -> list[tuple[str, bool]]:
    """Check every field of the manifest; each listed artifact's hash and whether the backup
    says it holds its bytes. BackupError naming the first wrong field."""
    def damaged(what: str) -> BackupError:
        return BackupError(f"{src / MANIFEST} is damaged ({what}); nothing was restored")

    for key, (kind, shown) in _FIELDS.items():
        if key in manifest and not _typed(manifest[key], kind):
            raise damaged(f"{key} is not {shown}")
    for table, count in (manifest.get("counts") or {}).items():
        if not _typed(count, int):
            raise damaged(f"counts.{str(table)[:40]} is not an integer")
    listed = []
    for index, entry in enumerate(manifest.get("artifacts") or []):
        where = f"artifacts[{index}]"
        if not isinstance(entry, dict):
            raise damaged(f"{where} is not an object")
        sha256 = entry.get("sha256")
        if not isinstance(sha256, str) or not _HEX64.fullmatch(sha256):
            raise damaged(f"{where}.sha256 is not a SHA-256 in hex")
        if "size" in entry and not (_typed(entry["size"], int) and entry["size"] >= 0):
            raise damaged(f"{where}.size is not a size in bytes")
        if "included" in entry and not _typed(entry["included"], bool):
            raise damaged(f"{where}.included is not true or false")
        listed.append((sha256, bool(entry.get("included"))))
    return listed


def _backup_id(src: Path) -> str | None:
    """The collector id the backup holds (None when it holds none), checked to be one line of
    text: it is written into the data directory and shown by /api/health as it is."""
    path = src / ID_NAME
    if not path.exists():
        return None
    try:
        text = identity.read_id(path)
    except (OSError, ValueError):
        text = None
    if text is None:
        raise BackupError(f"{path} is not a collector id (one short line of text); the backup "
                          "is damaged")
    return text


@dataclass
class _Checked:
    """What restore learnt from the backup before touching the data directory."""
    version: int
    counts: dict[str, int]
    collector_id: str | None
    artifacts: list[tuple[str, bool]]


def check_backup(src: Path) -> _Checked:
    """The whole backup checked: manifest, database, collector id. BackupError when damaged."""
    manifest = read_manifest(src)
    artifacts = manifest_artifacts(src, manifest)
    version, counts = _check_database(src / DB_NAME)
    if version > known_schema_version():
        raise BackupError(f"the backup is at schema version {version}, newer than this program "
                          f"knows ({known_schema_version()}); restore it with a newer fleet-min")
    return _Checked(version, counts, _backup_id(src), artifacts)


def restore(src: Path, data_dir: Path, force: bool = False) -> Report:
    """Put the backup in src into data_dir; refuses while a collector runs on it.

    The data directory's lock (the one a running collector holds) is held for the whole
    restore, so a collector started meanwhile refuses to start instead of opening a database
    that is being replaced.
    """
    started = time.monotonic()
    checked = check_backup(src)
    try:
        lock = dirlock.hold(data_dir, "collector restore", mode=filemodes.COLLECTOR_DIR)
    except dirlock.DirectoryInUse as exc:
        raise BackupError(f"{exc}; stop it first") from None
    try:
        return _restore_into(src, data_dir, force, checked, started)
    finally:
        lock.release()


def _refuse_links(data_dir: Path, checked: _Checked) -> None:
    """NotPrivate, before anything is written, for a link where restore would write: the
    collector's files at the top (filemodes.tighten_children refuses them, as the collector
    does at start), the artifact store when it is not this user's private folder, a shard or an
    artifact file."""
    filemodes.tighten_children(data_dir, filemodes.COLLECTOR_DIR, filemodes.COLLECTOR_FILE)
    store = data_dir / "artifacts"
    if not checked.artifacts:
        return
    if os.path.lexists(store):
        filemodes.private_dir(store, filemodes.COLLECTOR_DIR)
    for sha256, _ in checked.artifacts:
        filemodes.refuse_link(store / sha256[:2])
        filemodes.refuse_link(store / sha256[:2] / sha256)


def _restore_into(src: Path, data_dir: Path, force: bool, checked: _Checked,
                  started: float) -> Report:
    target = data_dir / DB_NAME
    _refuse_links(data_dir, checked)
    if database_in_use(target):
        raise BackupError(f"the database in {data_dir} is open (a collector is running on it); "
                          "stop the collector first")
    report = Report(path=str(data_dir), counts=checked.counts, schema_version=checked.version)
    if target.exists():
        if not force:
            raise BackupError(f"{data_dir} already holds a database; pass --force to move it "
                              "aside (into pre-restore-<time>/) and restore over it")
        report.moved_aside = str(_move_aside(data_dir))
    _place_database(src / DB_NAME, target)
    if checked.collector_id is not None:
        _place(data_dir / ID_NAME, (checked.collector_id + "\n").encode())
    store = data_dir / "artifacts"
    if checked.artifacts:
        filemodes.private_dir(store, filemodes.COLLECTOR_DIR)
    for sha256, included in checked.artifacts:
        dest = _artifact_file(store, sha256)
        packed = _artifact_file(src / "artifacts", sha256)
        if included and packed.exists() and not os.path.lexists(dest):
            report.artifacts_bytes += _copy_hashed(packed, dest, sha256)
            report.artifacts_copied += 1
        if not dest.exists():
            report.artifacts_missing.append(sha256)
    _fsync_path(data_dir, directory=True)
    report.seconds = round(time.monotonic() - started, 3)
    return report


def _move_aside(data_dir: Path) -> Path:
    aside = data_dir / f"pre-restore-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    aside.mkdir(mode=filemodes.COLLECTOR_DIR)
    for name in (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm", ID_NAME):
        if (data_dir / name).exists():
            os.replace(data_dir / name, aside / name)
    return aside


def _place(target: Path, data: bytes) -> None:
    """Write a new file with the collector's mode and rename it over `target` (a rename
    replaces whatever is there, never writing through it)."""
    part = target.with_name(target.name + ".restoring")
    filemodes.write_new(part, data, filemodes.COLLECTOR_FILE)
    os.replace(part, target)


def _place_database(copy: Path, target: Path) -> None:
    part = target.with_name(target.name + ".restoring")
    with open(copy, "rb") as reader, \
            os.fdopen(filemodes.open_new(part, filemodes.COLLECTOR_FILE), "wb") as writer:
        shutil.copyfileobj(reader, writer, _CHUNK)
        writer.flush()
        os.fsync(writer.fileno())
    for stale in (Path(str(target) + "-wal"), Path(str(target) + "-shm")):
        stale.unlink(missing_ok=True)  # never let an old WAL replay onto the restored file
    os.replace(part, target)


# -- command line ---------------------------------------------------------------------------


def _data_dir(given: str | None, required: bool) -> Path:
    from fleet_min.config import COLLECTOR_SETTINGS, resolve

    if given is None and required and not os.environ.get("FLEET_DATA_DIR"):
        raise BackupError("say which data directory to restore into with --data DIR")
    return Path(resolve(COLLECTOR_SETTINGS, {"data_dir": given}).data_dir)


def _summary(verb: str, report: Report) -> str:
    counts = ", ".join(f"{n} {table}" for table, n in report.counts.items())
    line = f"{verb} {report.path}: {counts}; schema version {report.schema_version}"
    if report.artifacts_copied:
        line += (f"; {report.artifacts_copied} artifact files "
                 f"({report.artifacts_bytes / 1048576:.1f} MiB)")
    if report.moved_aside:
        line += f"; the previous database was moved to {report.moved_aside}"
    if report.artifacts_missing:
        line += (f"; {len(report.artifacts_missing)} indexed artifacts have no bytes "
                 "(deleted meanwhile, or not in the backup: take one with --with-artifacts)")
    return line + f" ({report.seconds} s)"


def main(command: str, argv: list[str]) -> int:
    """`fleet-min collector backup|restore ...`; 0 on success, 1 with a sentence on failure."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"fleet-min collector {command}")
    parser.add_argument("path", help="the backup directory (created by backup, read by restore)")
    parser.add_argument("--data", dest="data_dir", default=None,
                        help="the collector's data directory (env FLEET_DATA_DIR)")
    if command == "backup":
        parser.description = ("Take a consistent online backup of the collector's database and "
                              "artifact index (safe while the collector runs).")
        parser.add_argument("--with-artifacts", action="store_true",
                            help="also copy the bytes of every artifact the index names")
    else:
        parser.description = ("Restore a backup into a data directory whose collector is "
                              "stopped.")
        parser.add_argument("--force", action="store_true",
                            help="move an existing database aside (pre-restore-<time>/) first")
    args = parser.parse_args(argv)
    try:
        if command == "backup":
            report = backup(_data_dir(args.data_dir, False), Path(args.path),
                            args.with_artifacts)
            print(_summary("backup written to", report))
        else:
            report = restore(Path(args.path), _data_dir(args.data_dir, True), args.force)
            print(_summary("restored into", report))
    except BackupError as exc:
        print(f"fleet-min collector {command}: {exc}", file=sys.stderr)
        return 1
    except filemodes.NotPrivate as exc:
        print(f"fleet-min collector {command}: cannot use {exc.filename}: {exc.strerror}",
              file=sys.stderr)
        return 1
    except sqlite3.Error as exc:  # what the checks above did not word (a database gone bad)
        print(f"fleet-min collector {command}: SQLite refused: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"fleet-min collector {command}: {exc.strerror or exc}: "
              f"{exc.filename or args.path}", file=sys.stderr)
        return 1
    return 0

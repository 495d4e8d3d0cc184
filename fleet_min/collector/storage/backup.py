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

Restore (restore.py) refuses to touch a data directory in use. It takes the directory's lock,
the one a running collector holds for its whole life (fleet_min.dirlock), and keeps it until it
is done, so a collector cannot start half-way through either. It also asks the operating system
whether anything else has the database open: every connection to a WAL database holds a shared
lock on the "dead man switch" byte of its `-shm` file for as long as it is open, so a sqlite3
shell, or a collector older than the lock, is seen too (database_in_use). It checks a copy of
the backup (backup_check.py) and installs a database the collector's migrations made, holding
that copy's rows; an existing database is moved aside into `DIR/pre-restore-<time>/`, never
deleted, and only with --force.

Backup takes no lock: it is an online backup, meant to run beside the live collector.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet_min import filemodes
from fleet_min.collector.storage import backup_check, identity
from fleet_min.collector.storage.identity import ID_NAME
from fleet_min.timeutil import iso

DB_NAME = "fleet.sqlite3"
MANIFEST = "manifest.json"
FORMAT = 1
# About 120 bytes a listed artifact: room for a quarter of a million.
MANIFEST_CAP = 32 << 20
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
    undone: str | None = None  # the folder an interrupted restore's files came back from
    # restore --leave-out-bad-rows: rows left out by table (not in counts), the first named
    left_out: dict[str, int] = field(default_factory=dict)
    left_out_rows: list[str] = field(default_factory=list)
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


def fsync_path(path: Path, directory: bool = False) -> None:
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


def read_only(path: Path) -> sqlite3.Connection:
    """A read-only connection to the database at `path`. The URI is built by pathlib, which
    percent-encodes what a URI would read otherwise: a `?` or `#` in a folder's name began
    the query or the fragment, and `%` an escape."""
    return sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=30)


def artifact_file(root: Path, sha256: str) -> Path:
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise BackupError(f"the artifact index names {sha256[:80]!r}, which is not a SHA-256")
    return root / sha256[:2] / sha256


# -- backup ---------------------------------------------------------------------------------


def backup(data_dir: Path, dest: Path, with_artifacts: bool = False) -> Report:
    """Write a consistent backup of data_dir's collector into the new directory dest."""
    started = time.monotonic()
    source = data_dir / DB_NAME
    if os.path.lexists(data_dir / "restore-in-progress"):
        raise BackupError(f"a restore into {data_dir} was interrupted; finish it (run the "
                          "restore again) before taking a backup of it")
    if not source.is_file():
        raise BackupError(f"there is no collector database at {source}; pass the collector's "
                          "data directory with --data")
    if os.path.islink(dest):
        # The backup is made beside it and renamed into place, which a link cannot take (an
        # empty directory it led to was found after the whole backup was made; a dangling one
        # had the error name the hidden work directory).
        raise BackupError(f"{dest} is a symbolic link; give the directory it leads to, or a "
                          "new path")
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
        fsync_path(dest.parent, directory=True)
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
    fsync_path(target)


def _fill(data_dir: Path, source: Path, work: Path, with_artifacts: bool) -> Report:
    copy = work / DB_NAME
    _snapshot(source, copy)
    try:
        checked = backup_check.check_database(copy, known_schema_version())
    except backup_check.Refused as exc:
        raise BackupError(f"{exc} (copied from {source})") from None
    version, counts = checked.version, checked.counts
    report = Report(path=str(work), counts=counts, schema_version=version)
    try:
        collector_id = identity.read_id(data_dir / ID_NAME)
    except ValueError as exc:
        raise BackupError(f"{exc}; a backup would carry it on") from None
    if collector_id:
        filemodes.write_new(work / ID_NAME, (collector_id + "\n").encode(),
                            filemodes.COLLECTOR_FILE)
    rows = checked.artifacts
    included: list[dict[str, Any]] = []
    for sha256, size in rows:
        entry: dict[str, Any] = {"sha256": sha256, "size": size}
        if with_artifacts:
            src = artifact_file(data_dir / "artifacts", sha256)
            try:
                report.artifacts_bytes += _copy_hashed(src, artifact_file(work / "artifacts",
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
        fsync_path(path)
    fsync_path(work, directory=True)
    return report


def _walk(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            yield path


# -- what restore reads first (the rest: restore.py, backup_check.py) ----------------------


def read_manifest(src: Path) -> dict[str, Any]:
    """The manifest, read from a regular file of at most MANIFEST_CAP bytes."""
    try:
        manifest = json.loads(backup_check.read_small(src / MANIFEST, MANIFEST_CAP))
    except FileNotFoundError:
        raise BackupError(f"{src} is not a fleet-min collector backup (no {MANIFEST})") from None
    except backup_check.Refused as exc:
        raise BackupError(str(exc)) from None
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


def backup_id(src: Path) -> str | None:
    """The collector id the backup holds (None when it holds none), checked to be one line of
    text: it is written into the data directory and shown by /api/health as it is."""
    path = src / ID_NAME
    if not os.path.lexists(path):
        return None
    why = ""
    try:
        text = identity.read_id(path)
    except identity.NotAnId as exc:
        text, why = None, exc.why and f"; {exc.why}"
    except OSError as exc:
        text, why = None, f"; it cannot be read: {exc.strerror}"
    if text is None:
        raise BackupError(f"{path} is not a collector id (one short line of text{why}); the "
                          "backup is damaged")
    return text

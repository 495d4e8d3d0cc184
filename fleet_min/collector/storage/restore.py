"""`fleet-min collector restore PATH --data DIR`: put a backup into a stopped collector's data
directory, so that no interruption (Ctrl-C, `kill -9`, a power cut) can lose the data that was
there, and no collector starts on a half-restored directory.

Restore holds the data directory's lock (fleet_min.dirlock) from start to end, so a collector
cannot start meanwhile, and refuses while anything has the database open. It then works in
three phases:

1. Stage. Everything restore will install is copied out of the backup into its own private
   folder `DIR/restore-work/` and checked there (fleet_min.collector.storage.backup_check): the
   database (schema, integrity, counts against the manifest), the collector id, each artifact
   (hash and size). A backup that fails any check is refused with one sentence and `DIR` is as
   it was. The database installed later is not that copy but one made beside it by the
   collector's own migrations, up to the copy's schema version, holding the copy's rows
   (backup_check.rebuild): no table, index, CHECK or COLLATE written in the backup is ever
   installed, and a file swapped in the backup meanwhile is never read again.
2. Fold. With --force over an existing database, its write-ahead log is checkpointed into it
   (`PRAGMA wal_checkpoint(TRUNCATE)`; refused when that fails), so the database file alone
   holds the data and the order of the moves below cannot strand it in a -wal.
3. Commit. A marker `DIR/restore-in-progress` (fsynced, naming the backup and the folder the
   previous data goes to) is written before the first move and removed after the last. Between
   them the previous database, its -wal/-shm/-journal and collector id are moved into
   `DIR/pre-restore-<time>/`, never deleted, then the staged files are renamed into place.

A collector refuses to start while the marker is there (`interrupted`). Restore run again with
the marker there first undoes the interrupted one (moves the previous files back from the
folder the marker names; what the interrupted restore installed is replaced), then restores as
asked: the previous data ends in a new pre-restore folder, readable, and nothing of it is lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet_min import dirlock, filemodes
from fleet_min.collector.storage import backup_check
from fleet_min.collector.storage.backup import (
    DB_NAME,
    MANIFEST,
    BackupError,
    Report,
    artifact_file,
    backup_id,
    database_in_use,
    fsync_path,
    known_schema_version,
    manifest_artifacts,
    read_manifest,
)
from fleet_min.collector.storage.backup_check import Refused
from fleet_min.collector.storage.identity import ID_NAME
from fleet_min.timeutil import iso

MARKER = "restore-in-progress"
WORK = "restore-work"
# The previous collector's files, moved aside together (a hot -journal is a database's too).
PREVIOUS = (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm", DB_NAME + "-journal", ID_NAME)
_ASIDE = re.compile(r"pre-restore-[0-9]{8}T[0-9]{6}Z(-[0-9]{1,4})?")
_MARKER_CAP = 64 * 1024
_SPARE = 64 << 20  # room left on the disk beyond what is staged


# -- what a collector start asks ------------------------------------------------------------


def interrupted(data_dir: Path) -> str | None:
    """A sentence when a restore into data_dir was interrupted (its marker is there, or its
    work folder): a collector must not start on a half-restored directory, nor make an empty
    database and a new id where the operator meant to restore. None otherwise."""
    if not os.path.lexists(data_dir / MARKER):
        if os.path.lexists(data_dir / WORK) or os.path.lexists(data_dir / (MARKER + ".part")):
            return (f"a restore into {data_dir} was interrupted while it copied and checked "
                    f"the backup ({WORK}/ is there); nothing else in {data_dir} was changed: "
                    f"run the restore again, or remove {data_dir / WORK} (and "
                    f"{MARKER}.part, if there) to start on {data_dir} as it is")
        return None
    try:
        marker = _read_marker(data_dir)
    except BackupError as exc:
        return (f"a restore into {data_dir} was interrupted, so its database may be "
                f"half-replaced, and {exc}")
    fix = (f"run the restore again (fleet-min collector restore "
           f"{marker['backup']} --data {data_dir} --force), which undoes the "
           "interrupted one first")
    aside = marker.get("aside")
    if aside and os.path.isdir(data_dir / aside):
        fix += (f", or put the files in {data_dir / aside} back into {data_dir} and "
                f"remove {data_dir / MARKER}")
    else:  # killed before it moved anything aside: the previous files are in place
        fix += f", or remove {data_dir / MARKER} (it had moved nothing yet)"
    return (f"a restore into {data_dir} was interrupted ({MARKER} is there), so its database "
            f"may be half-replaced; to finish, {fix}")


def orphan_log(data_dir: Path) -> str | None:
    """A sentence when data_dir holds a database's write-ahead log without the database: a
    collector started there would make an empty database and the log's writes would be lost."""
    wal = data_dir / (DB_NAME + "-wal")
    with contextlib.suppress(OSError):
        if not os.path.lexists(data_dir / DB_NAME) and wal.lstat().st_size > 0:
            return (f"{data_dir} holds {wal.name} but no {DB_NAME}: the database's latest "
                    f"writes are in that log and would be lost; put {DB_NAME} back beside it "
                    "(from a pre-restore-<time>/ folder when a restore moved it), or move the "
                    "log away to start empty")
    return None


# -- restore --------------------------------------------------------------------------------


@dataclass
class _Staged:
    """What restore checked and copied into its work folder, ready to be renamed into place."""
    checked: backup_check.Checked
    database: Path
    collector_id: Path | None
    artifacts: list[tuple[str, Path]]  # (sha256, staged file; the backup's for a check)
    listed: list[str]  # every artifact the manifest names


def restore(src: Path, data_dir: Path, force: bool = False, leave_out: bool = False) -> Report:
    """Put the backup in src into data_dir; refuses while a collector runs on it. `leave_out`:
    restore without the record rows (results, beacons, ...) the collector's readers cannot
    take, each said in the report, rather than refuse the backup for them."""
    started = time.monotonic()
    manifest = read_manifest(src)
    listed = manifest_artifacts(src, manifest)
    collector_id = backup_id(src)
    made = not os.path.lexists(data_dir)
    try:
        lock = dirlock.hold(data_dir, "collector restore", mode=filemodes.COLLECTOR_DIR)
    except dirlock.DirectoryInUse as exc:
        raise BackupError(f"{exc}; stop it first") from None
    done = False
    try:
        report = _restore_locked(src, data_dir, force, manifest, listed, collector_id,
                                 leave_out)
        done = True
    except Refused as exc:
        raise BackupError(str(exc)) from None
    finally:
        _clear(data_dir / WORK)
        if made and not done:
            _unmake(data_dir)
        lock.release()
    report.seconds = round(time.monotonic() - started, 3)
    return report


def check(src: Path, leave_out: bool = False) -> Report:
    """Every check restore makes of the backup in src (the manifest; the database's schema,
    integrity, counts and rows; the collector id; each artifact's hash and size), with its
    database staged in a private temporary folder (TMPDIR) that is removed after, and nothing
    installed anywhere. The report says what a restore would install; BackupError with the
    sentence a restore would refuse with."""
    started = time.monotonic()
    manifest = read_manifest(src)
    listed = manifest_artifacts(src, manifest)
    collector_id = backup_id(src)
    with tempfile.TemporaryDirectory(prefix="fleet-restore-check-") as scratch:
        try:
            staged = _stage(src, Path(scratch), manifest, listed, collector_id, leave_out,
                            copy_artifacts=False)
        except Refused as exc:
            raise BackupError(str(exc)) from None
    report = _report(str(src), staged)
    for _, packed in staged.artifacts:
        report.artifacts_copied += 1
        report.artifacts_bytes += packed.stat().st_size
    report.seconds = round(time.monotonic() - started, 3)
    return report


def _report(path: str, staged: _Staged) -> Report:
    return Report(path=path, counts=staged.checked.counts, schema_version=staged.checked.version,
                  left_out={left.table: left.count for left in staged.checked.left_out},
                  left_out_rows=[str(bad) for left in staged.checked.left_out
                                 for bad in left.examples])


def _restore_locked(src: Path, data_dir: Path, force: bool, manifest: dict[str, Any],
                    listed: list[tuple[str, bool]], collector_id: str | None,
                    leave_out: bool) -> Report:
    target = data_dir / DB_NAME
    _refuse_links(data_dir, listed)
    if database_in_use(target):
        # Not a collector of this version: it would hold the directory's lock taken above.
        raise BackupError(f"the database in {data_dir} is open in another process (a sqlite3 "
                          "shell, a copy or backup tool, or a collector of a version before "
                          "the data directory lock); close it first")
    marker = _read_marker(data_dir) if os.path.lexists(data_dir / MARKER) else None
    staged = _stage(src, data_dir, manifest, listed, collector_id, leave_out)
    if not force and marker and marker["aside"]:
        raise BackupError(f"an interrupted restore into {data_dir} had moved its data into "
                          f"{marker['aside']}/; pass --force to put it back, move it aside "
                          "again and restore over it")
    if not force and target.exists():
        raise BackupError(f"{data_dir} already holds a database; pass --force to move it "
                          "aside (into pre-restore-<time>/) and restore over it")
    report = _report(str(data_dir), staged)
    if marker is not None:
        report.undone = _undo(data_dir, marker)
    problem = orphan_log(data_dir)
    if problem:
        raise BackupError(problem)
    if target.exists():
        _fold_log(target)
    _commit(src, data_dir, staged, report)
    return report


def _refuse_links(data_dir: Path, listed: list[tuple[str, bool]]) -> None:
    """NotPrivate, before anything is written, for a link where restore would write: the
    collector's files at the top (filemodes.tighten_children refuses them, as the collector
    does at start), the artifact store when it is not this user's private folder, a shard or an
    artifact file."""
    filemodes.tighten_children(data_dir, filemodes.COLLECTOR_DIR, filemodes.COLLECTOR_FILE)
    store = data_dir / "artifacts"
    if not listed:
        return
    if os.path.lexists(store):
        filemodes.private_dir(store, filemodes.COLLECTOR_DIR)
    for sha256, _ in listed:
        filemodes.refuse_link(store / sha256[:2])
        filemodes.refuse_link(store / sha256[:2] / sha256)


# -- stage: copy out of the backup, check the copies ---------------------------------------


def _stage(src: Path, data_dir: Path, manifest: dict[str, Any], listed: list[tuple[str, bool]],
           collector_id: str | None, leave_out: bool, *, copy_artifacts: bool = True
           ) -> _Staged:
    work = data_dir / WORK
    _clear(work)
    work.mkdir(mode=0o700)
    copy = work / (DB_NAME + ".checked")
    _copy_database(src / DB_NAME, copy)
    checked = backup_check.check_database(copy, known_schema_version(), src / DB_NAME)
    database = _rebuild(copy, work / DB_NAME, checked.version, src / DB_NAME, leave_out)
    copy.unlink()
    checked = backup_check.Checked(checked.version, database.counts, database.artifacts,
                                   database.left_out)
    backup_check.compare_manifest(src / MANIFEST, manifest, checked)
    staged_id = None
    if collector_id is not None:
        staged_id = work / ID_NAME
        filemodes.write_new(staged_id, (collector_id + "\n").encode(), filemodes.COLLECTOR_FILE)
    sizes = dict(checked.artifacts)
    artifacts = []
    for sha256, included in listed:
        dest = artifact_file(data_dir / "artifacts", sha256)
        packed = artifact_file(src / "artifacts", sha256)
        if included and sha256 in sizes and os.path.lexists(packed) \
                and not os.path.lexists(dest):
            copied = _copy_artifact(packed, work / sha256 if copy_artifacts else None,
                                    sha256, sizes[sha256])
            artifacts.append((sha256, copied or packed))
    return _Staged(checked, work / DB_NAME, staged_id, artifacts, [sha for sha, _ in listed])


def _copy_database(src: Path, dest: Path) -> None:
    try:
        size = src.lstat().st_size
    except FileNotFoundError:
        raise BackupError(f"{src} is missing (or not a file); the backup is damaged") from None
    free = shutil.disk_usage(dest.parent).free
    if size + _SPARE > free:
        raise BackupError(f"{src} is {size >> 20} MiB, more than the free space beside "
                          f"{dest.parent.parent} ({free >> 20} MiB) allows; free some space")
    with os.fdopen(filemodes.open_new(dest, filemodes.COLLECTOR_FILE), "wb") as writer:
        try:
            backup_check.copy_regular(src, writer.fileno(), limit=size)
        except FileNotFoundError:
            raise BackupError(f"{src} is missing (or not a file); the backup is "
                              "damaged") from None


def _rebuild(copy: Path, dest: Path, version: int, shown: Path, leave_out: bool
             ) -> backup_check.Checked:
    """The database restore installs, at dest: made by the collector's own migrations and
    holding the checked copy's rows (backup_check.rebuild), fsynced; what it holds."""
    size = copy.stat().st_size
    free = shutil.disk_usage(dest.parent).free
    if size + _SPARE > free:
        raise BackupError(f"{shown} is {size >> 20} MiB, and restore needs room for a second "
                          f"copy of it beside {dest.parent.parent} ({free >> 20} MiB free); "
                          "free some space")
    os.close(filemodes.open_new(dest, filemodes.COLLECTOR_FILE))
    checked = backup_check.rebuild(copy, dest, version, shown, leave_out=leave_out)
    fsync_path(dest)
    return checked


def _copy_artifact(packed: Path, dest: Path | None, sha256: str, size: int) -> Path | None:
    """The backup's bytes of one artifact, copied into the work folder (or with `dest` None
    only read) and checked to be what their name says (at most `size` bytes are read)."""
    import hashlib

    digest = hashlib.sha256()
    if dest is None:
        copied = backup_check.copy_regular(packed, None, limit=size, seen=digest.update)
    else:
        with os.fdopen(filemodes.open_new(dest, filemodes.COLLECTOR_FILE), "wb") as writer:
            copied = backup_check.copy_regular(packed, writer.fileno(), limit=size,
                                               seen=digest.update)
    if copied != size or digest.hexdigest() != sha256:
        raise Refused(f"artifact file {packed} does not match its SHA-256 name or size; the "
                      "backup is damaged there")
    return dest


# -- undo an interrupted restore, fold the log, commit -------------------------------------


def _read_marker(data_dir: Path) -> dict[str, Any]:
    path = data_dir / MARKER
    try:
        marker = json.loads(backup_check.read_small(path, _MARKER_CAP))
    except (OSError, ValueError):
        marker = None
    if not isinstance(marker, dict) or not isinstance(marker.get("backup"), str) \
            or not (marker.get("aside") is None
                    or (isinstance(marker["aside"], str) and _ASIDE.fullmatch(marker["aside"])))\
            or not isinstance(marker.get("moved"), list) \
            or not all(name in PREVIOUS for name in marker["moved"]):
        raise BackupError(f"{path} (left by an interrupted restore) is damaged; "
                          + _damaged_marker_fix(data_dir))
    return marker


def _damaged_marker_fix(data_dir: Path) -> str:
    """What to do about a marker that cannot be read. Its restore wrote it just before making
    its own pre-restore folder, so that folder, when there is one, is the newest; older ones
    are finished restores' and hold nothing of this one. The marker's own time proves nothing
    (it may have been edited since), so the folders are named as they are, not guessed."""
    try:
        folders = sorted((name for name in os.listdir(data_dir) if _ASIDE.fullmatch(name)),
                         key=_aside_order)
    except OSError:
        folders = []
    if not folders:
        return (f"no pre-restore folder is in {data_dir}, so the restore had moved nothing "
                f"aside and the previous files are still in place: remove {MARKER}")
    older = f" (older: {', '.join(reversed(folders[-3:-1]))})" if len(folders) > 1 else ""
    return (f"if the interrupted restore made {folders[-1]}/ (the newest{older}), put its "
            f"files back into {data_dir} by hand; then remove {MARKER}")


def _aside_order(name: str) -> tuple[str, int]:
    """pre-restore-<time>[-n] in the order they were made (-10 after -9)."""
    stamp, _, n = name[len("pre-restore-"):].partition("-")
    return stamp, int(n or 1)


def _write_marker(data_dir: Path, marker: dict[str, Any]) -> None:
    part = data_dir / (MARKER + ".part")
    filemodes.write_new(part, (json.dumps(marker) + "\n").encode(), filemodes.COLLECTOR_FILE)
    os.replace(part, data_dir / MARKER)
    fsync_path(data_dir, directory=True)


def _undo(data_dir: Path, marker: dict[str, Any]) -> str | None:
    """Put back what the interrupted restore the marker names had moved aside (a file it had
    not moved yet is still in place). Nothing is deleted or overwritten: whatever stands at one
    of those names (what the interrupted restore installed, or anything put there since) is
    moved into a `restore-undone-<time>/` folder first. Says where the previous files came
    from, and where what was in the way went."""
    aside = data_dir / marker["aside"] if marker["aside"] else None
    undone: str | None = None
    for name in PREVIOUS:
        back = name in marker["moved"] and aside is not None and os.path.lexists(aside / name)
        if os.path.lexists(data_dir / name) and (back or name not in marker["moved"]):
            if undone is None:
                undone = _aside_name(data_dir, "restore-undone")
                (data_dir / undone).mkdir(mode=filemodes.COLLECTOR_DIR)
            os.replace(data_dir / name, data_dir / undone / name)
        if back:
            assert aside is not None
            os.replace(aside / name, data_dir / name)
    if undone is not None:
        fsync_path(data_dir / undone, directory=True)
    if aside is not None:
        with contextlib.suppress(OSError):
            aside.rmdir()  # only when empty: anything else left in it is kept
    fsync_path(data_dir, directory=True)
    (data_dir / MARKER).unlink()
    fsync_path(data_dir, directory=True)
    said = marker["aside"] or "(nothing was there before it)"
    return said + (f"; what stood in the way is kept in {undone}/" if undone else "")


def _fold_log(target: Path) -> None:
    """Checkpoint the existing database's WAL into it, so that the file alone holds its data."""
    why = None
    try:
        conn = sqlite3.connect(f"{target.absolute().as_uri()}?mode=rw", uri=True, timeout=5,
                               isolation_level=None)
        try:
            busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        finally:
            conn.close()
        if busy:
            why = "the log is busy"
    except sqlite3.Error as exc:
        why = str(exc)
    if why:
        raise BackupError(f"cannot fold the write-ahead log of {target} into it ({why}); move "
                          f"{target.name} and its -wal and -shm files out of {target.parent} "
                          "together (keep them: they are the previous data), then run the "
                          "restore again")


def _commit(src: Path, data_dir: Path, staged: _Staged, report: Report) -> None:
    previous = [name for name in PREVIOUS if os.path.lexists(data_dir / name)]
    aside = _aside_name(data_dir) if previous else None
    _write_marker(data_dir, {"backup": str(src.absolute()), "aside": aside, "moved": previous,
                             "started_at": iso(time.time())})
    if aside is not None:
        (data_dir / aside).mkdir(mode=filemodes.COLLECTOR_DIR)
        for name in previous:
            os.replace(data_dir / name, data_dir / aside / name)
        fsync_path(data_dir / aside, directory=True)
        report.moved_aside = str(data_dir / aside)
    os.replace(staged.database, data_dir / DB_NAME)
    if staged.collector_id is not None:
        os.replace(staged.collector_id, data_dir / ID_NAME)
    fsync_path(data_dir, directory=True)
    _place_artifacts(data_dir / "artifacts", staged, report)
    (data_dir / MARKER).unlink()
    fsync_path(data_dir, directory=True)


def _place_artifacts(store: Path, staged: _Staged, report: Report) -> None:
    if staged.listed:
        filemodes.private_dir(store, filemodes.COLLECTOR_DIR)
    shards = set()
    for sha256, file in staged.artifacts:
        dest = artifact_file(store, sha256)
        dest.parent.mkdir(mode=filemodes.COLLECTOR_DIR, exist_ok=True)
        os.replace(file, dest)
        shards.add(dest.parent)
        report.artifacts_copied += 1
        report.artifacts_bytes += dest.stat().st_size
    for shard in sorted(shards):
        fsync_path(shard, directory=True)
    report.artifacts_missing = [sha for sha in staged.listed
                                if not artifact_file(store, sha).exists()]


def _aside_name(data_dir: Path, kind: str = "pre-restore") -> str:
    base = f"{kind}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    name, n = base, 1
    while os.path.lexists(data_dir / name):
        n += 1
        name = f"{base}-{n}"
    return name


def _clear(work: Path) -> None:
    """Remove restore's work folder (left by an interrupted run too); never follows a link."""
    if os.path.islink(work) or os.path.isfile(work):
        work.unlink()
    elif os.path.lexists(work):
        shutil.rmtree(work)


def _unmake(data_dir: Path) -> None:
    """Remove a data directory restore made and then refused to fill (only its lock file is
    in it), so a refusal leaves no trace."""
    with contextlib.suppress(OSError):
        if os.listdir(data_dir) == [dirlock.lock_file(data_dir, "collector").name]:
            dirlock.lock_file(data_dir, "collector").unlink()
            data_dir.rmdir()

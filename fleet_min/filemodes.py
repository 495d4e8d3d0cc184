"""File modes of the services' own directories: nothing in them is readable by other users.

The control plane keeps its tokens and database in a state directory of mode 0700 with files
0600; the collector keeps its database, id and artifacts in a data directory of mode 0750 with
files 0640 (its group may read them, for a backup account; others nothing). Each service creates
what is missing with those modes and, at start, takes away any bit beyond them from what exists
(an older version, a restore, an operator's copy), logging one line per change. Bits are only
ever taken away, never added: a file an operator made 0600 stays 0600.

SQLite gives a database's -wal and -shm files the database file's own mode, so a database file
created here first, with the right mode, keeps its companions right too.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("fleet_min.filemodes")

CONTROLPLANE_DIR, CONTROLPLANE_FILE = 0o700, 0o600
COLLECTOR_DIR, COLLECTOR_FILE = 0o750, 0o640


def tighten(path: Path, most: int, st_mode: int | None = None) -> bool:
    """Clear the permission bits of `path` beyond `most`; True when it changed. A symbolic link
    is left alone (its target may be anywhere), so is a file that is gone or not ours to change
    (that is logged: it stays as loose as it was)."""
    try:
        mode = st_mode if st_mode is not None else path.lstat().st_mode
        if stat.S_ISLNK(mode):
            return False
        current = stat.S_IMODE(mode)
        wanted = current & most
        if wanted == current:
            return False
        os.chmod(path, wanted)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("cannot tighten the mode of %s: %s", path, exc.strerror or exc)
        return False
    log.warning("tightened the mode of %s from %04o to %04o", path, current, wanted)
    return True


def private_dir(path: Path, most: int) -> None:
    """Create `path` (and its parents) with mode `most`, or tighten it when it exists. The
    directory itself is followed when it is a link: it is what the operator pointed us at."""
    path.mkdir(mode=most, parents=True, exist_ok=True)
    tighten(path, most, path.stat().st_mode)


def tighten_tree(root: Path, dir_most: int, file_most: int) -> int:
    """Tighten every directory and file below `root` (without following links); the count of
    changes. For small directories (the control plane's state), not for an artifact store."""
    changed = 0
    for folder, dirs, files in os.walk(root):
        base = Path(folder)
        changed += sum(tighten(base / name, dir_most) for name in dirs)
        changed += sum(tighten(base / name, file_most) for name in files)
    return changed


def tighten_children(folder: Path, dir_most: int, file_most: int) -> int:
    """Tighten the directories and files directly in `folder` (one level, links left alone)."""
    changed = 0
    with os.scandir(folder) as entries:
        for entry in entries:
            is_dir = entry.is_dir(follow_symlinks=False)
            changed += tighten(Path(entry.path), dir_most if is_dir else file_most)
    return changed


def create_file(path: Path, mode: int) -> None:
    """Create `path` empty with mode `mode` (no looser, whatever the umask) unless it exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     mode)
    except FileExistsError:
        return
    os.close(fd)


def database_files(path: Path) -> tuple[Path, Path, Path]:
    """A SQLite database and its WAL-mode companions."""
    return path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")

"""File modes of the services' own directories: nothing in them is readable by other users.

The control plane keeps its tokens and database in a state directory of mode 0700 with files
0600; the collector keeps its database, id and artifacts in a data directory of mode 0750 with
files 0640 (its group may read them, for a backup account; others nothing). Each service creates
what is missing with those modes and, at start, takes away any bit beyond them from what exists
(an older version, a restore, an operator's copy), logging one line per change. Bits are only
ever taken away, never added: a file an operator made 0600 stays 0600.

A directory the service cannot make private is refused, not used: one owned by another user
(that user could loosen it again, or plant links in it, at any time), one whose mode stays
looser after the attempt (a read-only or foreign file system), or one below a directory every
user may write to without the sticky bit (any of them could rename it and put their own there).
A symbolic link where the service keeps a file of its own is refused too: the service never
opens its own files through a link a loose directory may have let someone plant.

SQLite gives a database's -wal and -shm files the database file's own mode, so a database file
created here first, with the right mode, keeps its companions right too.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from pathlib import Path

try:
    import pwd
except ImportError:  # Windows
    pwd = None  # type: ignore[assignment]

log = logging.getLogger("fleet_min.filemodes")

CONTROLPLANE_DIR, CONTROLPLANE_FILE = 0o700, 0o600
COLLECTOR_DIR, COLLECTOR_FILE = 0o750, 0o640


class NotPrivate(PermissionError):
    """A directory or file the service refuses because it cannot keep it private. `strerror`
    is the reason, worded to follow "cannot use <path>: "; `filename` is the path."""

    def __init__(self, why: str, path: Path | str) -> None:
        super().__init__(errno.EPERM, why, str(path))


def _user(uid: int) -> str:
    name = None
    if pwd is not None:
        with contextlib.suppress(KeyError):  # a uid with no name
            name = pwd.getpwuid(uid).pw_name
    return f"uid {uid} ({name})" if name else f"uid {uid}"


def effective_uid() -> int | None:
    """The user this process acts as; None where files have no owners to compare (Windows)."""
    return os.geteuid() if hasattr(os, "geteuid") else None


def refuse_link(path: Path) -> None:
    """NotPrivate when `path` is a symbolic link: the service's own file is never reached
    through one. A missing path is fine (it will be created, without following anything)."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise NotPrivate(f"{path.name} is a symbolic link, and this file is never opened "
                         "through one (a link planted in a loose directory would redirect it); "
                         "remove the link", path)


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
    """Create `path` (and its parents) with mode `most`, or tighten it when it exists; NotPrivate
    when it belongs to another user or stays looser than `most`. The directory itself is
    followed when it is a link: it is what the operator pointed us at."""
    path.mkdir(mode=most, parents=True, exist_ok=True)
    st = path.stat()
    open_parent = open_parent_of(path.resolve())
    if open_parent:
        raise NotPrivate(open_parent, path)
    euid = effective_uid()
    # Root could tighten it, but its owner could loosen it again, or plant links, at any time.
    if euid is not None and st.st_uid != euid:
        raise NotPrivate(f"it belongs to {_user(st.st_uid)}, not to {_user(euid)} that runs "
                         "this, so its files could not be kept private; give it to this user "
                         "(chown) or choose another directory", path)
    tighten(path, most, st.st_mode)
    left = stat.S_IMODE(path.stat().st_mode)
    if left & ~most:
        raise NotPrivate(f"its mode stays {left:04o} (it could not be tightened to {most:04o}), "
                         "so its files could not be kept private; fix its mode or choose "
                         "another directory", path)


def open_parent_of(real: Path) -> str | None:
    """Why a directory above `real` (a resolved path) lets another user put a directory of
    their own in its place, or None. A service uses its directories by their paths, so a
    parent every user may write to, without the sticky bit that keeps them from renaming what
    is not theirs (as /tmp has it), hands the directory to any of them. Only that case: a
    parent another account owns or its group may write to is usual on some systems, and such
    an account could change more than this service anyway. The agent has the same rule."""
    if os.name == "nt":
        return None
    for parent in real.parents:
        try:
            mode = parent.stat().st_mode
        except OSError as exc:
            return f"its parent {parent} cannot be checked ({exc.strerror or exc})"
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            return (f"its parent {parent} has mode {stat.S_IMODE(mode):04o}: any user may "
                    "rename this directory and put one of their own in its place; remove the "
                    "write bit for others (chmod o-w) or set the sticky bit (chmod +t), or "
                    "choose another directory")
    return None


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
    """Tighten the directories and files directly in `folder` (one level). A link to a
    directory is left alone (a store on another disk; whoever uses it makes it private); any
    other link is refused: every file at this level is the service's own."""
    changed = 0
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_symlink() and not entry.is_dir():
                refuse_link(Path(entry.path))
            is_dir = entry.is_dir(follow_symlinks=False)
            changed += tighten(Path(entry.path), dir_most if is_dir else file_most)
    return changed


def create_file(path: Path, mode: int) -> None:
    """Create `path` empty with mode `mode` (no looser, whatever the umask) unless it exists;
    NotPrivate when what exists there is a symbolic link (O_EXCL never follows one, but the
    next open of the name would)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     mode)
    except FileExistsError:
        refuse_link(path)
        return
    os.close(fd)


def open_new(path: Path, mode: int) -> int:
    """A descriptor of `path`, made new and empty with mode `mode` (whatever the umask): what
    was at that name before (a leftover, a planted link) is removed, never written through."""
    path.unlink(missing_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                   | getattr(os, "O_CLOEXEC", 0), mode)


def write_new(path: Path, data: bytes, mode: int) -> None:
    """Write `data` into a new file at `path` with mode `mode` (see open_new), flushed to disk."""
    with os.fdopen(open_new(path, mode), "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


class NotRegular(ValueError):
    """A file read by `open_regular` or `read_regular` that is not what it should be. `what` is
    "link" (a symbolic link where none is followed), "special" (a FIFO, a device, a folder) or
    "large" (more bytes than the cap); the message is a sentence starting with the path, which
    callers may reword for their own readers."""

    def __init__(self, path: Path, what: str, cap: int = 0) -> None:
        sentence = {
            "link": f"{path} is a symbolic link, and is never read through one",
            "special": f"{path} is not a regular file (a FIFO, a device or a folder)",
            "large": f"{path} is larger than {cap} bytes",
        }[what]
        super().__init__(sentence)
        self.path, self.what, self.cap = path, what, cap


_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: Path, *, follow: bool = False) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file at `path` and its stat, for a file someone
    else may have put there. NotRegular for a link (unless `follow`) or anything but a regular
    file: a FIFO, a device or a folder is never opened (opening some devices does something),
    and the open never blocks (the name may be swapped for a FIFO between the check and the
    open; the descriptor is checked again). FileNotFoundError when there is none."""
    try:
        before = os.stat(path, follow_symlinks=follow)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a loop of links, when following
            raise NotRegular(path, "link") from None
        raise
    if stat.S_ISLNK(before.st_mode):
        raise NotRegular(path, "link")
    if not stat.S_ISREG(before.st_mode):
        raise NotRegular(path, "special")
    try:
        fd = os.open(path, _READ_FLAGS | (0 if follow else getattr(os, "O_NOFOLLOW", 0)))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegular(path, "link") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegular(path, "special")
    return fd, st


def read_regular(path: Path, cap: int, *, follow: bool = False, truncate: bool = False
                 ) -> bytes:
    """The bytes of the regular file at `path` (see open_regular), at most `cap` of them:
    NotRegular("large") when it holds more, or with `truncate` its first `cap` bytes. Never
    reads more than cap + 1 bytes, whatever the file's size says (it may grow meanwhile)."""
    fd, st = open_regular(path, follow=follow)
    try:
        if st.st_size > cap and not truncate:
            raise NotRegular(path, "large", cap)
        want = cap if truncate else cap + 1
        data = bytearray()
        while len(data) < want and (chunk := os.read(fd, min(1 << 20, want - len(data)))):
            data += chunk
    finally:
        os.close(fd)
    if len(data) > cap:
        raise NotRegular(path, "large", cap)
    return bytes(data)


def database_files(path: Path) -> tuple[Path, Path, Path]:
    """A SQLite database and its WAL-mode companions."""
    return path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")

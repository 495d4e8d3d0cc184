"""One owner per directory: an exclusive lock on a file inside it, held while the process lives.

Two collectors on one data directory would both write the same database and the same artifact
store; two control planes on one state directory would both supervise the same runners. The
service takes `fcntl.flock(LOCK_EX | LOCK_NB)` on `<dir>/<role>.lock` before it binds or opens
anything and never releases it: the kernel drops the lock when the process ends, however it ends
(`kill -9` included), so a stale lock file never blocks a restart. The holder's pid and role are
written into the file only so the refusal can name them.

The directory is made private first (fleet_min.filemodes.private_dir: refused when another user
owns it or its mode cannot be tightened), and the lock file is opened with O_NOFOLLOW: a link
planted there while the directory was loose is refused, never truncated and written through.

The descriptor is not inherited by child processes (Python opens files close-on-exec), so a
command the service runs cannot keep the lock alive after the service is gone. On platforms
without fcntl (Windows) there is no lock: a warning says so and the service starts anyway.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from fleet_min import filemodes

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


class DirectoryInUse(RuntimeError):
    """Another process holds the directory; the message names it and its pid."""


class DirLock:
    """A held lock; `release` gives it up early (restore does, the services never do)."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def lock_file(directory: Path, role: str) -> Path:
    """Where the lock of `role` ("collector", "controlplane") lives in `directory`."""
    return directory / f"{role.split()[0]}.lock"


def hold(directory: Path, role: str, shown: str | None = None, *, mode: int = 0o700
         ) -> DirLock:
    """Take the directory for this process, creating it with `mode` when missing (so that a
    fresh start has nothing to tighten and say so) and tightening it to `mode` when it exists.

    `role` names this holder in a refusal ("collector", "collector restore"); `shown` is how the
    directory is named in messages (default: as given). Raises DirectoryInUse when another
    process holds it, filemodes.NotPrivate when the directory cannot be made private or the lock
    file is a link (or not this user's file), OSError when the directory cannot be made or the
    file cannot be opened.
    """
    filemodes.private_dir(directory, mode)
    path = lock_file(directory, role)
    if fcntl is None:
        log.warning("cannot lock %s on this platform (no fcntl): make sure only one %s uses it",
                    directory, role.split()[0])
        return DirLock(path, None)
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _holder(fd)
        os.close(fd)
        raise DirectoryInUse(f"another {holder} is using {shown or directory}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {role}\n".encode(), 0)
    return DirLock(path, fd)


def _open(path: Path) -> int:
    """The lock file, created 0600 when missing, never through a link (it is truncated and
    written), and only when it is a plain file of this user's."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            filemodes.refuse_link(path)
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise filemodes.NotPrivate(f"{path.name} is not a plain file of this user's (a file "
                                   "planted while the directory was loose?); remove it", path)
    return fd


def _holder(fd: int) -> str:
    """`collector (pid 1234)` from what the holder wrote, or a plain word when it wrote nothing
    readable yet (it is between its flock and its write)."""
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    pid, _, role = text.partition(" ")
    if not pid.isdigit():
        return "process"
    return f"{role or 'process'} (pid {pid})"

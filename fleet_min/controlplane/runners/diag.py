"""The runner's own diagnostic logs (`_diag`): a summary and a redacted tail.

Only regular files are read (a symlink planted in `_diag` could point at `.credentials` or
anywhere on the host), and only their last TAIL_BYTES, so a log of gigabytes costs nothing.
"""

from __future__ import annotations

import heapq
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet_min.controlplane.runners.redact import redact
from fleet_min.logs import printable
from fleet_min.timeutil import iso

TAIL_BYTES = 64 * 1024
TAIL_LINES = 80


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def safe_file(path: Path, inside: Path) -> os.stat_result | None:
    """lstat of `path` when it is a regular file (not a link) inside `inside`, else None."""
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or path.name.startswith(".credentials"):
            return None
        # resolve() fails (EINVAL, ENOENT) when a job swaps an entry on the way between a link
        # and a file or directory as it is read: not a file to read, not a failed request.
        if not path.resolve().is_relative_to(inside.resolve()):
            return None
    except OSError:
        return None
    return info


def read_tail(path: Path, limit: int = TAIL_BYTES) -> str:
    """The last `limit` bytes of a log as text; "" when it is gone or no longer a regular file.
    The runner rotates its logs, and an entry checked a moment ago may since have been swapped
    for a FIFO or a link: this open neither waits for a writer nor follows a link."""
    found = _open_tail(path, limit, None)
    return found[0] if found is not None else ""


def _open_tail(path: Path | str, limit: int, dir_fd: int | None
               ) -> tuple[str, os.stat_result] | None:
    """(the tail as text, the fstat of the file read); None when it is no regular file.
    dir_fd: the directory `path` (then a plain name) is looked up in."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return None
    with open(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - limit))
        data = handle.read(limit)
    return _whole_lines(data, size > limit), info


def _whole_lines(data: bytes, cut: bool) -> str:
    text = data.decode("utf-8", "replace")
    if cut:
        # Drop the cut first line, all of it when no line break follows: the cut may have
        # taken its key (`db_pas|sword=...`) or a token's prefix, and the redactor cannot
        # know what is left for a secret.
        text = text.partition("\n")[2]
    return text


# Entries of `_diag` examined per request, in the directory's own order. The runner writes a
# Runner_ log per start and a Worker_ log per job, so a healthy `_diag` holds hundreds; but a
# job runs as the runner's user and can fill it with hundreds of thousands of empty `*.log`
# files, and each (unauthenticated) request for the runner's detail walked, resolved and
# sorted them all: 300,000 cost 40 s and 340 MB. 10,000 is many times what a healthy runner
# keeps, yet caps a request at that many lstat calls (milliseconds) and keeps no list that
# grows with the directory.
SCAN_LIMIT = 10_000
# Candidates kept per kind, newest first: more than one so that a log rotated away or swapped
# for a link between the scan and the read gives way to the next newest.
KEEP = 4

_Candidate = tuple[int, str, os.stat_result]  # (st_mtime_ns, name, lstat)


@dataclass
class DiagScan:
    """What one bounded walk of `_diag` found: counts over the entries examined and the
    newest few regular `.log` files (Runner_ logs apart), each kept in a heap of KEEP."""
    files: int = 0
    total_bytes: int = 0
    examined: int = 0
    more: bool = False  # the directory held entries past SCAN_LIMIT, never looked at
    runner_logs: list[_Candidate] = field(default_factory=list)
    logs: list[_Candidate] = field(default_factory=list)


def _keep(heap: list[_Candidate], item: _Candidate) -> None:
    if len(heap) < KEEP:
        heapq.heappush(heap, item)
    elif item > heap[0]:
        heapq.heapreplace(heap, item)


def _open_diag(runner_dir: Path) -> int | None:
    """A descriptor of `runner_dir/_diag`; None when there is none or it is a link (to `/`, to
    a huge tree, to a directory of the same names elsewhere)."""
    try:
        return os.open(runner_dir / "_diag", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                       | _NOFOLLOW)
    except OSError:
        return None


def scan_logs(runner_dir: Path, limit: int = SCAN_LIMIT) -> DiagScan:
    """At most `limit` entries of `runner_dir/_diag`, lstat only for the `.log` names among
    them."""
    fd = _open_diag(runner_dir)
    if fd is None:
        return DiagScan()
    try:
        return _scan(fd, limit)
    finally:
        os.close(fd)


def _scan(fd: int, limit: int) -> DiagScan:
    found = DiagScan()
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if found.examined >= limit:
                    found.more = True
                    break
                found.examined += 1
                name = entry.name
                if os.path.splitext(name)[1] != ".log" or name.startswith(".credentials"):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(info.st_mode):
                    continue
                found.files += 1
                found.total_bytes += info.st_size
                item = (info.st_mtime_ns, name, info)
                _keep(found.logs, item)
                if name.startswith("Runner_"):
                    _keep(found.runner_logs, item)
    except OSError:
        pass
    return found


def _newest_tail(fd: int, found: DiagScan) -> tuple[str, str, os.stat_result] | None:
    """(name, tail, fstat) of the newest Runner_ log when there is one, else of the newest log
    that is still a regular file when it is opened. Opened by name in the `_diag` the walk
    listed (`fd`), never by its path again: checked by path and then opened by path, the log
    was read from wherever `_diag` pointed by then, as a job can swap it for a link between
    the two (a log of the same name in another directory was served, unauthenticated)."""
    # A Runner_ log is in both heaps: each name is tried once.
    candidates = dict.fromkeys(name for _, name, _ in (
        sorted(found.runner_logs, reverse=True) + sorted(found.logs, reverse=True)))
    for name in candidates:
        read = _open_tail(name, TAIL_BYTES, fd)
        if read is not None:
            return name, *read
    return None


def summary_and_tail(runner_dir: Path, lines: int = TAIL_LINES) -> dict[str, Any]:
    fd = _open_diag(runner_dir)
    found = DiagScan()
    chosen = None
    if fd is not None:
        try:
            found = _scan(fd, SCAN_LIMIT)
            chosen = _newest_tail(fd, found)
        finally:
            os.close(fd)
    out: dict[str, Any] = {"files": found.files, "total_bytes": found.total_bytes,
                           "entries_examined": found.examined, "more_entries": found.more,
                           "latest": None, "errors": 0, "warnings": 0, "last_error": None,
                           "tail": []}
    if chosen is None:
        return out
    name, text, info = chosen
    text = redact(text)
    # The log holds job and step names from workflow files (a pull request's author writes
    # them): an escape sequence in one would erase and redraw lines where the tail is shown.
    all_lines = [printable(line) for line in text.splitlines()]
    errors = [line for line in all_lines if " ERR " in line or "[ERR" in line]
    out.update({"latest": {"name": name, "bytes": info.st_size,
                           "modified_at": iso(info.st_mtime)},
                "errors": len(errors),
                "warnings": sum(1 for line in all_lines if " WARN " in line),
                "last_error": errors[-1] if errors else None,
                "tail": all_lines[-lines:]})
    return out

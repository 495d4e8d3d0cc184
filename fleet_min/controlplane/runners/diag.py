"""The runner's own diagnostic logs (`_diag`): a summary and a redacted tail.

Only regular files are read (a symlink planted in `_diag` could point at `.credentials` or
anywhere on the host), and only their last TAIL_BYTES, so a log of gigabytes costs nothing.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from fleet_min.controlplane.runners.redact import redact
from fleet_min.logs import printable
from fleet_min.timeutil import iso

TAIL_BYTES = 64 * 1024
TAIL_LINES = 80


def safe_file(path: Path, inside: Path) -> os.stat_result | None:
    """lstat of `path` when it is a regular file (not a link) inside `inside`, else None."""
    try:
        info = path.lstat()
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or path.name.startswith(".credentials"):
        return None
    if not path.resolve().is_relative_to(inside.resolve()):
        return None
    return info


def read_tail(path: Path, limit: int = TAIL_BYTES) -> str:
    """The last `limit` bytes of a log as text; "" when it is gone or no longer a regular file.
    The runner rotates its logs, and an entry checked a moment ago may since have been swapped
    for a FIFO or a link: this open neither waits for a writer nor follows a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return ""
    with open(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - limit))
        data = handle.read(limit)
    text = data.decode("utf-8", "replace")
    if size > limit:
        # Drop the cut first line, all of it when no line break follows: the cut may have
        # taken its key (`db_pas|sword=...`) or a token's prefix, and the redactor cannot
        # know what is left for a secret.
        text = text.partition("\n")[2]
    return text


def diag_logs(runner_dir: Path) -> list[tuple[Path, os.stat_result]]:
    folder = runner_dir / "_diag"
    if folder.is_symlink() or not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        info = safe_file(entry, runner_dir)
        if info is not None and entry.suffix == ".log":
            found.append((entry, info))
    return sorted(found, key=lambda item: item[1].st_mtime)


def summary_and_tail(runner_dir: Path, lines: int = TAIL_LINES) -> dict[str, Any]:
    logs = diag_logs(runner_dir)
    runner_logs = [item for item in logs if item[0].name.startswith("Runner_")]
    candidates = runner_logs or logs
    out: dict[str, Any] = {"files": len(logs),
                           "total_bytes": sum(info.st_size for _, info in logs),
                           "latest": None, "errors": 0, "warnings": 0, "last_error": None,
                           "tail": []}
    if not candidates:
        return out
    path, info = candidates[-1]
    text = redact(read_tail(path))
    # The log holds job and step names from workflow files (a pull request's author writes
    # them): an escape sequence in one would erase and redraw lines where the tail is shown.
    all_lines = [printable(line) for line in text.splitlines()]
    errors = [line for line in all_lines if " ERR " in line or "[ERR" in line]
    out.update({"latest": {"name": path.name, "bytes": info.st_size,
                           "modified_at": iso(info.st_mtime)},
                "errors": len(errors),
                "warnings": sum(1 for line in all_lines if " WARN " in line),
                "last_error": errors[-1] if errors else None,
                "tail": all_lines[-lines:]})
    return out

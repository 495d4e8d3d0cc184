"""Logging: one line per event, to stderr (journald) or to a file that log rotation can move.

With no log file, every record goes to stderr as one line; under systemd that is the journal,
which rotates by itself. With a log file (FLEET_LOG_FILE), records are appended to it through a
WatchedFileHandler, which notices on the next record that logrotate moved or deleted the file and
opens a new one; SIGHUP makes the reopen happen at once (logrotate's `postrotate` can send it, and
it also suits `copytruncate`, newsyslog and anything else that expects a daemon to reopen its log
on HUP). SIGHUP never stops the service.

A multi-line message (a traceback) is folded onto its line with " | " between the parts, so one
event is always one line and a grep or a line-based shipper sees it whole.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import signal
import sys
import threading
import time
from typing import Any

LOG_FILE_ENV = "FLEET_LOG_FILE"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%Y-%m-%dT%H:%M:%S"
WARN_EVERY_S = 60.0


class OneLineFormatter(logging.Formatter):
    """The usual format, with newlines in the message or the traceback folded into ' | ', and
    every other character that does not print (ESC, BEL, a direction override) written as its
    escape: a record quotes what clients sent (a malformed request line, a path), and an escape
    sequence reaching a terminal could erase the line and draw a forged one in its place."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(" | ".join(part for part in super().format(record).splitlines()
                                    if part.strip()))


def printable(line: str) -> str:
    """One line with every character that does not print (ESC, BEL, a direction override)
    written as its escape, for text someone else wrote that reaches a terminal or a page."""
    return line if line.isprintable() else "".join(map(_printable, line))


def _printable(char: str) -> str:
    if char.isprintable():
        return char
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 \
        else f"\\U{code:08x}"


class Every:
    """Counts an event and says whether it is due to be told: at most once per WARN_EVERY_S,
    so a flood of the same event is one line a minute, not one line an event."""

    def __init__(self) -> None:
        self.count, self._next = 0, 0.0

    def due(self) -> bool:
        self.count += 1
        at = time.monotonic()
        if at < self._next:
            return False
        self._next = at + WARN_EVERY_S
        return True


class Throttled:
    """A warning said at most once per WARN_EVERY_S, with how often it happened meanwhile."""

    def __init__(self, log: logging.Logger, message: str) -> None:
        self.log, self.message = log, message
        self._every = Every()

    @property
    def count(self) -> int:
        return self._every.count

    def __call__(self, *args: Any) -> None:
        if self._every.due():
            self.log.warning(self.message + " (%d times so far)", *args, self.count)


class MalformedRequests(logging.Filter):
    """aiohttp's server logs a request it could not parse (a tab in the request line, a line
    over its length limit, a bad chunk size) as an ERROR with a traceback, after answering it
    400. That is the client's fault, and a port scanner on the LAN would fill the log with
    tracebacks that look like ours: such a record becomes one INFO line naming the peer and
    what was wrong (its first 300 characters: aiohttp quotes the request line). Any other
    record of that logger passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and _is_parse_error(exc):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg, record.args = "refused a malformed request from %s (400): %s", (
                peer, str(getattr(exc, "message", None) or type(exc).__name__)[:300])
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def _is_parse_error(exc: BaseException) -> bool:
    from aiohttp.http_exceptions import HttpProcessingError  # a service's record: loaded
    return isinstance(exc, HttpProcessingError)


def _handler(log_file: str) -> logging.Handler:
    if not log_file:
        return logging.StreamHandler(sys.stderr)
    path = os.path.abspath(os.path.expanduser(log_file))
    folder = os.path.dirname(path)
    # Only the file's own folder is made: a mistyped path must not grow a tree of folders
    # (anywhere at all, when the service runs as root).
    if not os.path.isdir(folder):
        with contextlib.suppress(FileExistsError):  # a file there: the open below says so
            os.mkdir(folder)
    return LogFile(path, encoding="utf-8")


class LogFile(logging.handlers.WatchedFileHandler):
    """The log file, made 0640 and never opened through a link, at the start and at every
    reopen after a rotation: a link planted where the log goes would make the service append
    what clients send to a file of the link's choosing (as root, any file).

    The standard handler closes the old file before it opens the new one, outside its own
    error handling: once the new file cannot be opened (a planted link, a full disk, a folder
    made read-only) every later log call raises into the code that logged, a request handler or
    the signal handler itself. Here the new file is opened first and the old one is kept,
    and written to, until a reopen succeeds; the failure is said once a minute on stderr and in
    the old file, and a reopen is tried again at most once a second.
    """

    RETRY_S = 1.0

    def __init__(self, filename: str, encoding: str) -> None:
        self._retry_at = 0.0
        self._failures = Every()
        super().__init__(filename, encoding=encoding)

    def _open(self) -> Any:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        return open(os.open(self.baseFilename, flags, 0o640), "a",
                    encoding=self.encoding, errors=self.errors)

    def reopenIfNeeded(self) -> None:
        # lstat: a link now standing where the log goes is a different file, not its target
        try:
            now = os.lstat(self.baseFilename)
        except OSError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != (self.dev, self.ino):
            self.swap(force=False)

    def swap(self, force: bool) -> bool:
        """Open the log file again and write to it from now on; keep the old one when that
        fails (False). `force` (SIGHUP) tries at once, a record only once a second after a
        failure."""
        if not force and time.monotonic() < self._retry_at:
            return False
        try:
            fresh = self._open()
        except OSError as exc:
            self._retry_at = time.monotonic() + self.RETRY_S
            self._say_cannot_reopen(exc)
            return False
        old, self.stream = self.stream, fresh
        self._statstream()
        if old is not None:
            with contextlib.suppress(OSError, ValueError):
                old.close()
        return True

    def _say_cannot_reopen(self, exc: OSError) -> None:
        # Said here, not through a logger: this runs inside a handler's own emit.
        if not self._failures.due():
            return
        line = (f"cannot reopen the log file {self.baseFilename}: {exc.strerror or exc}; "
                f"still writing to the file it was ({self._failures.count} times so far)")
        record = logging.LogRecord(__name__, logging.ERROR, __file__, 0, line, None, None)
        text = self.format(record)
        with contextlib.suppress(OSError, ValueError):
            print(text, file=sys.stderr, flush=True)
        if self.stream is not None:
            with contextlib.suppress(OSError, ValueError):
                self.stream.write(text + self.terminator)


def _refuse(path: str, exc: OSError) -> SystemExit:
    """Exit 2 with one line: a log file that cannot be written is a setting to fix, and the
    service must not start and log nowhere."""
    why = exc.strerror or str(exc)
    if exc.filename and os.path.abspath(str(exc.filename)) != os.path.abspath(
            os.path.expanduser(path)):
        why += f" ({exc.filename})"
    print(f"fleet-min: cannot write the log file {path} ({LOG_FILE_ENV}): "
          f"{why[:1].lower() + why[1:]}", file=sys.stderr)
    return SystemExit(2)


def reopen() -> bool:
    """Reopen every log file now (what SIGHUP does): after a rotation, write to the new file.
    Never raises: a file that cannot be opened is said, and the old one is kept (False)."""
    reopened = True
    for handler in logging.getLogger().handlers:
        if isinstance(handler, LogFile):
            handler.acquire()
            try:
                reopened = handler.swap(force=True) and reopened
            finally:
                handler.release()
    return reopened


def _on_sighup(_signum: int, _frame: object) -> None:
    log = logging.getLogger(__name__)
    if reopen():
        log.info("SIGHUP: log file reopened")
    else:  # why was said once a minute, by the file's handler; this says the signal came
        log.warning("SIGHUP: could not reopen the log file; still writing to the one before")


def install_sighup() -> bool:
    """Make SIGHUP reopen the log file instead of ending the process (main thread only)."""
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGHUP, _on_sighup)
    return True


def setup(level: str, log_file: str | None = None) -> None:
    """Log records of `level` and above, one line each, to stderr or to `log_file`.

    log_file None means the FLEET_LOG_FILE environment variable (empty: stderr). A file that
    cannot be opened (its folder's parent missing, no permission, a directory in its place)
    ends the process with one line on stderr and exit code 2.
    """
    path = os.environ.get(LOG_FILE_ENV, "") if log_file is None else log_file
    try:
        handler = _handler(path)
    except OSError as exc:
        raise _refuse(path, exc) from None
    handler.setFormatter(OneLineFormatter(FORMAT, DATEFMT))
    root = logging.getLogger()
    for old in root.handlers:
        old.close()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequests) for f in server.filters):
        server.addFilter(MalformedRequests())
    install_sighup()

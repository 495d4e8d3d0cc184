"""The content-addressed artifact store: bytes on disk named by their SHA-256, a row per artifact.

Layout under `<data_dir>/artifacts/`: `<first two hex digits>/<sha256>` for stored bytes and
`tmp/<random>.part` for uploads in flight (same filesystem, so the final rename is atomic).

An upload streams into a temporary file while it is hashed, a batch of about 1 MiB at a time: the
batch is hashed on one worker thread and written on another while the event loop receives the
next, so memory does not grow with the artifact and the event loop never waits on the disk. The
file and its directory are fsynced (once, at the end) before the row is committed and the upload
acknowledged: an acknowledged artifact survives `kill -9` and a power cut. An upload whose hash
is already stored keeps the stored copy and drops the new one.

"Referenced" (what blocks a delete and keeps an artifact off the collection list) means needed by
work that can still run: named in the spec or a result row of a live job (queued, waiting,
claimed), in a result row of a job that a waiting job depends on (its `${jobs.<id>.artifact}`
is about to be read), in a schedule's template, or the newest build of an app that a schedule
asks for with `sha256: "latest"`. A closed job's spec keeps the hash as history; it does not hold
the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import sqlite3
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from fleet_min import filemodes, validate
from fleet_min.collector.jobs import queue
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.jobs.kinds import OPEN
from fleet_min.config import CollectorConfig
from fleet_min.db import Database, like_escape
from fleet_min.errors import BadRequest, Conflict, NotFound, Refused, TooLarge, Unavailable
from fleet_min.timeutil import iso

log = logging.getLogger(__name__)

LIMIT_ENV = "FLEET_MAX_ARTIFACT_BYTES"
BATCH_BYTES = 1 << 20  # of an upload, hashed and written by the worker threads at a time
READ_BYTES = 256 << 10  # read from disk at a time when sendfile is not available (uvloop):
# a client that stops reading holds one such piece until its connection is cut
PER_PAGE = 50
MAX_HEADER_CHARS = 200
MAX_REASON_CHARS = 500
LIVE_STATUSES = tuple(sorted(OPEN))  # the jobs whose references hold an artifact
PUBLISH_HEADERS = {"name": "x-artifact-name", "app": "x-artifact-app",
                   "build": "x-artifact-build", "platform": "x-artifact-platform"}

_HEX64 = re.compile(r"[0-9a-f]{64}")
# A hash in free text is a run of exactly 64 hex digits. Runs of 64 or more, then their length:
# two to five times faster than a look-behind and a look-ahead tried at every character.
_HEX_RUNS = re.compile(r"[0-9a-f]{64,}")
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)", re.ASCII | re.IGNORECASE)  # a unit's case: any
_LOCK_STRIPES = 64

Transact = Callable[..., Awaitable[Any]]


class StoreFull(Refused):
    status = 507


class RangeNotSatisfiable(Exception):
    """The Range header asks for bytes the artifact does not have (answered 416)."""


def max_artifact_bytes(config: CollectorConfig) -> int:
    """The upload size limit (FLEET_MAX_ARTIFACT_BYTES, default 4 GiB)."""
    return config.max_artifact_bytes


# -- pure checks ----------------------------------------------------------------------------------


def is_sha256(value: object) -> bool:
    """Is it an artifact's name: a string of 64 lowercase hex digits?"""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def check_sha256(text: str) -> str:
    """A hash taken from a URL: 64 lowercase hex digits, or 400. Only then is it used in a path."""
    if not _HEX64.fullmatch(text):
        raise BadRequest("an artifact is named by its SHA-256: 64 lowercase hex digits")
    return text


def publish_fields(headers: Mapping[str, str]) -> dict[str, str]:
    """The publish stamp from the upload headers (only those given, trimmed), or 400."""
    fields: dict[str, str] = {}
    for key, header in PUBLISH_HEADERS.items():
        value = (headers.get(header) or "").strip()
        if not value:
            continue
        if len(value) > MAX_HEADER_CHARS:
            raise BadRequest(f"{header} is longer than {MAX_HEADER_CHARS} characters")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"{header} is not valid UTF-8 text") from None
        if not validate.is_label(value):
            raise BadRequest(f"{header} must hold {validate.LABEL_WORDS}: the name a page "
                             "shows must be the name a download saves")
        fields[key] = value
    return fields


def wants_unpin(body: Mapping[str, Any]) -> bool:
    """The original's clients pin and unpin through one route: `{"pinned": false}` unpins,
    `{"pinned": true, "reason": ...}` pins like ours."""
    pinned = body.get("pinned", True)
    if not isinstance(pinned, bool):
        raise BadRequest('pinned must be true or false: {"pinned": false} unpins')
    return not pinned


def check_reason(body: Mapping[str, Any]) -> str:
    reason = body.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise BadRequest('a pin needs a reason: send {"reason": "<why this artifact is kept>"}')
    if len(reason) > MAX_REASON_CHARS:
        raise BadRequest(f"the pin reason is longer than {MAX_REASON_CHARS} characters")
    return reason.strip()


def check_accepted(body: Mapping[str, Any]) -> bool:
    accepted = body.get("accepted")
    if not isinstance(accepted, bool):
        raise BadRequest('send {"accepted": true} to accept a visual baseline or false to drop it')
    return accepted


_FILENAME_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
MAX_FILENAME_CHARS = 120


def download_name(raw: str | None) -> str | None:
    """The `?filename=` of a download made safe for a Content-Disposition header, or None for
    no header: only letters, digits, dot, dash and underscore survive (no quote, CR, LF,
    separator or space can reach the header or the saving browser's path), leading dots go (no
    hidden or parent names), and the rest is cut at MAX_FILENAME_CHARS."""
    if not raw:
        return None
    name = _FILENAME_UNSAFE.sub("", raw[:4 * MAX_FILENAME_CHARS]).lstrip(".")
    return name[:MAX_FILENAME_CHARS] or None


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The inclusive (first, last) byte range a Range header asks for, or None for the whole.

    Following RFC 9110, a header we do not understand (another unit, several ranges, bad syntax)
    is ignored and the whole artifact is sent; a well-formed range outside the artifact raises
    RangeNotSatisfiable.
    """
    if not header:
        return None
    match = _RANGE.fullmatch(header.strip().replace(" ", ""))
    if not match or match.group(1) == match.group(2) == "":
        return None
    first_text, last_text = match.group(1), match.group(2)
    if not first_text:  # suffix: the last N bytes
        wanted = _number(last_text)
        if wanted == 0 or size == 0:
            raise RangeNotSatisfiable
        return max(0, size - wanted), size - 1
    first = _number(first_text)
    last = _number(last_text) if last_text else size - 1
    if last_text and last < first:
        return None
    if first >= size:
        raise RangeNotSatisfiable
    return first, min(last, size - 1)


def _number(digits: str) -> int:
    """A byte position from a Range header; anything past 20 digits is past any file (and is
    never handed to int(), whose cost grows with the length)."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 20 else 10**20


def record(row: sqlite3.Row) -> dict[str, Any]:
    sha = row["sha256"]
    return {"sha256": sha, "size": row["size"], "created_at": iso(row["created_at"]),
            "name": row["name"], "app": row["app"], "build": row["build"],
            "platform": row["platform"], "pinned": row["pinned_reason"] is not None,
            "pinned_reason": row["pinned_reason"], "baseline": bool(row["baseline"]),
            "url": f"/artifacts/{sha}"}


def _flag(query: Mapping[str, str], name: str) -> bool | None:
    raw = (query.get(name) or "").strip().lower()
    if not raw:
        return None
    if raw in ("1", "true", "yes"):
        return True
    if raw in ("0", "false", "no"):
        return False
    raise BadRequest(f"{name} must be true or false")


def _page(query: Mapping[str, str]) -> int:
    raw = query.get("page") or "1"
    if not raw.isascii() or not raw.isdigit() or len(raw) > 7 or not 1 <= int(raw) <= 1_000_000:
        raise BadRequest("page must be a whole number from 1")
    return int(raw)


def _paged(items: list[dict[str, Any]], total: int, page: int, **extra: Any) -> dict[str, Any]:
    return {"page": page, "per_page": PER_PAGE, "total": total,
            "pages": max(1, -(-total // PER_PAGE)), **extra, "artifacts": items}


# -- bytes on disk ----------------------------------------------------------------------------


@dataclass
class _TempFile:
    """An upload being written: its temporary path, open descriptor, running hash and size.

    `hash`, `write` and `close` run on worker threads; the lock makes an abandon (client gone,
    limit passed, shutdown) wait for a write still in flight instead of closing the descriptor
    under it. The hash needs no lock: it never touches the descriptor.
    """

    path: Path
    fd: int
    hasher: Any = field(default_factory=hashlib.sha256)
    size: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def hash(self, parts: list[bytes]) -> None:
        for part in parts:
            self.hasher.update(part)  # hashlib lets go of the GIL for buffers this large

    def write(self, parts: list[bytes]) -> None:
        with self.lock:
            if self.fd < 0:
                return
            for part in parts:
                view = memoryview(part)
                while view:
                    view = view[_write(self.fd, view):]

    def seal(self) -> str:
        """Flush to the disk and close; the hex digest of everything written."""
        with self.lock:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            return str(self.hasher.hexdigest())

    def abandon(self) -> None:
        with self.lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class _Lanes:
    """The hash and the write of one batch, each on its own worker thread, while the event loop
    receives the next batch: three stages side by side, not hash-then-write. One batch at a time
    in each lane keeps the hash's order and the file's, and bounds memory to two batches."""

    def __init__(self, temp: _TempFile) -> None:
        self.temp = temp
        self.running: list[asyncio.Future[None]] = []

    async def start(self, batch: list[bytes]) -> None:
        await self.finish()
        if batch:
            self.running = [asyncio.ensure_future(asyncio.to_thread(self.temp.hash, batch)),
                            asyncio.ensure_future(asyncio.to_thread(self.temp.write, batch))]
            for future in self.running:
                future.add_done_callback(_retrieve)

    async def finish(self) -> None:
        running, self.running = self.running, []
        for future in running:
            await future

    def cancel(self) -> None:
        for future in self.running:
            future.cancel()  # the threads finish their batch; abandon waits on the lock


def _write(fd: int, view: memoryview) -> int:
    try:
        return os.write(fd, view)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFull("the disk holding the artifact store is full; delete artifacts "
                            "(see GET /api/artifacts/gc-candidates) and retry") from None
        raise


def _retrieve(future: asyncio.Future[None]) -> None:
    """Mark a write's failure as seen: after an abandon nobody awaits it any more."""
    if not future.cancelled():
        future.exception()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Opened:
    """An artifact opened for reading: the caller owns `file` and ends with close()."""

    sha256: str
    file: BinaryIO
    size: int

    async def close(self) -> None:
        await asyncio.to_thread(self.file.close)


# Artifact files open at once, downloads and uploads together: each holds a descriptor beside
# its connection's, and only serving.FD_RESERVE (128) are kept out of the connection cap for
# them, the database and the rest. 200 downloads that never read took the descriptors the
# database and every other request needed. Past it a download or an upload is answered 503.
FILES_AT_ONCE = 64


class ArtifactStore:
    """The artifact directory and the `artifacts` table, kept in step.

    Renames and deletes of one hash are serialised by a lock stripe, so an upload finishing and
    a delete of the same hash cannot interleave (the row and the file always agree).
    """

    def __init__(self, root: Path, max_bytes: int, db: Database, transact: Transact) -> None:
        self.root = root
        self.tmp = root / "tmp"
        self.max_bytes = max_bytes
        self.db = db
        self.transact = transact
        self._locks = [asyncio.Lock() for _ in range(_LOCK_STRIPES)]
        # Files being sent, counted while open: one a response never sent (its client gone
        # first) leaves the count when it is freed, not by a close that never came.
        self._reading: weakref.WeakSet[BinaryIO] = weakref.WeakSet()
        self._writing = 0
        self._opening = 0  # opens under way on a worker thread: their places are taken

    @property
    def files_open(self) -> int:
        return (self._writing + self._opening
                + sum(1 for file in self._reading if not file.closed))

    def _room_for_a_file(self) -> None:
        if self.files_open >= FILES_AT_ONCE:
            raise Unavailable(f"{FILES_AT_ONCE} artifact downloads and uploads are under way, "
                              "the most this collector serves at once; retry in a moment")

    def path(self, sha256: str) -> Path:
        check_sha256(sha256)  # never a path from anything but 64 hex digits
        return self.root / sha256[:2] / sha256

    def _lock(self, sha256: str) -> asyncio.Lock:
        return self._locks[int(sha256[:2], 16) % _LOCK_STRIPES]

    # -- start-up ---------------------------------------------------------------------------

    async def scan(self) -> list[tuple[str, int, float]]:
        """At start-up: create the layout, drop uploads a crash left half-written, and list the
        stored files (hash, size, mtime) so rows missing for any of them can be adopted."""
        return await asyncio.to_thread(self._prepare)

    async def adopt(self, found: list[tuple[str, int, float]], now: float) -> int:
        """Give a row to stored files without one (a crash between the rename and the commit:
        never acknowledged, but whole and named by its hash). They show as gc candidates."""
        adopted: int = await self.transact(_adopt, found, now)
        if adopted:
            log.info("adopted %d stored artifacts that had no row", adopted)
        return adopted

    def _prepare(self) -> list[tuple[str, int, float]]:
        """Also takes 'other' bits away from the store's directories and files (see
        fleet_min.filemodes), from the stat this scan makes anyway."""
        filemodes.private_dir(self.root, filemodes.COLLECTOR_DIR)
        # The store's root may be a link the operator made; nothing inside it may be, or a
        # chmod, an adopted row and later downloads would reach wherever it points.
        filemodes.refuse_link(self.tmp)
        filemodes.private_dir(self.tmp, filemodes.COLLECTOR_DIR)
        for leftover in self.tmp.iterdir():
            with contextlib.suppress(OSError):
                leftover.unlink()
        found = []
        with os.scandir(self.root) as shards:
            for shard in shards:
                if len(shard.name) != 2:
                    continue
                shard_path = Path(shard.path)
                filemodes.refuse_link(shard_path)
                if not shard.is_dir(follow_symlinks=False):
                    continue
                filemodes.tighten(shard_path, filemodes.COLLECTOR_DIR)
                found.extend(self._stored(shard_path))
        return found

    @staticmethod
    def _stored(shard: Path) -> list[tuple[str, int, float]]:
        found = []
        with os.scandir(shard) as entries:
            for entry in entries:
                if _HEX64.fullmatch(entry.name) and entry.name[:2] == shard.name:
                    path = Path(entry.path)
                    filemodes.refuse_link(path)
                    stat = entry.stat(follow_symlinks=False)
                    filemodes.tighten(path, filemodes.COLLECTOR_FILE, stat.st_mode)
                    found.append((entry.name, stat.st_size, stat.st_mtime))
        return found

    # -- upload -----------------------------------------------------------------------------

    async def upload(self, chunks: AsyncIterator[bytes], publish: dict[str, str],
                     expected: str | None, now: float) -> dict[str, Any]:
        """Store a streamed body; the reply to POST /artifacts (`sha256` first, as agents read)."""
        self._room_for_a_file()
        self._writing += 1
        try:
            return await self._upload(chunks, publish, expected, now)
        finally:
            self._writing -= 1

    async def _upload(self, chunks: AsyncIterator[bytes], publish: dict[str, str],
                      expected: str | None, now: float) -> dict[str, Any]:
        temp = await self._receive(chunks)
        try:
            sha256 = await asyncio.to_thread(temp.seal)
            if expected is not None and sha256 != expected:
                raise BadRequest(f"the body hashes to {sha256}, not to the x-artifact-sha256 "
                                 f"header's {expected}; nothing was stored")
            async with self._lock(sha256):
                existed = await asyncio.to_thread(self._install, temp.path, sha256)
                stored = await self.transact(record_upload, sha256, temp.size, publish, now)
            return {"sha256": sha256, "size": temp.size, "existed": existed, "artifact": stored}
        finally:
            await asyncio.shield(asyncio.to_thread(temp.abandon))  # gone already once installed

    async def _receive(self, chunks: AsyncIterator[bytes]) -> _TempFile:
        temp = await asyncio.to_thread(self._open_temp)
        lanes = _Lanes(temp)
        try:
            batch: list[bytes] = []
            batched = 0
            async for chunk in chunks:
                temp.size += len(chunk)
                if temp.size > self.max_bytes:
                    raise TooLarge(f"the artifact is larger than the {self.max_bytes}-byte limit "
                                   f"({LIMIT_ENV})")
                batch.append(chunk)
                batched += len(chunk)
                if batched >= BATCH_BYTES:
                    await lanes.start(batch)  # hashed and written while the next one arrives
                    batch, batched = [], 0
            await lanes.start(batch)
            await lanes.finish()
            return temp
        except BaseException:
            lanes.cancel()
            await asyncio.shield(asyncio.to_thread(temp.abandon))
            raise

    def _open_temp(self) -> _TempFile:
        path = self.tmp / f"{secrets.token_hex(12)}.part"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags, filemodes.COLLECTOR_FILE)
        except FileNotFoundError:  # the store was removed under us: make it again
            self.tmp.mkdir(mode=filemodes.COLLECTOR_DIR, parents=True, exist_ok=True)
            fd = os.open(path, flags, filemodes.COLLECTOR_FILE)
        return _TempFile(path, fd)

    def _install(self, temp_path: Path, sha256: str) -> bool:
        """Move the sealed file to its hash; True when the hash was already stored."""
        final = self.path(sha256)
        if not final.parent.is_dir():
            final.parent.mkdir(mode=filemodes.COLLECTOR_DIR, exist_ok=True)
            _fsync_dir(self.root)
        if final.exists():
            return True  # keep the stored copy; the temporary file is dropped by the caller
        os.replace(temp_path, final)
        _fsync_dir(final.parent)
        return False

    # -- read and delete ----------------------------------------------------------------------

    async def open(self, sha256: str) -> Opened:
        path = self.path(sha256)

        def opener() -> Opened:
            handle = open(path, "rb")  # noqa: SIM115 - the response closes it when sent
            return Opened(sha256, handle, os.fstat(handle.fileno()).st_size)

        self._room_for_a_file()
        self._opening += 1
        try:
            opened = await asyncio.to_thread(opener)
            self._reading.add(opened.file)
        except FileNotFoundError:
            raise NotFound(f"no artifact {sha256} is stored here") from None
        finally:
            self._opening -= 1
        return opened

    async def delete(self, sha256: str) -> dict[str, Any]:
        check_sha256(sha256)
        async with self._lock(sha256):
            gone = await self.transact(delete_row, sha256)
            await asyncio.to_thread(self._unlink, sha256)
        return {"ok": True, "sha256": sha256, "deleted": True, "size": gone["size"]}

    def _unlink(self, sha256: str) -> None:
        path = self.path(sha256)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            _fsync_dir(path.parent)

    async def detail(self, sha256: str) -> dict[str, Any]:
        """One artifact with what holds it and the jobs, results and schedules naming it."""
        check_sha256(sha256)
        # Every read here may scan the text of every job and result row (what names a hash is
        # only in its text): on a connection and a worker thread of its own, a bounded number
        # at once, never on the shared reader that every other read waits for.
        async with artifact_scans(self.db):
            found = await self.db.read_in_thread(_detail, sha256, named=True)
        return {**found, "stored": await asyncio.to_thread(self.path(sha256).is_file)}

    async def listing(self, query: Mapping[str, str]) -> dict[str, Any]:
        """GET /api/artifacts: a page of rows, each with `on_disk` (the bytes are in the
        store's directory now) and `references` (see reference_counts)."""
        page = await list_artifacts(self.db, query)
        items = page["artifacts"]
        shas = [item["sha256"] for item in items]
        present = await asyncio.to_thread(lambda: {sha: self.path(sha).is_file() for sha in shas})
        counts = await reference_counts(self.db, shas)
        for item in items:
            item["on_disk"] = present[item["sha256"]]
            item["references"] = counts.get(item["sha256"], 0)
        return page

    async def gc_candidates(self, query: Mapping[str, str]) -> dict[str, Any]:
        page = _page(query)
        async with artifact_scans(self.db):
            candidates = await self.db.read_in_thread(gc_candidates, named=True)
        start = (page - 1) * PER_PAGE
        shown = candidates[start:start + PER_PAGE]
        # The original's list, `candidates` with its `count`, is more cautious than ours: it
        # never offers what any job ever named, closed jobs included. Ours (`artifacts`) lets
        # a closed job's inputs go; its clients keep theirs.
        named = await reference_counts(self.db, [c["sha256"] for c in shown])
        never_named = [c for c in shown if not named.get(c["sha256"])]
        return _paged(shown, len(candidates), page, bytes=sum(c["size"] for c in candidates),
                      candidates=never_named, count=len(never_named))

    async def stored_bytes(self) -> int:
        row = await self.db.read_one("SELECT COALESCE(SUM(size), 0) FROM artifacts")
        return int(row[0]) if row else 0


# -- rows (transaction functions: run inside the writer's open transaction, see fleet_min.db) ---


def _row(conn: sqlite3.Connection, sha256: str) -> sqlite3.Row:
    row = conn.execute("SELECT * FROM artifacts WHERE sha256 = ?", (sha256,)).fetchone()
    if row is None:
        raise NotFound(f"no artifact {sha256}")
    return row


def _publish_time(conn: sqlite3.Connection, app: str | None, now: float) -> float:
    """`now`, but later than every earlier build of the app: `latest` follows publish order
    even when the clock steps back (a Pi without a real-time clock before NTP)."""
    if app is None:
        return now
    row = conn.execute("SELECT MAX(created_at) FROM artifacts WHERE app = ?", (app,)).fetchone()
    newest = row[0] if row and row[0] is not None else None
    return now if newest is None or now > newest else newest + 1e-3


def record_upload(conn: sqlite3.Connection, sha256: str, size: int, publish: dict[str, str],
                  now: float, effects: Effects) -> dict[str, Any]:
    """Insert the row for a stored upload; a re-upload with publish headers re-publishes it,
    unless it is pinned: the operator approved that name, app and build at that time (a pin is
    what enrolment offers with a dashboard token), and uploads are open to anyone, who could
    re-stamp an approved old build as the newest, or as another app's."""
    existing = conn.execute("SELECT * FROM artifacts WHERE sha256 = ?", (sha256,)).fetchone()
    if existing is not None and existing["pinned_reason"] is not None:
        publish = {}
    app = publish.get("app") or (existing["app"] if existing else None)
    stamp = _publish_time(conn, app, now) if publish else now
    if existing is None:
        conn.execute("INSERT INTO artifacts (sha256, size, created_at, name, app, build, platform)"
                     " VALUES (?, ?, ?, ?, ?, ?, ?)",
                     (sha256, size, stamp, publish.get("name"), publish.get("app"),
                      publish.get("build"), publish.get("platform")))
    elif publish:
        conn.execute("UPDATE artifacts SET created_at = ?, name = COALESCE(?, name), "
                     "app = COALESCE(?, app), build = COALESCE(?, build), "
                     "platform = COALESCE(?, platform) WHERE sha256 = ?",
                     (stamp, publish.get("name"), publish.get("app"), publish.get("build"),
                      publish.get("platform"), sha256))
    row = _row(conn, sha256)
    effects.emit("artifact", action="uploaded", sha256=sha256, size=size,
                 existed=existing is not None, published=bool(publish), name=row["name"],
                 app=row["app"], build=row["build"])
    return record(row)


def _adopt(conn: sqlite3.Connection, found: list[tuple[str, int, float]], now: float,
           effects: Effects) -> int:
    adopted = 0
    for sha256, size, mtime in found:
        cursor = conn.execute("INSERT OR IGNORE INTO artifacts (sha256, size, created_at) "
                              "VALUES (?, ?, ?)", (sha256, size, min(mtime, now)))
        adopted += cursor.rowcount
    return adopted


def delete_row(conn: sqlite3.Connection, sha256: str, effects: Effects) -> dict[str, Any]:
    row = _row(conn, sha256)
    holds = holds_on(conn, row)
    if holds:
        more = f" (and {len(holds) - 1} more)" if len(holds) > 1 else ""
        raise Conflict(f"artifact {sha256[:12]} cannot be deleted: {holds[0]}{more}")
    conn.execute("DELETE FROM artifacts WHERE sha256 = ?", (sha256,))
    effects.emit("artifact", action="deleted", sha256=sha256, size=row["size"])
    return record(row)


def pin(conn: sqlite3.Connection, sha256: str, reason: str, effects: Effects) -> dict[str, Any]:
    _row(conn, sha256)
    conn.execute("UPDATE artifacts SET pinned_reason = ? WHERE sha256 = ?", (reason, sha256))
    effects.emit("artifact", action="pinned", sha256=sha256, reason=reason)
    return record(_row(conn, sha256))


def unpin(conn: sqlite3.Connection, sha256: str, effects: Effects) -> dict[str, Any]:
    _row(conn, sha256)
    conn.execute("UPDATE artifacts SET pinned_reason = NULL WHERE sha256 = ?", (sha256,))
    effects.emit("artifact", action="unpinned", sha256=sha256)
    return record(_row(conn, sha256))


def set_baseline(conn: sqlite3.Connection, sha256: str, accepted: bool,
                 effects: Effects) -> dict[str, Any]:
    _row(conn, sha256)
    slots = conn.execute("SELECT suite, page, profile FROM visual_baselines WHERE sha256 = ? "
                         "LIMIT 1", (sha256,)).fetchone()
    if not accepted and slots is not None:
        raise Conflict(f"artifact {sha256[:12]} is the visual baseline of {slots[0]}/{slots[1]} "
                       f"({slots[2]}); accept another capture for that slot first")
    conn.execute("UPDATE artifacts SET baseline = ? WHERE sha256 = ?", (int(accepted), sha256))
    effects.emit("artifact", action="baseline", sha256=sha256, accepted=accepted)
    return record(_row(conn, sha256))


# -- references -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    """Something that needs an artifact's bytes: what it is, its id, and the text naming hashes."""

    kind: str  # job, result, waiting, schedule
    ident: str
    text: str


def _holders(conn: sqlite3.Connection, naming: str | None = None) -> Iterator[Holder]:
    """Everything that needs some artifact's bytes. With `naming` (a hash), only the rows whose
    text may name that hash: SQLite's instr picks them out at C speed, so a delete's check costs
    a scan of the text, not a Python regex over every live spec; `_hashes` still decides."""
    live = ",".join("?" * len(LIVE_STATUSES))

    def names(column: str) -> tuple[str, tuple[str, ...]]:
        # lower(): a spec may spell a hash in capitals, and _hashes reads it in any case.
        return ("", ()) if naming is None else (f" AND instr(lower({column}), ?) > 0", (naming,))

    where, args = names("spec")
    for row in conn.execute(f"SELECT job_id, spec FROM jobs WHERE status IN ({live}){where}",
                            (*LIVE_STATUSES, *args)):
        yield Holder("job", row["job_id"], row["spec"])
    where, args = names("r.artifacts")
    for row in conn.execute(
            f"SELECT r.job_id, r.artifacts FROM results r JOIN jobs j ON j.job_id = r.job_id "
            f"WHERE j.status IN ({live}) AND r.artifacts != '[]'{where}",
            (*LIVE_STATUSES, *args)):
        yield Holder("result", row["job_id"], row["artifacts"])
    # A template reads a row's artifacts, or its test.artifacts (the original's host executors).
    where, args = names("r.artifacts || COALESCE(r.extra, '')")
    for row in conn.execute(
            "SELECT w.job_id, r.artifacts || COALESCE(r.extra, '') AS named FROM jobs w "
            "JOIN job_deps d ON d.job_id = w.job_id JOIN results r ON r.job_id = d.depends_on "
            f"WHERE w.status = 'waiting' AND (r.artifacts != '[]' OR r.extra IS NOT NULL){where}",
            args):
        yield Holder("waiting", row["job_id"], row["named"])
    # A template that asks for an app's `latest` build holds whichever build is newest now.
    for kind, table, column in (("schedule", "schedules", "template"),
                                ("template", "job_templates", "spec")):
        where, args = ("", ()) if naming is None else (
            f" WHERE instr(lower({column}), ?) > 0 OR instr({column}, 'latest') > 0", (naming,))
        for row in conn.execute(f"SELECT id, {column} AS text FROM {table}{where}", args):
            yield Holder(kind, row["id"], row["text"] + _latest_text(conn, row["text"]))


def _latest_text(conn: sqlite3.Connection, template: str) -> str:
    """The newest build's hash when a template asks for `latest` (it holds that build)."""
    try:
        app = json.loads(template).get("app")
    except (ValueError, AttributeError):
        return ""
    if not isinstance(app, dict) or app.get("sha256") != "latest" or not app.get("name"):
        return ""
    newest = queue.latest_build(conn, str(app["name"]))
    return f" {newest}" if newest else ""


def _hashes(text: str) -> set[str]:
    return {run for run in _HEX_RUNS.findall(text.lower()) if len(run) == 64}


def referenced(conn: sqlite3.Connection) -> set[str]:
    """Every hash some live job, waiting dependency or schedule still needs."""
    found: set[str] = set()
    for holder in _holders(conn):
        found |= _hashes(holder.text)
    return found


_HOLD_SENTENCES = {
    "job": "live job {} names it in its spec",
    "result": "live job {} lists it in its results",
    "waiting": "waiting job {} will read it from a dependency's results",
    "schedule": "schedule {} uses it in its template",
    "template": "job template {} names it in its spec",
}


def holds_on(conn: sqlite3.Connection, row: sqlite3.Row) -> list[str]:
    """Why an artifact must stay, as sentences; empty when it may be deleted."""
    holds = []
    if row["pinned_reason"] is not None:
        holds.append(f"it is pinned ({row['pinned_reason']}); unpin it first")
    if row["baseline"]:
        holds.append("it is an accepted visual baseline; set accepted false first")
    seen = set()
    for holder in _holders(conn, naming=row["sha256"]):
        if row["sha256"] in _hashes(holder.text) and (holder.kind, holder.ident) not in seen:
            seen.add((holder.kind, holder.ident))
            holds.append(_HOLD_SENTENCES[holder.kind].format(holder.ident))
    return holds


def gc_candidates(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """Unreferenced, unpinned artifacts that are not baselines, oldest first."""
    needed = referenced(conn)
    rows = conn.execute("SELECT * FROM artifacts WHERE pinned_reason IS NULL AND baseline = 0 "
                        "ORDER BY created_at, sha256").fetchall()
    return [record(row) for row in rows if row["sha256"] not in needed]


# -- read views ---------------------------------------------------------------------------------


async def list_artifacts(db: Database, query: Mapping[str, str]) -> dict[str, Any]:
    """GET /api/artifacts: filters app and platform (exact), name (substring), pinned, baseline."""
    where: list[str] = ["1 = 1"]
    params: list[Any] = []
    for name in ("app", "platform"):
        if query.get(name):
            where.append(f"{name} = ?")
            params.append(query[name])
    if query.get("name"):
        where.append("name LIKE ? ESCAPE '\\'")
        params.append("%" + like_escape(query["name"]) + "%")
    pinned, baseline = _flag(query, "pinned"), _flag(query, "baseline")
    if pinned is not None:
        where.append("pinned_reason IS NOT NULL" if pinned else "pinned_reason IS NULL")
    if baseline is not None:
        where.append("baseline = ?")
        params.append(int(baseline))
    page = _page(query)
    clause = " AND ".join(where)
    totals = await db.read_one(f"SELECT COUNT(*), COALESCE(SUM(size), 0) FROM artifacts "
                               f"WHERE {clause}", params)
    rows = await db.read(f"SELECT * FROM artifacts WHERE {clause} "
                         "ORDER BY created_at DESC, sha256 LIMIT ? OFFSET ?",
                         [*params, PER_PAGE, (page - 1) * PER_PAGE])
    total, size = (totals[0], totals[1]) if totals else (0, 0)
    return _paged([record(r) for r in rows], total, page, bytes=size)


# The reads that search the text of every job, result row and schedule for hashes (a detail,
# the references of a listing's page, the collection candidates) run at most this many at once:
# a client asking for many at a time queues behind itself instead of taking every worker thread
# the collector's other reads and file work share (300 queued jobs of 1 MB make one scan 1 to
# 6 s of a thread).
ARTIFACT_SCANS_AT_ONCE = 2
NAMING_LISTED = 50  # jobs and result rows a detail lists as naming the artifact, newest first


def artifact_scans(db: Database) -> asyncio.Semaphore:
    return db.slots("artifact scans", ARTIFACT_SCANS_AT_ONCE)


async def reference_counts(db: Database, shas: list[str]) -> dict[str, int]:
    """How many jobs (of any status: history counts here, unlike the holds that block a
    delete) name each hash in their spec or list it in a result row, plus the schedules whose
    template names it. For a page of at most PER_PAGE hashes, on a connection of its own in a
    worker thread: the specs are read once, each searched for all the page's hashes in one pass
    (SQLite's instr, a scan of every spec for each hash, held the shared reader 24 s for a page
    of 50 hashes over 300 MB of queued specs)."""
    if not shas:
        return {}
    async with artifact_scans(db):
        return await db.read_in_thread(_count_references, list(shas))


def _count_references(conn: sqlite3.Connection, shas: list[str]) -> dict[str, int]:
    stored = [sha for (sha,) in conn.execute(
        f"SELECT sha256 FROM artifacts WHERE sha256 IN ({','.join('?' * len(shas))})", shas)]
    if not stored:
        return {}
    # Each is 64 hex digits (checked when stored), so the alternation needs no escaping.
    named = re.compile("|".join(stored))
    counts = dict.fromkeys(stored, 0)
    for (spec,) in conn.execute("SELECT spec FROM jobs"):
        for sha in set(named.findall(spec)):
            counts[sha] += 1
    for sha in stored:
        # Result rows' artifacts are short (at most 100 hashes); a job counted above by its
        # spec is not counted again for its rows.
        row = conn.execute(
            "SELECT (SELECT COUNT(DISTINCT r.job_id) FROM results r WHERE r.artifacts != '[]' "
            "AND instr(r.artifacts, ?1) > 0 AND NOT EXISTS (SELECT 1 FROM jobs j "
            "WHERE j.job_id = r.job_id AND instr(j.spec, ?1) > 0)) "
            "+ (SELECT COUNT(*) FROM schedules s WHERE instr(s.template, ?1) > 0)", (sha,)
        ).fetchone()
        counts[sha] += int(row[0])
    return counts


def _detail(conn: sqlite3.Connection, sha256: str) -> dict[str, Any]:
    """In a worker thread: the artifact's record, what holds it, and the jobs (of any status:
    history, not holds), result rows and schedules naming it, newest first."""
    row = conn.execute("SELECT * FROM artifacts WHERE sha256 = ?", (sha256,)).fetchone()
    if row is None:
        raise NotFound(f"no artifact {sha256}")
    holds = holds_on(conn, row)
    named = f"%{sha256}%"
    jobs = conn.execute("SELECT job_id, status FROM jobs WHERE spec LIKE ? "
                        "ORDER BY seq DESC LIMIT ?", (named, NAMING_LISTED)).fetchall()
    produced = conn.execute("SELECT job_id, device_id, iter, attempt, final FROM results "
                            "WHERE artifacts LIKE ? ORDER BY id DESC LIMIT ?",
                            (named, NAMING_LISTED)).fetchall()
    schedules = conn.execute("SELECT id FROM schedules WHERE template LIKE ? ORDER BY id",
                             (named,)).fetchall()
    return {**record(row), "deletable": not holds, "holds": holds,
            "referenced_by": {"jobs": [{"job_id": r["job_id"], "status": r["status"]}
                                       for r in jobs],
                              "schedules": [r["id"] for r in schedules]},
            "produced_by": [{"job_id": r["job_id"], "device_id": r["device_id"],
                             "iter": r["iter"], "attempt": r["attempt"],
                             "final": bool(r["final"])} for r in produced]}

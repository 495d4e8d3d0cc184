"""The live mirror of a running host job: the newest screen frame its executor posts
(POST /api/jobs/{id}/mirror, a JPEG), shown to viewers as it changes.

Frames live in memory only, one per job: a new frame replaces the last, nothing is written to
disk, and a job's frame is dropped when the job leaves its claim (closed, back in the queue,
lapsed). The frames held together stay within a byte budget (FLEET_MAX_MIRROR_HELD_BYTES): past
it the frames posted longest ago are let go first, and each comes back with its executor's next
post, so a flood of claimed jobs each posting a large frame cannot fill the collector's memory.
A viewer is handed the newest frame each time it is ready for one, never a backlog: a slow
viewer skips frames rather than queueing them.

Who may post: the job's claimant, a claimed host job's executor, named by `?executor=` or the
`X-Fleet-Executor` header; or, naming none, a device attached to that executor named by
`?device_id=` (its descriptor's attached_to, or a device the job holds a lock on), as the
executors in the field post under the device they mirror.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from fleet_min.collector.jobs import authority
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.jobs.kinds import Executor, JobStatus
from fleet_min.errors import BadRequest, Conflict, NotFound

SOI = b"\xff\xd8\xff"  # a JPEG's start-of-image marker and the next marker's first byte
EOI = b"\xff\xd9"      # its end-of-image marker


def check_frame(body: bytes) -> None:
    """Refuse an empty frame or one that is not a whole JPEG."""
    if not body:
        raise BadRequest("the frame is empty; post one JPEG image as the request body")
    if not body.startswith(SOI) or not body.rstrip(b"\0").endswith(EOI):
        raise BadRequest("the frame is not a JPEG image (it must start with FF D8 FF and end "
                         "with FF D9); post one whole JPEG per request")


ENDED = object()  # Mirrors.next_frame: the mirror ended


@dataclass
class Frame:
    seq: int
    data: bytes
    at: float


@dataclass
class _Job:
    frame: Frame | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    viewers: int = 0


class Mirrors:
    """The newest frame of each mirrored job, and the viewers waiting for the next one."""

    def __init__(self, budget: int) -> None:
        self._jobs: dict[str, _Job] = {}
        self._seq = 0
        self.budget = budget
        # The jobs holding a frame and its size, the one posted longest ago first.
        self._held: OrderedDict[str, int] = OrderedDict()
        self.held_bytes = 0

    @property
    def jobs(self) -> int:
        return len(self._jobs)

    def put(self, job_id: str, data: bytes, now: float) -> None:
        entry = self._jobs.setdefault(job_id, _Job())
        self._seq += 1
        self._release(job_id)
        entry.frame = Frame(self._seq, data, now)
        self._held[job_id] = len(data)
        self.held_bytes += len(data)
        # The newest frame always stays (it fits: one frame is at most FLEET_MAX_MIRROR_BYTES).
        while self.held_bytes > self.budget and len(self._held) > 1:
            self._let_go(next(iter(self._held)))
        entry.changed.set()

    def _release(self, job_id: str) -> None:
        """Stop counting the job's frame (it is replaced, let go or dropped)."""
        size = self._held.pop(job_id, None)
        if size is not None:
            self.held_bytes -= size

    def _let_go(self, job_id: str) -> None:
        """Over budget: the job keeps its viewers, not its frame, until its next post."""
        self._release(job_id)
        entry = self._jobs[job_id]
        entry.frame = None
        if entry.viewers <= 0:
            del self._jobs[job_id]

    def newest(self, job_id: str) -> Frame | None:
        entry = self._jobs.get(job_id)
        return entry.frame if entry else None

    async def next_frame(self, job_id: str, after: int, wait_s: float) -> Frame | object | None:
        """The newest frame newer than `after`, waiting up to wait_s for one: None when none
        came, ENDED when the job's mirror ended (the job left its claim, or shutdown)."""
        entry = self._jobs.setdefault(job_id, _Job())
        while not entry.closed:
            if entry.frame is not None and entry.frame.seq > after:
                return entry.frame
            entry.changed.clear()
            try:
                await asyncio.wait_for(entry.changed.wait(), wait_s)
            except TimeoutError:
                return None
        return ENDED

    def drop(self, job_id: str) -> None:
        """The job left its claim: its frame goes, and its viewers are told."""
        self._release(job_id)
        entry = self._jobs.pop(job_id, None)
        if entry is not None:
            entry.closed = True
            entry.changed.set()

    def viewers(self, job_id: str) -> int:
        entry = self._jobs.get(job_id)
        return entry.viewers if entry else 0

    def join(self, job_id: str) -> None:
        """A viewer starts watching the job (before its first frame, perhaps)."""
        self._jobs.setdefault(job_id, _Job()).viewers += 1

    def leave(self, job_id: str) -> None:
        """A viewer stopped: a job with no frame and no viewer left keeps nothing."""
        entry = self._jobs.get(job_id)
        if entry is None:
            return
        entry.viewers -= 1
        if entry.viewers <= 0 and entry.frame is None:
            del self._jobs[job_id]

    def on_event(self, event: dict[str, Any]) -> None:
        """Service listener: a job that is no longer claimed ends its mirror."""
        if event.get("type") == "job" and event.get("status") != JobStatus.CLAIMED:
            job_id = event.get("job_id")
            if isinstance(job_id, str) and job_id in self._jobs:
                self.drop(job_id)

    def close(self) -> None:
        for job_id in list(self._jobs):
            self.drop(job_id)


def check_poster(conn: sqlite3.Connection, job_id: str, executor: str | None,
                 device_id: str | None, now: float, effects: Effects,
                 caller: str | None = None) -> str:
    """The executor a frame is posted for, when it is the claimant of the claimed host job;
    else NotFound or Conflict with a sentence (a transaction function that writes nothing but,
    on the mesh, the executor name's binding)."""
    job = conn.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
    if job is None:
        raise NotFound(f"no job {job_id!r}")
    if job["executor"] != Executor.HOST:
        raise Conflict(f"job {job_id} is a device job; only a running host job is mirrored")
    if job["status"] != JobStatus.CLAIMED:
        raise Conflict(f"job {job_id} is {job['status']}; only a running host job is mirrored, "
                       "by its executor")
    speaker = executor
    if speaker is None and device_id is not None:
        speaker = authority.attached_executor(conn, job, device_id)
    if speaker is None:
        raise Conflict("name the executor posting the frame (?executor= or the X-Fleet-Executor "
                       "header), or the attached device it shows (?device_id=)")
    authority.check_host_claimant(conn, job, speaker, caller, now, "only its claimant mirrors it")
    return speaker


# A viewer's look at the job: unknown (404) or not running (404, its mirror ended).
STATUS_SQL = "SELECT status FROM jobs WHERE job_id = ?"


def viewer_refusal(job_id: str, status: str | None) -> NotFound | None:
    if status is None:
        return NotFound(f"no job {job_id!r}")
    if status != JobStatus.CLAIMED:
        return NotFound(f"job {job_id} is {status}: its live mirror ended with its run (frames "
                        "are kept only while the job runs)")
    return None

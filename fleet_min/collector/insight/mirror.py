"""The live mirror of a running host job: the newest screen frame its executor posts
(POST /api/jobs/{id}/mirror, a JPEG), shown to viewers as it changes.

Frames live in memory only, one per job: a new frame replaces the last, nothing is written to
disk, and a job's frame is dropped when the job leaves its claim (closed, back in the queue,
lapsed). A viewer is handed the newest frame each time it has taken all of the last, never a
backlog: a slow viewer skips frames rather than queueing them.

A frame is held while it is its job's newest, and also while any viewer's connection is still
being sent it (every viewer is handed the same bytes object): a viewer that stops reading keeps
the frame it was sent, though newer ones replaced it. All the frames held together, counted
once each, with what a connection copied of its own, stay within a byte budget
(FLEET_MAX_MIRROR_HELD_BYTES). Past it, least needed first: the viewers still being sent a frame
that a newer one replaced are cut off (a live view needs only the newest); then the newest
frames of other jobs are let go, the one posted longest ago first, each coming back with its
executor's next post; last, viewers being sent those are cut too. So neither a flood of claimed
jobs each posting a large frame nor a crowd of viewers that never read, each handed another
frame, can fill the collector's memory.

Who may post: the job's claimant, a claimed host job's executor, named by `?executor=` or the
`X-Fleet-Executor` header; or, naming none, a device attached to that executor named by
`?device_id=` (its descriptor's attached_to, or a device the job holds a lock on), as the
executors in the field post under the device they mirror.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections import OrderedDict
from collections.abc import Callable
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


@dataclass(eq=False)
class Frame:
    seq: int
    data: bytes
    at: float
    job_id: str
    newest: bool = True  # still its job's newest frame
    # The viewers whose connections are being sent it, the one handed it first first.
    senders: dict[Sending, None] = field(default_factory=dict)


@dataclass(eq=False)
class Sending:
    """One viewer's connection being sent a frame: from the write until it holds none of the
    frame. `cut` ends the connection, and what it holds with it; `copied` is what it holds of
    its own besides the frame's bytes object (an event loop that copies what the socket did
    not take)."""
    frame: Frame
    cut: Callable[[], None]
    copied: int = 0


@dataclass
class _Job:
    frame: Frame | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    viewers: int = 0


class Mirrors:
    """The newest frame of each mirrored job, the frames viewers are still being sent, and the
    viewers waiting for the next one."""

    def __init__(self, budget: int) -> None:
        self._jobs: dict[str, _Job] = {}
        self._seq = 0
        self.budget = budget
        # Every frame held (a job's newest, or one a viewer is still being sent), by seq: the
        # one posted longest ago first.
        self._frames: OrderedDict[int, Frame] = OrderedDict()
        self.held_bytes = 0  # their sizes, each once, and what connections copied of them

    @property
    def jobs(self) -> int:
        return len(self._jobs)

    def put(self, job_id: str, data: bytes, now: float) -> None:
        entry = self._jobs.setdefault(job_id, _Job())
        self._seq += 1
        if entry.frame is not None:
            self._replaced(entry.frame)
        frame = entry.frame = Frame(self._seq, data, now, job_id)
        self._frames[frame.seq] = frame
        self.held_bytes += len(data)
        # The newest frame always stays (it fits: one frame is at most FLEET_MAX_MIRROR_BYTES).
        self._within_budget(frame)
        entry.changed.set()

    def sending(self, frame: Frame, cut: Callable[[], None]) -> Sending:
        """A viewer's connection is handed `frame` (one next_frame just gave): it stays held,
        and counted, until `sent`. `cut` ends the connection, should the budget need it."""
        sending = Sending(frame, cut)
        frame.senders[sending] = None
        if frame.seq not in self._frames:  # (not held any more: held again while it is sent)
            self._frames[frame.seq] = frame
            self.held_bytes += len(frame.data)
        return sending

    def copied(self, sending: Sending, size: int) -> None:
        """The viewer's connection holds `size` bytes of its own while it is sent the frame
        (an event loop that copies what the socket did not take): counted until `sent`."""
        if sending in sending.frame.senders and size != sending.copied:
            self.held_bytes += size - sending.copied
            sending.copied = size
            self._within_budget(sending.frame)

    def sent(self, sending: Sending) -> None:
        """The viewer's connection holds none of the frame any more: taken, or cut."""
        frame = sending.frame
        if sending in frame.senders:  # (once: a cut viewer's stream says so again as it ends)
            del frame.senders[sending]
            self.held_bytes -= sending.copied
            self._forget(frame)

    def _replaced(self, frame: Frame) -> None:
        """No longer its job's newest: held only while a viewer is still sent it."""
        frame.newest = False
        self._forget(frame)

    def _forget(self, frame: Frame) -> None:
        """Stop holding (and counting) the frame once nothing needs it."""
        if not frame.newest and not frame.senders and frame.seq in self._frames:
            del self._frames[frame.seq]
            self.held_bytes -= len(frame.data)

    def _over(self) -> bool:
        return self.held_bytes > self.budget

    def _within_budget(self, keep: Frame) -> None:
        """Past the budget, free what is needed least first, until it fits. `keep` (the frame
        just posted, or handed to a viewer) stays, though its viewers' own copies may go."""
        # 1. Frames a newer one replaced, kept only by viewers that have not taken them: a live
        # view needs the newest frame, and an attacker's viewers that never read are these.
        for frame in list(self._frames.values()):
            if not self._over():
                return
            if not frame.newest:
                self._cut(frame)
        # 2. Other jobs' newest frames no viewer is being sent: let go until the next post.
        for frame in list(self._frames.values()):
            if not self._over():
                return
            if frame is not keep and not frame.senders:
                self._let_go(frame)
        # 3. The rest: cut the viewers still being sent them (of `keep`, those with copies).
        for frame in list(self._frames.values()):
            if not self._over():
                return
            self._cut(frame, only_copies=frame is keep)
            if frame is not keep and self._over():
                self._let_go(frame)

    def _cut(self, frame: Frame, only_copies: bool = False) -> None:
        """Cut the frame's viewers, the one handed it first first, while over the budget (all
        of them, unless copies of their own go: the frame goes only with its last viewer)."""
        for sending in list(frame.senders):
            if not self._over():
                return
            if not only_copies or sending.copied:
                sending.cut()  # what the connection held goes with it
                self.sent(sending)

    def _let_go(self, frame: Frame) -> None:
        """Over budget: the job keeps its viewers, not its frame, until its next post."""
        entry = self._jobs.get(frame.job_id)
        if entry is not None and entry.frame is frame:
            entry.frame = None
            if entry.viewers <= 0:
                del self._jobs[frame.job_id]
        self._replaced(frame)

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
        """The job left its claim: its frame goes (once no viewer is still sent it), and its
        viewers are told."""
        entry = self._jobs.pop(job_id, None)
        if entry is not None:
            if entry.frame is not None:
                self._replaced(entry.frame)
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

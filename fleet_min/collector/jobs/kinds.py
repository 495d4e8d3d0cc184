"""The closed sets of names the collector stores and sends: job statuses, executor kinds, result
kinds, attempt outcomes, device statuses. Each is a StrEnum, so a member is the very string it
names (stored in SQLite, sent as JSON, compared with a row's text) and mypy checks the names.

SQL text keeps its literals where a partial index needs them (`status = 'queued'`: a bound
parameter would not match the index's WHERE); tests/collector/test_kinds.py checks that every
status SQL names is one of these.
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    QUEUED = "queued"        # claimable now
    WAITING = "waiting"      # on its dependencies
    CLAIMED = "claimed"      # held under a lease
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


# A job in one of these never changes again (a retry is a new job).
FINAL: frozenset[str] = frozenset({JobStatus.DONE, JobStatus.FAILED, JobStatus.CANCELLED})
# Unfinished: still to run or running.
OPEN: frozenset[str] = frozenset({JobStatus.QUEUED, JobStatus.WAITING, JobStatus.CLAIMED})
# Every status, in the order listings and counts show them.
JOB_STATUSES: tuple[str, ...] = tuple(status.value for status in JobStatus)
# The failures a dependent inherits (its dependency will never be done).
UNSUCCESSFUL: frozenset[str] = frozenset({JobStatus.FAILED, JobStatus.CANCELLED})


class Executor(StrEnum):
    """Who runs a job: an agent on the device itself, or a host executor driving it."""

    DEVICE = "device"
    HOST = "host"


class ResultKind(StrEnum):
    """What a POST /results body is."""

    RESULT = "result"
    BEACON = "beacon"


class AttemptOutcome(StrEnum):
    """How an attempt (one claim of a job) ended, as job_attempts.outcome stores it."""

    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    RELEASED = "released"        # its claimant handed it back
    PREEMPTED = "preempted"      # handed back for a job of higher priority
    EXPIRED = "expired"          # its lease lapsed
    UNDELIVERED = "undelivered"  # claimed for a poll whose client went away


class LeaseExpiry(StrEnum):
    """What the sweep did with a job whose lease lapsed."""

    REQUEUED = "requeued"
    FAILED = "failed"


class DeviceStatus(StrEnum):
    """A device's status, derived from when it was last seen (rules.device_status)."""

    ONLINE = "online"
    STALE = "stale"
    OFFLINE = "offline"

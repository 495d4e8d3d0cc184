"""What a committed transaction changed, for the code that runs after the commit.

Transaction functions record here the events to publish on the live stream and the jobs that
became claimable (so waiting long polls are woken). Nothing here is acted on until the write has
committed: a rolled-back transaction's effects are dropped with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fleet_min.collector.jobs.kinds import LeaseExpiry


def claimant_key(executor: str, claimant_id: str) -> str:
    """A claimant as one string ("device:pixel-7", "host:mac-mini"), for lookups."""
    return f"{executor}:{claimant_id}"


class JobRoute(NamedTuple):
    """The columns a waiting claimant is matched on before a real claim is attempted. A named
    tuple: one is made for every job stored, and a frozen dataclass costs twice as much."""

    job_id: str
    executor: str
    pin: str
    workload: str
    variant: str | None  # what a capability pairing names: the backend, or a build's toolchain
    pool: str | None


@dataclass(slots=True, init=False)
class Effects:
    events: list[dict[str, Any]] = field(default_factory=list)
    # Events for the listeners (CI status, ...) but not the live stream: all but the first few
    # of a long cascade, which every stream client would otherwise get in one burst.
    unstreamed: list[dict[str, Any]] = field(default_factory=list)
    claimable: list[JobRoute] = field(default_factory=list)
    claimants: list[str] = field(default_factory=list)  # see claimant_changed
    beacons: list[str] = field(default_factory=list)  # see beaconed
    # (claimant key, whether anything stood in its way) for each claim that found no job: see
    # fleet_min.collector.jobs.claims.claim. A poll whose claimant had nothing queued for it at
    # all is not woken by its beacons (only a new job can change that answer).
    looked: list[tuple[str, bool]] = field(default_factory=list)
    # For the metrics (fleet_min.collector.insight.telemetry): how long each job claimed here
    # had been claimable, in seconds, and what became of the job of each lapsed lease swept.
    claim_waits: list[float] = field(default_factory=list)
    lease_expiries: list[LeaseExpiry] = field(default_factory=list)
    # (device id, when) for each device a claim's look saw: written to last_seen later, in one
    # transaction for many (fleet_min.collector.jobs.sightings).
    sightings: list[tuple[str, float]] = field(default_factory=list)
    # Jobs whose stored spec names no commit status target (see no_commit_status): the CI
    # status reporter posts nothing for this transaction's events of them and skips its read.
    no_ci_target: list[str] = field(default_factory=list)

    def __init__(self) -> None:
        # Spelled out: every transaction makes one, and the generated __init__ calls each
        # default_factory, 2.5 times as slow as list displays.
        self.events = []
        self.unstreamed = []
        self.claimable = []
        self.claimants = []
        self.beacons = []
        self.looked = []
        self.claim_waits = []
        self.lease_expiries = []
        self.sightings = []
        self.no_ci_target = []

    def clear(self) -> None:
        """Forget everything recorded (the transaction is about to run again)."""
        self.events.clear()
        self.unstreamed.clear()
        self.claimable.clear()
        self.claimants.clear()
        self.beacons.clear()
        self.looked.clear()
        self.claim_waits.clear()
        self.lease_expiries.clear()
        self.sightings.clear()
        self.no_ci_target.clear()

    def mark(self) -> tuple[int, ...]:
        """Where each record stands now, for `rewind`."""
        return (len(self.events), len(self.unstreamed), len(self.claimable), len(self.claimants),
                len(self.beacons), len(self.looked), len(self.claim_waits),
                len(self.lease_expiries), len(self.sightings), len(self.no_ci_target))

    def rewind(self, mark: tuple[int, ...]) -> None:
        """Forget what was recorded since `mark` (its statements were rolled back to a
        savepoint: nothing of it happened)."""
        (events, unstreamed, claimable, claimants, beacons, looked, waits, expiries, seen,
         quiet) = mark
        del self.events[events:]
        del self.unstreamed[unstreamed:]
        del self.claimable[claimable:]
        del self.claimants[claimants:]
        del self.beacons[beacons:]
        del self.looked[looked:]
        del self.claim_waits[waits:]
        del self.lease_expiries[expiries:]
        del self.sightings[seen:]
        del self.no_ci_target[quiet:]

    def job(self, job_id: str, status: str, workload: str, executor: str, **extra: Any) -> None:
        self.events.append({"type": "job", "job_id": job_id, "status": status,
                            "workload": workload, "executor": executor, **extra})

    def no_commit_status(self, job_id: str, spec_text: str) -> None:
        """Note a job whose stored spec (JSON text) cannot name report_to.ci_status. A spec
        that has the key's text anywhere, even inside a value, is not noted: the reporter reads
        it and decides. Every job's claim and close would otherwise cost the reporter a read."""
        if '"ci_status"' not in spec_text:
            self.no_ci_target.append(job_id)

    def emit(self, type_: str, **fields: Any) -> None:
        self.events.append({"type": type_, **fields})

    def claimant_changed(self, executor: str, claimant_id: str) -> None:
        """A claimant may be offered a job it could not take before (a beacon that may meet a
        constraint, an edit of its pools, a slot freed): a poll it holds waiting looks again."""
        self.claimants.append(claimant_key(executor, claimant_id))

    def beaconed(self, executor: str, claimant_id: str) -> None:
        """A claimant beaconed: a poll it holds waiting looks again if its last look was
        refused something a beacon may change (a constraint, a busy flag), not when there was
        nothing queued for it at all."""
        self.beacons.append(claimant_key(executor, claimant_id))

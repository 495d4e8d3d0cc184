"""The collector's metrics (GET /metrics): what each one measures and where it is read.

Counted as it happens, on the event loop's thread:
- claim waits: each claim's transaction records how long the job had been claimable (since it
  was stored, requeued or promoted: its updated_at); observed once the transaction committed;
- lease expiries: the sweep records the outcome of each lapsed lease (requeued, failed);
- results ingested (result rows and beacons) and uploaded artifact bytes: from the events of
  committed transactions, the same ones the live stream publishes.

Read at scrape, at most once a second however many scrapers ask (`FiguresCache`): jobs by
status and workload (one GROUP BY over the jobs_status_workload index; the workloads beyond the
spec's and the most used others folded into "other": fold_workloads), devices by derived
status and the age of their last beacons (one read of every device's times, from an index, in a
worker thread: a registry may hold 25,000), artifacts stored, and the sizes of the database and
WAL files. The writer's queue, stream clients, waiting polls and the process figures are read
from memory.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet_min import metrics
from fleet_min.collector.jobs import rules
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.jobs.kinds import JOB_STATUSES, DeviceStatus, LeaseExpiry, ResultKind
from fleet_min.db import Database
from fleet_min.sse import EventHub
from fleet_min.timeutil import now

DEVICE_STATUSES = tuple(status.value for status in DeviceStatus)
# A dispatch to a waiting agent takes milliseconds; a job behind a busy shelf waits hours.
CLAIM_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
                      300, 900, 1800, 3600, 14400)
# Agents beacon every few seconds while running and every minute or so while idle; the
# device-status thresholds (180 s stale, 900 s offline) are bounds of their own.
BEACON_AGE_BUCKETS = (5, 15, 30, 60, 120, 180, 300, 600, 900, 1800, 3600, 21600, 86400)
FRESH_S = 1.0  # figures read from the database are reused for this long

JOBS_BY_STATUS = ("SELECT status, workload, COUNT(*) AS n FROM jobs WHERE is_group = 0 "
                  "GROUP BY status, workload")
DEVICE_TIMES = "SELECT last_seen, last_beacon_at, ttl_s FROM devices"
ARTIFACT_TOTALS = "SELECT COUNT(*) AS n, COALESCE(SUM(size), 0) AS bytes FROM artifacts"


@dataclass
class Figures:
    """What a scrape reads from the database and the disk."""

    jobs: dict[tuple[str, str], int] = field(default_factory=dict)  # (status, workload) -> n
    devices: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DEVICE_STATUSES, 0))
    beacon_ages: list[float] = field(default_factory=list)
    artifacts: int = 0
    artifact_bytes: int = 0
    db_bytes: int | None = None
    wal_bytes: int | None = None


# Workload names are an open set, and any client may enqueue jobs of as many as it likes: one
# label each made a scrape 22 MB at 25,600 names, growing with every new one, and a Prometheus
# keeps every series it ever saw. The spec's workloads (its parameter table, and llm-eval,
# which it names as a capability) are labelled always; of the rest, the OTHER_LABELLED with the
# most jobs; the others are summed under workload="other" (a workload named "other" too).
SPEC_WORKLOADS = frozenset({
    "benchmark", "thermal", "batch", "pipeline", "vision-eval", "speech-eval", "embed-eval",
    "vantage", "model-convert", "dataset-prep", "serve", "shell", "self-check", "build",
    "install", "ui-test", "cold-start", "app-soak", "a11y-audit", "locale-shots", "web-test",
    "web-shots", "web-audit", "web-unfurl", "drain", "archive", "digest", "soak", "llm-eval",
})
OTHER_LABELLED = 50
OTHER = "other"


def fold_workloads(counts: dict[tuple[str, str], int], known: frozenset[str] = SPEC_WORKLOADS,
                   others: int = OTHER_LABELLED) -> dict[tuple[str, str], int]:
    """(status, workload) counts with the workloads past the labelled ones summed as OTHER.
    Ties in the ranking go to the name first in order, so a scrape's labels do not flap."""
    totals: dict[str, int] = {}
    for (_status, workload), n in counts.items():
        totals[workload] = totals.get(workload, 0) + n
    ranked = sorted((w for w in totals if w not in known and w != OTHER),
                    key=lambda w: (-totals[w], w))
    labelled = known | frozenset(ranked[:others])
    folded: dict[tuple[str, str], int] = {}
    for (status, workload), n in counts.items():
        key = (status, workload if workload in labelled else OTHER)
        folded[key] = folded.get(key, 0) + n
    return folded


def job_samples(counts: dict[tuple[str, str], int]) -> list[metrics.Sample]:
    """Every status of every workload that has jobs, zeros included, so a series does not
    vanish when its last job moves on."""
    workloads = sorted({workload for _, workload in counts})
    return [((status, workload), counts.get((status, workload), 0))
            for workload in workloads for status in JOB_STATUSES]


def device_figures(rows: Iterable[Any], current: float) -> tuple[dict[str, int], list[float]]:
    """Devices by derived status (the spec's thresholds on last_seen), and the seconds since
    each one's last beacon (those that ever sent one). A temporary device past its ttl_s has
    left the shelf and counts in neither, as in the overview."""
    by_status = dict.fromkeys(DEVICE_STATUSES, 0)
    ages = []
    for row in rows:
        if rules.is_expired(row["ttl_s"], row["last_seen"], current):
            continue
        by_status[rules.device_status(row["last_seen"], current)] += 1
        if row["last_beacon_at"] is not None:
            ages.append(max(0.0, current - row["last_beacon_at"]))
    return by_status, ages


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _device_times(conn: sqlite3.Connection, current: float) -> tuple[dict[str, int], list[float]]:
    """In a worker thread, on a connection of its own: a registry at its bound is 25,000 rows
    to read and judge, which the shared reader and the event loop's thread need for others."""
    return device_figures(conn.execute(DEVICE_TIMES), current)


async def read_figures(db: Database) -> Figures:
    jobs = fold_workloads({(row["status"], row["workload"]): row["n"]
                           for row in await db.read(JOBS_BY_STATUS)})
    devices, ages = await db.read_in_thread(_device_times, now(), named=True)
    totals = await db.read_one(ARTIFACT_TOTALS)
    return Figures(jobs=jobs, devices=devices, beacon_ages=ages,
                   artifacts=totals["n"] if totals else 0,
                   artifact_bytes=totals["bytes"] if totals else 0,
                   db_bytes=_size(db.path), wal_bytes=_size(Path(f"{db.path}-wal")))


class FiguresCache:
    """The last figures, read again when older than FRESH_S. Scrapes that arrive while a read
    is in flight wait for it: a storm of scrapes costs one read a second."""

    def __init__(self, db: Database, fresh_s: float = FRESH_S) -> None:
        self.db = db
        self.fresh_s = fresh_s
        self.figures = Figures()
        self.reads = 0
        self._taken_at: float | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> Figures:
        async with self._lock:
            taken = self._taken_at
            if taken is None or time.monotonic() - taken >= self.fresh_s:
                self.figures = await read_figures(self.db)
                self._taken_at = time.monotonic()
                self.reads += 1
            return self.figures


class CollectorMetrics:
    """The collector's registry: instruments changed as things happen, gauges read at scrape."""

    def __init__(self, db: Database, hub: EventHub, waiting_polls: Callable[[], int],
                 started_at: float) -> None:
        self.cache = FiguresCache(db)
        self.registry = metrics.Registry()
        self._counted(self.registry)
        self._scraped(self.registry)
        self._internals(self.registry, db, hub, waiting_polls)
        metrics.add_process(self.registry, started_at)

    def _counted(self, r: metrics.Registry) -> None:
        self.claim_wait = r.histogram(
            "fleet_collector_claim_wait_seconds",
            "Seconds from a job becoming claimable (stored, requeued or promoted) to its claim.",
            CLAIM_WAIT_BUCKETS).labels()
        expiries = r.counter("fleet_collector_lease_expiries_total",
                             "Leases that lapsed and were swept, by what became of the job.",
                             ["outcome"])
        self.expired = {outcome: expiries.labels(outcome) for outcome in LeaseExpiry}
        ingested = r.counter("fleet_collector_results_ingested_total",
                             "Result rows (repeats not counted) and beacons stored.", ["kind"])
        self.ingested = {kind: ingested.labels(kind) for kind in ResultKind}
        self.uploaded = r.counter("fleet_collector_artifact_uploaded_bytes_total",
                                  "Bytes of artifact uploads received whole (a re-upload of "
                                  "stored bytes counts too).").labels()

    def _scraped(self, r: metrics.Registry) -> None:
        r.gauge("fleet_collector_jobs", "Jobs by status and workload (fan-out parents left out; "
                "workloads past the spec's and the 50 most used others summed as other).",
                ["status", "workload"], read=lambda: job_samples(self.cache.figures.jobs))
        r.gauge("fleet_collector_devices",
                "Devices by status derived from last_seen: online under 3 minutes, stale under "
                "15, offline beyond (temporary devices past their ttl_s left out).", ["status"],
                read=lambda: [((s,), n) for s, n in self.cache.figures.devices.items()])
        r.histogram("fleet_collector_beacon_age_seconds",
                    "Seconds since each device's last beacon, across the devices that sent one "
                    "(a snapshot at scrape, not a running count).", BEACON_AGE_BUCKETS,
                    read=lambda: [((), self.cache.figures.beacon_ages)])
        r.gauge("fleet_collector_artifacts", "Artifacts stored.",
                read=lambda: [((), self.cache.figures.artifacts)])
        r.gauge("fleet_collector_artifact_bytes", "Bytes of the artifacts stored.",
                read=lambda: [((), self.cache.figures.artifact_bytes)])
        r.gauge("fleet_collector_db_bytes", "Size of the SQLite database file.",
                read=lambda: metrics.present(self.cache.figures.db_bytes))
        r.gauge("fleet_collector_db_wal_bytes", "Size of the database's write-ahead log.",
                read=lambda: metrics.present(self.cache.figures.wal_bytes))

    def _internals(self, r: metrics.Registry, db: Database, hub: EventHub,
                   waiting_polls: Callable[[], int]) -> None:
        def queue() -> list[metrics.Sample]:
            waiting, uncommitted = db.queue_depth
            return [(("waiting",), waiting), (("uncommitted",), uncommitted)]

        r.gauge("fleet_collector_db_writer_queue",
                "Transactions waiting for the writer, and run but not yet taken by a COMMIT.",
                ["stage"], read=queue)
        r.counter("fleet_collector_db_commits_total", "COMMITs (each holds a group of "
                  "transactions).", read=lambda: [((), db.stats["batches"])])
        r.counter("fleet_collector_db_transactions_total", "Transactions committed.",
                  read=lambda: [((), db.stats["transactions"])])
        r.counter("fleet_collector_db_unwritten_transactions_total",
                  "Transactions that changed nothing, answered without a COMMIT (long polls' "
                  "looks that found no job).", read=lambda: [((), db.stats["answered_early"])])
        r.gauge("fleet_collector_stream_clients", "Live-stream (SSE) clients connected.",
                read=lambda: [((), hub.clients)])
        r.gauge("fleet_collector_waiting_polls", "Long polls (devices and host executors) "
                "waiting for a job.", read=lambda: [((), waiting_polls())])

    # -- as things happen (the loop's thread) -----------------------------------------------

    def on_applied(self, effects: Effects) -> None:
        """After each committed transaction (Service.on_applied)."""
        if effects.claim_waits:
            observe = self.claim_wait.observe
            for waited in effects.claim_waits:
                observe(waited)
        for outcome in effects.lease_expiries:
            self.expired[outcome].inc()

    def on_event(self, event: dict[str, Any]) -> None:
        """Every committed event (Service.listeners)."""
        kind = event["type"]
        counter = self.ingested.get(kind)
        if counter is not None:
            counter.inc()
        elif kind == "artifact" and event.get("action") == "uploaded":
            self.uploaded.inc(event.get("size") or 0)

    # -- at scrape ----------------------------------------------------------------------------

    async def render(self) -> str:
        await self.cache.get()
        return self.registry.render()

"""A job's transaction bodies alone, with no HTTP, no event loop and no disk waits: the collector's
enqueue, claim and result functions against the spec's floor's (bench/floor_server.py), each on
a real SQLite file with its own schema, one transaction per request as a lone request gets.

    python bench/bodies.py [--jobs 3000] [--rounds 3] [--statements]

Per job and request, CPU time (time.process_time) of: the body's schema check as the handler
runs it; the body itself between BEGIN and COMMIT; the COMMIT apart. The file is in WAL mode
with synchronous=OFF, so a COMMIT writes the WAL but waits for no disk: the fsync is the COMMIT
thread's, which costs both servers the same (docs/performance.md, "Where the lifecycle target
sits"). `--statements` lists the collector's statements by their CPU a job (each timed by a
subclass of sqlite3.Connection, which adds about 0.3 us a statement).

The jobs are bench/lifecycle.py's (a synthetic benchmark pinned to one device); all are
enqueued first, then each is claimed and closed, as bench/lifecycle_split.py orders them. This
says how much of the collector's CPU a job beyond the floor lies in its transaction bodies and
how much elsewhere (the request's way through aiohttp, the writer, the effects).
"""

from __future__ import annotations

import argparse
import collections
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import floor_server
from bench.common import emit, table
from bench.lifecycle import final_row, pinned_job
from fleet_min import validate
from fleet_min.collector.jobs import claims, compat, devices, queue, results, specs
from fleet_min.collector.jobs.claims import Claimant
from fleet_min.collector.jobs.effects import Effects
from fleet_min.collector.jobs.kinds import Executor
from fleet_min.collector.storage.schema import MIGRATIONS
from fleet_min.db import migrate

DEVICE = "bench-device"
PARTS = ("check", "enqueue", "claim", "result", "commit")


class _Timed(sqlite3.Connection):
    """A connection that keeps each statement's count and CPU time, by its text."""

    spent: collections.defaultdict[str, list[float]]

    def execute(self, sql: str, params: Any = (), /) -> sqlite3.Cursor:  # type: ignore[override]
        started = time.process_time()
        cursor = super().execute(sql, params)
        entry = self.spent[" ".join(sql.split())]
        entry[0] += 1
        entry[1] += time.process_time() - started
        return cursor


def _connect(path: Path, timed: bool) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None,
                           factory=_Timed if timed else sqlite3.Connection)
    if timed:
        conn.spent = collections.defaultdict(lambda: [0, 0.0])  # type: ignore[attr-defined]
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=OFF")
    return conn


class _Clock:
    """CPU seconds by part; `run` times one transaction: its body, then its COMMIT."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.spent = dict.fromkeys(PARTS, 0.0)

    def check(self, fn: Callable[[], Any]) -> Any:
        started = time.process_time()
        value = fn()
        self.spent["check"] += time.process_time() - started
        return value

    def run(self, part: str, body: Callable[[sqlite3.Connection], Any]) -> Any:
        started = time.process_time()
        self.conn.execute("BEGIN IMMEDIATE")
        value = body(self.conn)
        committing = time.process_time()
        self.conn.execute("COMMIT")
        done = time.process_time()
        self.spent[part] += committing - started
        self.spent["commit"] += done - committing
        return value


def collector_round(directory: Path, jobs: int, timed: bool = False
                    ) -> tuple[dict[str, float], dict[str, list[float]] | None]:
    """CPU seconds by part over `jobs` jobs, and with `timed` each statement's count and CPU."""
    conn = _connect(directory / "collector.sqlite3", timed)
    migrate(conn, MIGRATIONS)
    conn.execute("BEGIN IMMEDIATE")
    devices.register(conn, {"device_id": DEVICE, "descriptor": {"platform": "linux"},
                            "capabilities": ["benchmark"]}, time.time(), None, Effects())
    conn.execute("COMMIT")
    clock = _Clock(conn)  # the jobs' alone, from here
    if timed:
        conn.spent.clear()  # type: ignore[attr-defined]
    claimant = Claimant(Executor.DEVICE, DEVICE)
    for n in range(jobs):
        spec = clock.check(lambda n=n: specs.check_spec(pinned_job(DEVICE, f"job-{n}")))
        clock.run("enqueue", lambda c, spec=spec: queue.enqueue(c, [spec], time.time(), Effects()))
    for n in range(jobs):
        _, job = clock.run("claim", lambda c: claims.first_claim(c, claimant, time.time(),
                                                                 Effects()))
        assert job is not None and job["job_id"] == f"job-{n}", job
        row = clock.check(lambda job=job: _checked_row(final_row(DEVICE, job["job_id"])))
        reply = clock.run("result", lambda c, row=row: results.post_result(c, row, time.time(),
                                                                           Effects()))
        assert reply["status"] == "done", reply
    spent = getattr(conn, "spent", None)
    conn.close()
    return clock.spent, spent


def _checked_row(row: dict[str, Any]) -> dict[str, Any]:
    assert not validate.validate_post_results(row)
    return compat.neutral_row(row)


def floor_round(directory: Path, jobs: int) -> dict[str, float]:
    """The same jobs through the floor server's own bodies and schema checks."""
    conn = _connect(directory / "floor.sqlite3", False)
    conn.executescript(floor_server.SCHEMA)
    conn.execute("INSERT INTO devices VALUES (?, ?, ?)", (DEVICE, "{}", '["benchmark"]'))
    clock = _Clock(conn)
    for n in range(jobs):
        raw = json.dumps(pinned_job(DEVICE, f"job-{n}")).encode()
        spec = clock.check(lambda raw=raw: _checked_spec(raw))
        assert clock.run("enqueue", lambda c, spec=spec, raw=raw: floor_server._insert(c, spec,
                                                                                       raw))
    for n in range(jobs):
        text = clock.run("claim", lambda c: floor_server._claim(c, DEVICE))
        job_id = json.loads(text)["job_id"]
        assert job_id == f"job-{n}", job_id
        row = clock.check(lambda job_id=job_id: _checked_floor_row(final_row(DEVICE, job_id)))
        assert clock.run("result", lambda c, row=row: floor_server._store(c, row)) is None
    conn.close()
    return clock.spent


def _checked_spec(raw: bytes) -> dict[str, Any]:
    spec = json.loads(raw)
    assert not floor_server.validate_job(spec)
    return spec


def _checked_floor_row(row: dict[str, Any]) -> dict[str, Any]:
    assert not floor_server.validate_result(row)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--statements", action="store_true",
                        help="also list the collector's statements by CPU a job")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.rounds = 20, 1
    got: dict[str, list[dict[str, float]]] = {"collector": [], "floor": []}
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as directory:
            for kind, figures in (("collector", collector_round(Path(directory), args.jobs)[0]),
                                  ("floor", floor_round(Path(directory), args.jobs))):
                per_job = {f"{part}_us": 1e6 * figures[part] / args.jobs for part in PARTS}
                emit({"bench": "bodies", "round": r, "server": kind, **per_job})
                got[kind].append(per_job)
    summary: dict[str, Any] = {"bench": "bodies", "figure": "bodies", "rounds": args.rounds,
                               "jobs": args.jobs}
    rows = []
    for kind, rounds in got.items():
        medians = {part: statistics.median(f[f"{part}_us"] for f in rounds) for part in PARTS}
        bodies = medians["enqueue"] + medians["claim"] + medians["result"]
        summary[kind] = {**{f"{part}_us": medians[part] for part in PARTS}, "bodies_us": bodies}
        rows.append((kind, f"{bodies:.1f} us/job", "bodies: " + ", ".join(
            f"{part} {medians[part]:.1f}" for part in PARTS[1:4]) + f"; check "
            f"{medians['check']:.1f}, commit {medians['commit']:.1f}"))
    summary["bodies_ratio"] = summary["collector"]["bodies_us"] / summary["floor"]["bodies_us"]
    if args.statements:  # a round of its own: the timing slows the bodies it times
        with tempfile.TemporaryDirectory() as directory:
            timed = collector_round(Path(directory), args.jobs, timed=True)[1] or {}
        jobs = args.jobs
        summary["statements"] = [
            {"sql": sql[:160], "per_job": count / jobs, "us_per_job": 1e6 * seconds / jobs}
            for sql, (count, seconds) in sorted(timed.items(), key=lambda kv: -kv[1][1])
            if count >= jobs]
    emit(summary)
    rows.append(("collector / floor", f"{summary['bodies_ratio']:.2f}x", "the bodies' CPU"))
    for entry in summary.get("statements", []):
        rows.append((f"{entry['us_per_job']:.1f} us", f"{entry['per_job']:.0f} a job",
                     entry["sql"][:90]))
    table(rows)


if __name__ == "__main__":
    main()

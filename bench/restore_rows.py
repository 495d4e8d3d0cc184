"""What restore's row check (fleet_min/collector/storage/row_check.py) costs, against the step
restore cannot do without: copying the backup's rows into a database the collector's own
migrations made (backup_check.rebuild).

    python bench/restore_rows.py [--results 1000000] [--rounds 3] [--quick]

A database is made with the collector's migrations and filled with rows shaped as a collector
writes them: `--results` result rows (metrics and artifacts as agents send them), one job for
every ten rows (a spec with targets, params and a dependency), and as many beacons as results.
Each round rebuilds it into a fresh file (restore's step, which runs the check itself) and then
runs the check again on what was rebuilt; the copy alone, the ceiling, is the difference.
Reported: the seconds of each, the check's cost beside the copy's (`ratio`), and per row.
`--quick` uses 2,000 results and one round.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, table
from fleet_min.collector.storage import backup_check, row_check
from fleet_min.collector.storage.schema import MIGRATIONS
from fleet_min.db import migrate

SPEC = {"schema": 1, "workload": "benchmark", "executor": "device", "backend": "synthetic",
        "targets": {"pool": "lab", "match": None}, "params": {"iterations": 20, "warmup": 2},
        "lease": {"ttl_s": 600}}
METRICS = json.dumps({"fps": 59.9, "frame_ms_p50": 16.7, "frame_ms_p99": 33.1, "cpu_pct": 42.5,
                      "mem_mb": 811, "battery_drain_pct": 0.4})
BEACON = json.dumps({"battery_pct": 81, "charging": True, "thermal": "nominal", "temp_c": 36.5,
                     "mem_mb": 2711, "load": 0.42})


def fill(path: Path, results: int) -> int:
    """The source database; the number of rows it holds."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    migrate(conn, MIGRATIONS)
    jobs = max(1, results // 10)
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO jobs (job_id, workload, executor, backend, status, max_attempts, ttl_s, "
        "spec, pool, created_at, updated_at, finished_at) VALUES (?, 'benchmark', 'device', "
        "'synthetic', 'done', 3, 600, ?, 'lab', ?, ?, ?)",
        ((f"job-{n}", json.dumps({**SPEC, "job_id": f"job-{n}",
                                  "depends_on": [f"job-{n - 1}"] if n else []}),
          1764000000.0 + n, 1764000001.0 + n, 1764000002.0 + n) for n in range(jobs)))
    conn.executemany(
        "INSERT INTO results (job_id, device_id, iter, attempt, workload, ok, final, metrics, "
        "artifacts, created_at) VALUES (?, ?, ?, 1, 'benchmark', 1, ?, ?, ?, ?)",
        ((f"job-{n // 10}", f"pixel-{n % 20}", n % 10, int(n % 10 == 9), METRICS,
          json.dumps(["ab" * 32] if n % 10 == 9 else []), 1764000000.0 + n)
         for n in range(results)))
    conn.executemany("INSERT INTO beacons (device_id, job_id, at, body) VALUES (?, ?, ?, ?)",
                     ((f"pixel-{n % 20}", None, 1764000000.0 + n, BEACON)
                      for n in range(results)))
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return jobs + 2 * results


def one_round(source: Path, scratch: Path) -> tuple[float, float]:
    dest = scratch / "rebuilt.sqlite3"
    dest.unlink(missing_ok=True)
    dest.touch()
    started = time.perf_counter()
    backup_check.rebuild(source, dest, len(MIGRATIONS))
    rebuilt = time.perf_counter() - started
    conn = sqlite3.connect(dest, isolation_level=None)
    try:
        started = time.perf_counter()
        row_check.check_rows(conn)
        checked = time.perf_counter() - started
    finally:
        conn.close()
    return rebuilt, checked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.results, args.rounds = 2000, 1
    with tempfile.TemporaryDirectory(prefix="restore-rows-") as tmp:
        scratch = Path(tmp)
        source = scratch / "source.sqlite3"
        rows = fill(source, args.results)
        # rebuild runs the check itself: the copy alone is rebuild's time less the check's,
        # measured again on the file rebuild made.
        rounds = [one_round(source, scratch) for _ in range(args.rounds)]
    rebuild_s = statistics.median(r[0] for r in rounds)
    check_s = statistics.median(r[1] for r in rounds)
    # Two timings of a busy machine: at small sizes the check alone can take as long as the
    # whole rebuild, and then there is no copy's time left to compare it with (ratio None).
    copy_s = rebuild_s - check_s
    record = {"bench": "restore_rows", "figure": "row_check", "rows": rows,
              "results": args.results, "rounds": args.rounds,
              "rebuild_s": round(rebuild_s, 6), "check_s": round(check_s, 6),
              "copy_s": round(copy_s, 6),
              "ratio": round(check_s / copy_s, 3) if copy_s > 0 else None,
              "check_us_per_row": round(check_s / rows * 1e6, 3)}
    emit(record)
    table([("rows", f"{rows:,}", f"{args.results:,} results, as many beacons, a job per ten"),
           ("rebuild", f"{rebuild_s:.2f} s", "restore's copy into a fresh schema, check included"),
           ("row check", f"{check_s:.2f} s", f"{record['check_us_per_row']} µs a row"),
           ("check / copy", "-" if record["ratio"] is None else f"{record['ratio']:.2f}",
            "the check's cost beside the copy's" if record["ratio"] is not None
            else "the check took as long as the rebuild: too noisy to divide; run again")])


if __name__ == "__main__":
    main()

"""What it costs to hand a COMMIT to a thread while the event loop's thread is busy: the
collector's writer runs transaction bodies on the loop's thread and sends only the COMMIT (which
waits for the disk) to a thread of its own, and that thread needs the GIL twice per COMMIT, to
start it and to hand the answer back.

    python bench/commit_handoff.py [--batches 300] [--rows 32] [--chunk-us 20] [--quick]

The same durable commits (the collector's schema, WAL, synchronous=FULL, `--rows` result rows a
transaction) are timed from asking for the COMMIT until the asking thread sees the answer, in
four ways:

- `alone`: the asking thread commits itself. No hand-off: the COMMIT's own cost, the ceiling.
- `idle`: a COMMIT thread commits while the asking thread waits in a blocking read, holding no
  GIL (an event loop with nothing to do).
- `busy`: the asking thread meanwhile runs Python in chunks of about `--chunk-us` µs, each
  followed by a poll that releases the GIL for a moment (`select` with no timeout), as a loop
  serving requests does between callbacks.
- `busy, no release`: the same Python with no poll between chunks; the COMMIT thread gets the
  GIL only when the interpreter's switch interval forces it (`sys.getswitchinterval()`, 5 ms).

A thread that waits for the GIL while the holder releases and retakes it at every poll rarely
wins it: the holder is running and retakes it within microseconds, while the waiter first has to
be woken and scheduled. The figures show what that adds to each COMMIT. `--switch-interval`
sets the interpreter's interval for the run: it sets the pace of the last way, and shortens the
busy one without ending its wait (45 ms at the default 5 ms, 15 ms at 0.5 ms, here).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import select
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, percentile, table
from fleet_min.collector.storage.schema import MIGRATIONS
from fleet_min.db import migrate

NAME = "commit_handoff"
INSERT = """
    INSERT INTO results (job_id, device_id, iter, attempt, workload, ok, final, preempted,
                         error, metrics, artifacts, device, extra, created_at)
    VALUES (?, ?, ?, 1, 'benchmark', 1, 0, 0, NULL, ?, '[]', NULL, NULL, ?)
"""
METRICS = json.dumps({"decode_tok_s": 12.5, "prefill_tok_s": 101.25, "ttft_ms": 48.0})
REQUEST = {"schema": 1, "kind": "result", "job_id": "job-1", "device_id": "device-1", "iter": 7,
           "final": False, "ok": True, "metrics": json.loads(METRICS)}
WAYS = ("alone", "idle", "busy", "busy, no release")


def connect(folder: str) -> sqlite3.Connection:
    conn = sqlite3.connect(Path(folder) / "handoff.sqlite3", isolation_level=None,
                           check_same_thread=False)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    migrate(conn, MIGRATIONS)
    return conn


class CommitThread:
    """The collector's arrangement in miniature: a plain thread fed by a SimpleQueue commits
    and answers through a pipe the asking thread watches."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.asks: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self.answered = 0
        self.answer_r, self.answer_w = os.pipe()
        os.set_blocking(self.answer_r, False)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.asks.get():
            self.conn.execute("COMMIT")
            self.answered += 1  # seen by a thread that never releases the GIL
            os.write(self.answer_w, b".")

    def close(self) -> None:
        self.asks.put(False)
        self.thread.join()
        os.close(self.answer_r)
        os.close(self.answer_w)


def request_work(chunk_s: float) -> None:
    """About `chunk_s` of the Python a request costs: decode, check, encode."""
    until = time.perf_counter() + chunk_s
    while time.perf_counter() < until:
        body = json.loads(json.dumps(REQUEST))
        assert all(isinstance(key, str) for key in body)


def wait_for_answer(committer: CommitThread, way: str, chunk_s: float, answers: int) -> None:
    """Until the COMMIT thread has answered `answers` times."""
    if way == "idle":
        select.select([committer.answer_r], [], [])
    elif way == "busy":
        while not select.select([committer.answer_r], [], [], 0)[0]:
            request_work(chunk_s)
    else:
        while committer.answered < answers:  # no call here lets go of the GIL
            request_work(chunk_s)
    while committer.answered < answers:  # the pipe's byte comes just after the count
        time.sleep(0)
    os.read(committer.answer_r, 1)


def measure(conn: sqlite3.Connection, way: str, batches: int, rows: int, chunk_s: float,
            first_iter: int) -> list[float]:
    """Milliseconds from asking for each COMMIT until the asking thread has its answer."""
    committer = CommitThread(conn) if way != "alone" else None
    times = []
    n = first_iter
    try:
        for _ in range(batches):
            conn.execute("BEGIN IMMEDIATE")
            for _ in range(rows):
                n += 1
                conn.execute(INSERT, (f"job-{n % 64}", f"device-{n % 64}", n, METRICS, time.time()))
            asked = time.perf_counter()
            if committer is None:
                conn.execute("COMMIT")
            else:
                committer.asks.put(True)
                wait_for_answer(committer, way, chunk_s, len(times) + 1)
            times.append((time.perf_counter() - asked) * 1000)
    finally:
        if committer is not None:
            committer.close()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=300, help="COMMITs timed in each way")
    parser.add_argument("--rows", type=int, default=32, help="result rows a transaction")
    parser.add_argument("--chunk-us", type=float, default=20,
                        help="Python between two polls in the busy ways, in µs")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for the run, in seconds")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    batches = 10 if args.quick else args.batches
    chunk_s = args.chunk_us / 1e6
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        conn = connect(folder)
        measure(conn, "alone", 5, args.rows, chunk_s, 10**9)  # warm the file and the cache
        for index, way in enumerate(WAYS):
            times = measure(conn, way, batches, args.rows, chunk_s, index * 10**7)
            results[way] = {"median_ms": statistics.median(times), "p90_ms": percentile(times, 0.9),
                            "mean_ms": statistics.fmean(times)}
            emit({"bench": NAME, "figure": "way", "way": way, "batches": batches,
                  "rows": args.rows, **results[way]})
        conn.close()
    alone = results["alone"]["median_ms"]
    summary = {"bench": NAME, "figure": "handoff", "rows": args.rows, "batches": batches,
               "chunk_us": args.chunk_us, "switch_interval_s": sys.getswitchinterval(),
               "ways": results,
               "busy_over_alone": results["busy"]["median_ms"] / alone,
               "idle_over_alone": results["idle"]["median_ms"] / alone}
    emit(summary)
    rows: list[tuple[str, str, str]] = []
    notes: dict[str, Callable[[float], str]] = {
        "alone": lambda _: "the ceiling: the COMMIT itself",
        "idle": lambda m: f"{m / alone:.2f}x: the hand-off when the loop waits",
        "busy": lambda m: f"{m / alone:.2f}x: the hand-off when the loop is busy",
        "busy, no release": lambda m: f"{m / alone:.2f}x: only the switch interval "
                                      f"({sys.getswitchinterval() * 1000:g} ms) lets it in",
    }
    for way in WAYS:
        median = results[way]["median_ms"]
        rows.append((f"{way}: ms from ask to answer", f"{median:.3f}",
                     f"p90 {results[way]['p90_ms']:.3f}; {notes[way](median)}"))
    table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

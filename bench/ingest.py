"""Result ingestion: many posters in several client processes send result rows through
POST /results to a real collector (synchronous=FULL), and the acknowledged rows per second are
reported next to two ceilings measured in the same run.

    python bench/ingest.py [--posters 64] [--procs 4] [--seconds 8] [--rounds 3]
                           [--rows-per-request 1] [--against PATH] [--quick]

Ceilings:

- storage: raw sqlite3 inserts of the same rows (the collector's own INSERT into a database made
  from the collector's own schema, WAL, synchronous=FULL) in one process, committed in batches
  the size of the collector's mean group commit during the run (read from /api/health's writer
  figures), so the durability and batching are the same and only our work is missing. One row
  per commit is shown as well: that is what a store without group commit gets.
- load generator: the same posters against the bare aiohttp server (bench/bare_server.py),
  which answers POST /results with no work: what the clients and HTTP can carry at all.

With `--against PATH` (a checkout of another commit, say a `git worktree`), a collector from that
tree takes the same load in every round too, and the table adds its figures and this tree's
over them: a change to the result path is judged against the tree before under the same load,
not against a figure from another hour.

Every row is a distinct (job, device, iteration), so none is a duplicate. Figures are medians
over rounds; rounds alternate the servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Http, checkout, emit, run_clients, server, table
from fleet_min.collector.storage.schema import MIGRATIONS
from fleet_min.db import migrate

METRICS = {"decode_tok_s": 12.5, "prefill_tok_s": 101.25, "ttft_ms": 48.0, "peak_mem_mb": 812}
INSERT = """
    INSERT OR IGNORE INTO results (job_id, device_id, iter, workload, ok, final, preempted,
                                   error, metrics, artifacts, device, extra, created_at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""


def row(job_id: str, device_id: str, n: int) -> dict[str, Any]:
    return {"schema": 1, "kind": "result", "job_id": job_id, "device_id": device_id, "iter": n,
            "final": False, "ok": True, "metrics": METRICS}


async def prepare(address: str, tag: str, posters: int) -> None:
    """One registered device and one job per poster, claimed by it (rows are posted for jobs
    the poster holds)."""
    http = Http(address)
    for i in range(posters):
        status, body = await http.request("POST", "/devices/register", {
            "device_id": f"ingest-{tag}-{i}", "descriptor": {"platform": "linux"},
            "capabilities": ["benchmark"]})
        if status != 200:
            raise RuntimeError(f"register answered {status}: {body[:200]!r}")
    status, body = await http.request("POST", "/jobs", [
        {"schema": 1, "job_id": f"ingest-{tag}-{i}", "workload": "benchmark",
         "executor": "device", "backend": "synthetic",
         "targets": {"device_id": f"ingest-{tag}-{i}"}} for i in range(posters)])
    if status != 201:
        raise RuntimeError(f"POST /jobs answered {status}: {body[:200]!r}")
    for i in range(posters):  # the collector takes rows only from a job's claimant
        status, body = await http.request("GET", f"/devices/ingest-{tag}-{i}/next-job")
        if status != 200:
            raise RuntimeError(f"the claim answered {status}: {body[:200]!r}")
    http.close()


async def _poster(address: str, name: str, stop_at: float, counter: list[int],
                  per_request: int) -> None:
    http = Http(address)
    n = 0
    while time.monotonic() < stop_at:
        payload: Any = (row(name, name, n) if per_request == 1
                        else [row(name, name, n + i) for i in range(per_request)])
        status, body = await http.request("POST", "/results", payload)
        if status != 200:
            raise RuntimeError(f"POST /results answered {status}: {body[:200]!r}")
        n += per_request
    counter[0] += n
    http.close()


def _client(address: str, names: list[str], seconds: float, per_request: int, ready: Any,
            go: Any, out: Any) -> None:
    counter = [0]

    async def run() -> None:
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(_poster(address, name, stop_at, counter, per_request)
                               for name in names))

    ready.put(True)
    go.wait()
    started = time.process_time()
    asyncio.run(run())
    out.put((counter[0], time.process_time() - started))


async def _writer_stats(address: str) -> dict[str, float]:
    http = Http(address)
    _, body = await http.request("GET", "/api/health")
    http.close()
    return dict(json.loads(body).get("writer") or {})


def post_rows(kind: str, address: str, pid: int, tag: str, args: argparse.Namespace
              ) -> dict[str, float]:
    if kind == "collector":
        asyncio.run(prepare(address, tag, args.posters))
        stats_before = asyncio.run(_writer_stats(address))
    names = [f"ingest-{tag}-{i}" for i in range(args.posters)]
    run = run_clients(_client, [(address, names[i::args.procs], args.seconds,
                                 args.rows_per_request)
                                for i in range(args.procs) if names[i::args.procs]],
                      pid, args.seconds + 120)
    outcomes, wall, cpu = run.outcomes, run.wall_s, run.server_cpu_s
    rows = sum(n for n, _ in outcomes)
    figures = {"rows": rows, "wall_s": wall, "rows_per_s": rows / wall,
               "server_cpu_us_per_row": 1e6 * cpu / max(rows, 1),
               # The event loop's thread runs every request and transaction body: a core to
               # itself would carry at most 1e6 / this many rows a second.
               "server_main_us_per_row": 1e6 * run.server_main_cpu_s / max(rows, 1),
               # Below 1 with rows waiting: the loop's thread waits for COMMITs (see
               # bench/commit_handoff.py for what a COMMIT's hand-off costs).
               "loop_busy": run.server_main_cpu_s / wall,
               "client_cpu_s": sum(c for _, c in outcomes)}
    if kind == "collector":
        stats = asyncio.run(_writer_stats(address))
        batches = stats.get("batches", 0) - stats_before.get("batches", 0)
        transactions = stats.get("transactions", 0) - stats_before.get("transactions", 0)
        figures["mean_group_commit"] = transactions / max(batches, 1)
        figures["mean_rows_per_commit"] = (transactions * args.rows_per_request
                                           / max(batches, 1))
        # From asking the COMMIT thread for a COMMIT until its answer reached the loop.
        figures["commit_ms"] = (1000 * (stats.get("commit_s", 0) - stats_before.get("commit_s", 0))
                                / max(batches, 1))
    return figures


def sqlite_ceiling(rows: int, batch: int) -> dict[str, float]:
    """Raw inserts of the same rows into the collector's schema, `batch` rows per commit."""
    with tempfile.TemporaryDirectory() as folder:
        conn = sqlite3.connect(Path(folder) / "ceiling.sqlite3", isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        migrate(conn, MIGRATIONS)
        metrics = json.dumps(METRICS)
        started = time.perf_counter()
        for first in range(0, rows, batch):
            conn.execute("BEGIN IMMEDIATE")
            for n in range(first, min(first + batch, rows)):
                conn.execute(INSERT, ("ceiling-job", "ceiling-device", n, "benchmark", 1, 0, 0,
                                      None, metrics, "[]", None, None, time.time()))
            conn.execute("COMMIT")
        elapsed = time.perf_counter() - started
        conn.close()
    return {"rows": rows, "batch": batch, "rows_per_s": rows / elapsed,
            "ms_per_commit": 1000 * elapsed / math.ceil(rows / batch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--posters", type=int, default=64, help="concurrent posters in all")
    parser.add_argument("--procs", type=int, default=4, help="client processes")
    parser.add_argument("--seconds", type=float, default=8.0, help="per server and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows-per-request", type=int, default=1,
                        help="rows in each POST /results (1: one row per request, the "
                             "figure of the target; more: an array body, as the agent "
                             "sends rows it kept during an outage)")
    parser.add_argument("--against", type=checkout, default=None, metavar="PATH",
                        help="also load a collector run from this checkout (another commit's "
                             "worktree) in every round, and report this tree over it")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.posters, args.procs, args.seconds, args.rounds = 4, 2, 0.5, 1
    rounds = []
    with ExitStack() as stack:
        bare_address, bare_pid = stack.enter_context(server("bare"))
        address, pid = stack.enter_context(server("collector"))
        other = stack.enter_context(server("collector", tree=args.against)
                                    if args.against else nullcontext())
        for r in range(args.rounds):
            bare = post_rows("bare", bare_address, bare_pid, f"r{r}", args)
            before = None
            if other and r % 2:  # the two trees take turns going first
                before = post_rows("collector", *other, f"a{r}", args)
            ours = post_rows("collector", address, pid, f"r{r}", args)
            if other and before is None:
                before = post_rows("collector", *other, f"a{r}", args)
            batch = max(1, round(ours["mean_rows_per_commit"]))
            grouped = sqlite_ceiling(max(2000, min(ours["rows"], 50_000)), batch)
            single = sqlite_ceiling(200 if args.quick else 1000, 1)
            record = {"round": r, "bare": bare, "collector": ours, "sqlite_grouped": grouped,
                      "sqlite_one_per_commit": single,
                      "ratio_to_sqlite": ours["rows_per_s"] / grouped["rows_per_s"],
                      "ratio_to_bare": ours["rows_per_s"] / bare["rows_per_s"]}
            if before is not None:
                record["against"] = before
                record["over_against_rows_per_s"] = ours["rows_per_s"] / before["rows_per_s"]
                record["over_against_main_us_per_row"] = (ours["server_main_us_per_row"]
                                                          / before["server_main_us_per_row"])
            emit({"bench": "ingest", "figure": "round", **record})
            rounds.append(record)

    def med(*path: str) -> float:
        values = []
        for record in rounds:
            value: Any = record
            for key in path:
                value = value[key]
            values.append(float(value))
        return statistics.median(values)

    result = {
        "bench": "ingest", "figure": "ingest", "posters": args.posters, "procs": args.procs,
        "rounds": len(rounds), "rows_per_request": args.rows_per_request,
        "rows_per_s": med("collector", "rows_per_s"),
        "server_cpu_us_per_row": med("collector", "server_cpu_us_per_row"),
        "server_main_us_per_row": med("collector", "server_main_us_per_row"),
        "bare_main_us_per_row": med("bare", "server_main_us_per_row"),
        "mean_group_commit": med("collector", "mean_group_commit"),
        "mean_rows_per_commit": med("collector", "mean_rows_per_commit"),
        "loop_busy": med("collector", "loop_busy"),
        "commit_ms": med("collector", "commit_ms"),
        "sqlite_grouped_ms_per_commit": med("sqlite_grouped", "ms_per_commit"),
        "sqlite_grouped_rows_per_s": med("sqlite_grouped", "rows_per_s"),
        "sqlite_one_per_commit_rows_per_s": med("sqlite_one_per_commit", "rows_per_s"),
        "bare_rows_per_s": med("bare", "rows_per_s"),
        "bare_cpu_us_per_row": med("bare", "server_cpu_us_per_row"),
        "ratio_to_sqlite": med("ratio_to_sqlite"), "ratio_to_bare": med("ratio_to_bare"),
        "target_rows_per_s": 10000, "cores": os.cpu_count(),
    }
    lines = []
    if args.against:
        result.update({
            "against": str(args.against),
            "against_rows_per_s": med("against", "rows_per_s"),
            "against_main_us_per_row": med("against", "server_main_us_per_row"),
            "over_against_rows_per_s": med("over_against_rows_per_s"),
            "over_against_main_us_per_row": med("over_against_main_us_per_row"),
        })
        lines = [
            ("against: rows/s", f"{result['against_rows_per_s']:.0f}", str(args.against)),
            ("against: loop's thread us/row", f"{result['against_main_us_per_row']:.0f}", ""),
            ("this tree over against, rows/s", f"{result['over_against_rows_per_s']:.3f}",
             "median of the rounds' ratios"),
            ("this tree over against, loop us/row",
             f"{result['over_against_main_us_per_row']:.3f}", "below 1: cheaper"),
        ]
    emit(result)
    table([
        ("collector rows/s", f"{result['rows_per_s']:.0f}", "target >= 10000 (synchronous=FULL)"),
        ("collector CPU us/row", f"{result['server_cpu_us_per_row']:.0f}",
         f"{args.rows_per_request} rows/request; "
         f"{result['mean_rows_per_commit']:.1f} rows per commit"),
        ("of which the loop's thread us/row", f"{result['server_main_us_per_row']:.0f}",
         f"a core to itself: at most {1e6 / max(result['server_main_us_per_row'], 1e-9):.0f} "
         f"rows/s (bare server's {result['bare_main_us_per_row']:.0f} us/row)"),
        ("loop's thread busy", f"{result['loop_busy']:.2f}",
         "of the wall time; it waits for COMMITs the rest"),
        ("COMMIT, ask to answer ms", f"{result['commit_ms']:.2f}",
         f"sqlite3 alone, same batch with its inserts: "
         f"{result['sqlite_grouped_ms_per_commit']:.2f} ms"),
        ("sqlite3, same batches rows/s", f"{result['sqlite_grouped_rows_per_s']:.0f}",
         "storage ceiling"),
        ("sqlite3, 1 row/commit rows/s", f"{result['sqlite_one_per_commit_rows_per_s']:.0f}",
         "no group commit"),
        ("bare server rows/s", f"{result['bare_rows_per_s']:.0f}", "load generator ceiling"),
        ("ratio to sqlite3 ceiling", f"{result['ratio_to_sqlite']:.2f}", ""),
        ("ratio to bare server", f"{result['ratio_to_bare']:.2f}", ""),
        *lines,
    ])


if __name__ == "__main__":
    main()

"""A year of a shelf's beacons on a simulated clock: how big the collector's database gets with
retention on (the default), and how long a prune holds the event loop.

    python bench/retention.py [--devices 20] [--days 365] [--per-minute 1] [--quick]

The database is a real file made by the collector's own migrations and written through its own
writer (fleet_min.db.Database). Each simulated day, every device's beacons for that day (one a
minute, with the body a real agent sends) are inserted with their real timestamps, then the
collector's retention function runs with "now" at the end of that day, exactly as the daily
loop (FLEET_RETENTION_AUTO) calls it. Nothing waits for the wall clock.

Reported per run: the largest database size seen (file plus WAL, measured after each day's
prune, which is when the daily loop leaves it) and at the end, the beacon rows kept, the
slowest retention transaction (one delete batch or vacuum step: the time it held the event
loop's thread, as the retention report gives it), and the event loop's longest stall while
retention ran (a 1 ms ticker measures the gap between its ticks: how long claims and long polls
would have waited, including any time the machine did not run the process at all). `--quick`
simulates 20 devices for 5 days with a 2-day window, for the smoke test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emit, table
from fleet_min.collector.insight import system
from fleet_min.collector.storage.schema import MIGRATIONS
from fleet_min.db import Database

DAY_S = 86400.0
MiB = 1 << 20
# What fleet_agent.py sends from a Raspberry Pi on mains (read_vitals + read_power).
BEACON = json.dumps({"battery_pct": None, "charging": True, "ac": True, "thermal": "nominal",
                     "temp_c": 47.2, "mem_mb": 2711, "mem_pressure": "low", "load": 0.42,
                     "idle_s": None}, separators=(",", ":"))


def _insert(conn: sqlite3.Connection, rows: list[tuple[str, float, str]]) -> None:
    conn.executemany("INSERT INTO beacons (device_id, at, body) VALUES (?, ?, ?)", rows)


def day_of_beacons(devices: int, per_minute: int, day_start: float) -> list[tuple[str, float,
                                                                                  str]]:
    step = 60.0 / per_minute
    count = int(DAY_S / step)
    return [(f"pi-{n:02d}", day_start + i * step + n * 0.37, BEACON)
            for i in range(count) for n in range(devices)]


def size_of(path: Path) -> int:
    total = 0
    for suffix in ("", "-wal"):
        with contextlib.suppress(OSError):
            total += os.path.getsize(str(path) + suffix)
    return total


class Ticker:
    """The event loop's longest stall: the biggest gap between 1 ms sleeps."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now

    def __enter__(self) -> Ticker:
        self.task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *_: Any) -> None:
        assert self.task is not None
        self.task.cancel()


async def simulate(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    path = folder / "fleet.sqlite3"
    db = Database(path, MIGRATIONS, args.synchronous)
    await db.open()
    settings = system.Settings(retain_beacons_days=args.window_days, retention_auto=True)
    start = time.time() - args.days * DAY_S
    largest, stall, prune_s, deleted, slowest, slowest_cpu = 0, 0.0, 0.0, 0, 0.0, 0.0
    first: dict[str, Any] = {}
    try:
        for day in range(args.days):
            rows = day_of_beacons(args.devices, args.per_minute, start + day * DAY_S)
            for at in range(0, len(rows), 20_000):
                await db.write(_insert, rows[at:at + 20_000])
            if day < args.backlog_days:  # an install that ran with retention off until now
                largest = max(largest, size_of(path))
                continue
            began = time.perf_counter()
            with Ticker() as ticker:
                report = await system.apply(db, settings, start + (day + 1) * DAY_S)
            took = time.perf_counter() - began
            if not first:
                first = {"first_prune_deleted": report["tables"]["beacons"]["deleted"],
                         "first_prune_s": round(took, 3),
                         "first_prune_slowest_transaction_ms": report["slowest_transaction_ms"],
                         "first_prune_slowest_transaction_cpu_ms":
                             report["slowest_transaction_cpu_ms"],
                         "first_prune_stall_ms": round(ticker.longest * 1000, 1),
                         "largest_before_first_prune_mib": round(largest / MiB, 1)}
            prune_s = max(prune_s, took)
            stall = max(stall, ticker.longest)
            slowest = max(slowest, report["slowest_transaction_ms"])
            slowest_cpu = max(slowest_cpu, report["slowest_transaction_cpu_ms"])
            deleted += report["tables"]["beacons"]["deleted"]
            largest = max(largest, size_of(path))
            if args.progress and day % 30 == 29:
                print(f"  day {day + 1}: {size_of(path) / MiB:.1f} MiB", file=sys.stderr)
        kept = (await db.read_one("SELECT COUNT(*) FROM beacons") or [0])[0]
        figures = await system.database_figures(db)
    finally:
        await db.close()
    return {"bench": "retention", "figure": "retention", "devices": args.devices,
            "days": args.days, "beacons_per_minute": args.per_minute,
            "window_days": args.window_days, "synchronous": args.synchronous,
            "beacons_written": args.days * args.devices * 1440 * args.per_minute,
            "beacons_deleted": deleted, "beacons_kept": kept,
            "largest_mib": round(largest / MiB, 1), "final_mib": round(size_of(path) / MiB, 1),
            "freelist_pages": figures["freelist_pages"], "auto_vacuum": figures["auto_vacuum"],
            "longest_prune_s": round(prune_s, 3), "slowest_transaction_ms": slowest,
            "slowest_transaction_cpu_ms": slowest_cpu,
            "longest_loop_stall_ms": round(stall * 1000, 1),
            "backlog_days": args.backlog_days, **first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=20)
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--per-minute", type=int, default=1)
    parser.add_argument("--window-days", type=float, default=system.Settings.retain_beacons_days,
                        help="FLEET_RETAIN_BEACONS_DAYS (default: the collector's default)")
    parser.add_argument("--synchronous", default="FULL")
    parser.add_argument("--backlog-days", type=int, default=0,
                        help="days written before retention first runs (an install that had it "
                             "off): the first prune is then a big one")
    parser.add_argument("--progress", action="store_true", help="print the size every 30 days")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.days, args.window_days = 5, 2.0
    with tempfile.TemporaryDirectory(prefix="fleet-retention-") as folder:
        result = asyncio.run(simulate(args, Path(folder)))
    emit(result)
    table([
        ("beacons written", f"{result['beacons_written']:,}",
         f"{args.devices} devices, {args.per_minute}/min, {args.days} days"),
        ("beacons kept", f"{result['beacons_kept']:,}", f"{args.window_days:g}-day window"),
        ("largest database", f"{result['largest_mib']} MiB", "file + WAL after each day's prune"),
        ("final database", f"{result['final_mib']} MiB", f"auto_vacuum {result['auto_vacuum']}"),
        ("longest prune", f"{result['longest_prune_s']} s", "one daily run, wall time"),
        ("slowest transaction", f"{result['slowest_transaction_ms']} ms",
         "one delete batch or vacuum step, on the loop's thread (wall)"),
        ("  its CPU", f"{result['slowest_transaction_cpu_ms']} ms",
         "the slowest by the loop thread's CPU time"),
        ("longest loop stall", f"{result['longest_loop_stall_ms']} ms",
         "during retention (1 ms ticker; includes the OS descheduling us)"),
    ])


if __name__ == "__main__":
    main()

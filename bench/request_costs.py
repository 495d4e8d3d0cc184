"""What one request costs the collector at a steady, unhurried rate, by kind, next to a bare
aiohttp server answering the same requests: where the CPU of a fleet of idle agents goes.

    python bench/request_costs.py [--rate 300] [--seconds 20] [--connections 8]
                                  [--devices 2000] [--hold 0.02] [--synchronous FULL]
                                  [--tree PATH] [--quick]

At a steady rate well under what the server can carry (the agents of bench/agents.py send some
1,200 requests a second between them), each request wakes a sleeping event loop, and a write
also wakes the COMMIT thread and is woken again by its answer. Those wake-ups, not the handlers,
are most of the cost there; bench/ingest.py and bench/lifecycle.py measure the other end, a
saturated server. Kinds, each timed alone for `--seconds` over `--connections` keep-alive
connections at `--rate` requests a second in all:

- `health`: GET /api/health, a request with no database work (the floor of a request);
- `beacon`: POST /results with a beacon of a random registered device (a durable write);
- `renewal`: a device's long poll that finds nothing and ends after `--hold` s
  (FLEET_LONG_POLL_S), polled again at once; the rate is then what the holds allow.

The collector runs with FLEET_SQLITE_SYNCHRONOUS=`--synchronous` (NORMAL shows what the fsync
adds to a beacon). Figures per request: the collector's CPU (utime+stime from /proc, all
threads), its event loop's thread alone, the other threads (the COMMIT thread), and the loop
thread's voluntary and forced context switches. The ceiling is the bare server of
bench/common.serve_bare_polls (its poll sleeps the hold, a POST is read and answered).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.agents import beacon_body
from bench.common import (
    ROOT,
    Http,
    bare_script_server,
    checkout,
    cpu_seconds,
    emit,
    main_thread_cpu_seconds,
    register_devices,
    serve_bare_polls,
    server,
    table,
)

KINDS = ("health", "beacon", "renewal")


def _switches(pid: int) -> tuple[int, int]:
    """Voluntary and forced context switches of a process's main thread."""
    voluntary = forced = 0
    for line in Path(f"/proc/{pid}/task/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            voluntary = int(line.split()[1])
        elif line.startswith("nonvoluntary_ctxt_switches:"):
            forced = int(line.split()[1])
    return voluntary, forced


async def _drive(address: str, kind: str, devices: list[str], args: argparse.Namespace
                 ) -> tuple[int, int]:
    """Send `kind` requests for args.seconds; (answered as expected, other answers)."""
    connections = [Http(address) for _ in range(args.connections)]
    rng = random.Random(7)
    done = [0, 0]
    interval = args.connections / args.rate
    started = time.monotonic()

    async def one(index: int, http: Http) -> None:
        due = started + index * interval / args.connections
        device = devices[index % len(devices)]
        while time.monotonic() - started < args.seconds:
            if kind == "renewal":
                status, _ = await http.request("GET", f"/devices/{device}/next-job")
                done[status != 204] += 1
                continue
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            due += interval
            if kind == "health":
                status, _ = await http.request("GET", "/api/health")
            else:
                status, _ = await http.request(
                    "POST", "/results", beacon_body(rng.choice(devices), rng))
            done[status != 200] += 1

    try:
        await asyncio.gather(*(one(i, http) for i, http in enumerate(connections)))
    finally:
        for http in connections:
            http.close()
    return done[0], done[1]


def measure(address: str, pid: int, kind: str, devices: list[str], args: argparse.Namespace
            ) -> dict[str, Any]:
    before_cpu, before_loop = cpu_seconds(pid), main_thread_cpu_seconds(pid)
    before_switches = _switches(pid)
    began = time.monotonic()
    answered, other = asyncio.run(_drive(address, kind, devices, args))
    wall = time.monotonic() - began
    cpu = cpu_seconds(pid) - before_cpu
    loop = main_thread_cpu_seconds(pid) - before_loop
    voluntary, forced = (b - a for a, b in zip(before_switches, _switches(pid), strict=True))
    n = max(answered, 1)
    return {"requests": answered, "unexpected": other, "per_s": answered / wall,
            "us_each": 1e6 * cpu / n, "loop_us_each": 1e6 * loop / n,
            "other_threads_us_each": 1e6 * (cpu - loop) / n,
            "voluntary_switches_each": voluntary / n, "forced_switches_each": forced / n}


def run_server(name: str, address: str, pid: int, devices: list[str],
               args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    if name == "collector":
        asyncio.run(register_devices(address, devices))
    out = {}
    for kind in KINDS:
        figures = measure(address, pid, kind, devices, args)
        emit({"bench": "request_costs", "figure": "kind", "server": name, "kind": kind,
              "rate": args.rate, "synchronous": args.synchronous, **figures})
        out[kind] = figures
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=300.0,
                        help="requests a second in all (health and beacon)")
    parser.add_argument("--seconds", type=float, default=20.0, help="per kind and server")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--devices", type=int, default=2000, help="registered devices")
    parser.add_argument("--hold", type=float, default=0.02,
                        help="a renewal's hold (FLEET_LONG_POLL_S), seconds")
    parser.add_argument("--synchronous", default="FULL", choices=("FULL", "NORMAL"),
                        help="the collector's FLEET_SQLITE_SYNCHRONOUS")
    parser.add_argument("--tree", type=checkout, default=ROOT,
                        help="run the collector from this checkout (default: this one)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--serve-bare", nargs=2, metavar=("PORT", "HOLD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        serve_bare_polls(int(args.serve_bare[0]), float(args.serve_bare[1]), ["/results"])
        return
    if args.quick:
        args.seconds, args.devices, args.rate = 0.5, 20, 100.0
    devices = [f"req-{i:05d}" for i in range(args.devices)]
    env = {"FLEET_LONG_POLL_S": str(args.hold), "FLEET_SQLITE_SYNCHRONOUS": args.synchronous}
    with server("collector", env, args.tree) as (address, pid):
        ours = run_server("collector", address, pid, devices, args)
    with bare_script_server(__file__, str(args.hold)) as (address, pid):
        bare = run_server("bare", address, pid, devices, args)
    rows = []
    for kind in KINDS:
        c, b = ours[kind], bare[kind]
        emit({"bench": "request_costs", "figure": "ratio", "kind": kind,
              "us_each": c["us_each"], "bare_us_each": b["us_each"],
              "ratio": b["us_each"] / max(c["us_each"], 1e-9)})
        rows.append((f"{kind}: collector / bare", f"{c['us_each']:.0f} / {b['us_each']:.0f} us",
                     f"loop thread {c['loop_us_each']:.0f} us, other threads "
                     f"{c['other_threads_us_each']:.0f} us, loop switches "
                     f"{c['voluntary_switches_each']:.2f} + {c['forced_switches_each']:.2f} "
                     f"forced; {c['per_s']:.0f}/s"))
    table(rows)


if __name__ == "__main__":
    main()

"""Claim cost against queue length: agents poll GET /devices/{id}/next-job on a collector whose
queue holds 100,000 jobs they cannot take, and on one whose queue is empty (the ceiling).

    python bench/claim_cost.py [--jobs 100000] [--agents 8] [--procs 2] [--seconds 4]
                               [--rounds 3] [--tree PATH] [--quick]

Three collector processes run side by side:

- `empty`: nothing queued (the ceiling);
- `pinned`: the jobs are of a workload the agents declared, but pinned to other devices;
- `undeclared`: the jobs are unpinned, but of workloads the agents never declared.

The jobs are loaded through POST /jobs in arrays of 1000 (the load rate is reported too). Each
collector answers an empty-handed poll after FLEET_LONG_POLL_S=0.001, so a poll is one claim
attempt. Two phases are timed on each collector, in alternating rounds:

- `poll`: back-to-back polls that find nothing (the idle agent's cost);
- `claim`: enqueue one job pinned to the agent, then poll and get it (a claim that succeeds),
  then post its final row (the collector offers a device one job at a time).

The figure is the collector's own CPU time per poll or per claim (utime+stime from /proc, so it
does not depend on how fast the client is), reported as the ratio loaded/empty; the target is
within 1.2x. Wall latency p50 of a poll is printed too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, Http, checkout, emit, percentile, run_clients, server, table

VARIANTS = ("empty", "pinned", "undeclared")
OTHER_WORKLOADS = ("batch", "self-check", "pipeline", "llm-eval", "serve")
BATCH = 1000


def queued_job(variant: str, n: int) -> dict[str, Any]:
    if variant == "pinned":
        return {"schema": 1, "job_id": f"q-{n}", "workload": "benchmark", "executor": "device",
                "backend": "synthetic", "targets": {"device_id": f"claim-other-{n % 100}"}}
    return {"schema": 1, "job_id": f"q-{n}", "workload": OTHER_WORKLOADS[n % 5],
            "executor": "device"}


async def register(http: Http, device: str, capabilities: list[str]) -> None:
    status, body = await http.request("POST", "/devices/register", {
        "device_id": device, "descriptor": {"platform": "linux"}, "capabilities": capabilities})
    if status != 200:
        raise RuntimeError(f"register answered {status}: {body[:200]!r}")


async def load(address: str, variant: str, jobs: int, connections: int = 2) -> float:
    """Enqueue the jobs the agents cannot take; returns the load rate in jobs/s."""
    first = Http(address)
    # The undeclared workloads need a registered agent that declares them, or they are refused.
    await register(first, "claim-other", list(OTHER_WORKLOADS))
    first.close()
    if variant == "empty" or jobs == 0:
        return 0.0
    starts = list(range(0, jobs, BATCH))
    started = time.monotonic()

    async def loader(mine: list[int]) -> None:
        http = Http(address)
        for start in mine:
            batch = [queued_job(variant, n) for n in range(start, min(start + BATCH, jobs))]
            status, body = await http.request("POST", "/jobs", batch)
            if status != 201:
                raise RuntimeError(f"loading answered {status}: {body[:200]!r}")
        http.close()

    await asyncio.gather(*(loader(starts[i::connections]) for i in range(connections)))
    return jobs / (time.monotonic() - started)


async def _agent(address: str, device: str, phase: str, stop_at: float,
                 latencies: list[float]) -> None:
    http = Http(address)
    await register(http, device, ["benchmark"])
    n = 0
    while time.monotonic() < stop_at:
        n += 1
        if phase == "claim":
            status, body = await http.request("POST", "/jobs", {
                "schema": 1, "job_id": f"{device}-{n}", "workload": "benchmark",
                "executor": "device", "backend": "synthetic", "targets": {"device_id": device}})
            if status != 201:
                raise RuntimeError(f"POST /jobs answered {status}: {body[:200]!r}")
        started = time.perf_counter()
        status, body = await http.request("GET", f"/devices/{device}/next-job")
        latencies.append(1000 * (time.perf_counter() - started))
        if status != (200 if phase == "claim" else 204):
            raise RuntimeError(f"{phase}: the poll answered {status}: {body[:200]!r}")
        if phase == "claim":
            status, body = await http.request("POST", "/results", {
                "schema": 1, "kind": "result", "job_id": f"{device}-{n}", "device_id": device,
                "iter": 0, "final": True, "ok": True})
            if status != 200:
                raise RuntimeError(f"POST /results answered {status}: {body[:200]!r}")
    http.close()


def _client(address: str, prefix: str, phase: str, agents: int, seconds: float,
            ready: Any, go: Any, out: Any) -> None:
    latencies: list[float] = []

    async def run() -> None:
        # Register first (outside the timed window), then wait for the start signal.
        for i in range(agents):
            http = Http(address)
            await register(http, f"{prefix}-{i}", ["benchmark"])
            http.close()
        ready.put(True)
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(_agent(address, f"{prefix}-{i}", phase, stop_at, latencies)
                               for i in range(agents)))

    asyncio.run(run())
    out.put(latencies)


def measure(address: str, pid: int, tag: str, phase: str, agents: int, procs: int,
            seconds: float) -> dict[str, float]:
    per_proc = [agents // procs + (1 if i < agents % procs else 0) for i in range(procs)]
    run = run_clients(_client, [(address, f"{tag}-{phase}-p{i}", phase, n, seconds)
                                for i, n in enumerate(per_proc) if n], pid, seconds + 120)
    latencies = [x for outcome in run.outcomes for x in outcome]
    wall, cpu = run.wall_s, run.server_cpu_s
    count = len(latencies)
    return {"count": count, "per_s": count / wall, "cpu_us_each": 1e6 * cpu / max(count, 1),
            "p50_ms": percentile(latencies, 0.5) if latencies else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000, help="queued jobs nobody can take")
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--procs", type=int, default=2, help="client processes")
    parser.add_argument("--seconds", type=float, default=4.0, help="per phase, server and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", type=checkout, default=ROOT,
                        help="run the collectors from this checkout (default: this one)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.agents, args.seconds, args.rounds = 2000, 2, 0.5, 1
    env = {"FLEET_LONG_POLL_S": "0.001"}
    with contextlib.ExitStack() as stack:
        servers = {v: stack.enter_context(server("collector", env, args.tree)) for v in VARIANTS}
        for variant, (address, _pid) in servers.items():
            started = time.monotonic()
            rate = asyncio.run(load(address, variant, args.jobs))
            if variant != "empty":
                emit({"bench": "claim_cost", "figure": "load", "variant": variant,
                      "jobs": args.jobs, "jobs_per_s": rate,
                      "seconds": time.monotonic() - started})
        rows: dict[tuple[str, str], list[dict[str, float]]] = {}
        for r in range(args.rounds):
            for phase in ("poll", "claim"):
                for variant in VARIANTS:
                    address, pid = servers[variant]
                    figures = measure(address, pid, f"r{r}", phase, args.agents, args.procs,
                                      args.seconds)
                    emit({"bench": "claim_cost", "figure": "round", "round": r,
                          "phase": phase, "variant": variant, **figures})
                    rows.setdefault((phase, variant), []).append(figures)

    def med(phase: str, variant: str, key: str) -> float:
        return statistics.median(f[key] for f in rows[(phase, variant)])

    lines: list[tuple[str, str, str]] = []
    for phase in ("poll", "claim"):
        empty_us = med(phase, "empty", "cpu_us_each")
        for variant in ("pinned", "undeclared"):
            # the ratio per round, then the median: both sides of one ratio saw the same noise
            ratios = [loaded["cpu_us_each"] / max(empty["cpu_us_each"], 1e-9) for loaded, empty
                      in zip(rows[(phase, variant)], rows[(phase, "empty")], strict=True)]
            record = {"bench": "claim_cost", "figure": f"{phase}_cost", "variant": variant,
                      "queued": args.jobs, "cpu_us_each": med(phase, variant, "cpu_us_each"),
                      "empty_cpu_us_each": empty_us, "ratio": statistics.median(ratios),
                      "p50_ms": med(phase, variant, "p50_ms"),
                      "empty_p50_ms": med(phase, "empty", "p50_ms"), "target": "<= 1.2",
                      "rounds": args.rounds, "cores": os.cpu_count()}
            emit(record)
            lines.append((f"{phase}: {variant} / empty CPU", f"{record['ratio']:.2f}",
                          f"{record['cpu_us_each']:.0f} vs {empty_us:.0f} us each; "
                          "target <= 1.2"))
        lines.append((f"{phase}: empty-queue p50 ms", f"{med(phase, 'empty', 'p50_ms'):.2f}",
                      f"{med(phase, 'empty', 'per_s'):.0f} per s"))
    table(lines)


if __name__ == "__main__":
    main()

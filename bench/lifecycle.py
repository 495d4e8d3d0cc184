"""Job lifecycle throughput: enqueue, claim by long poll, final result, by concurrent agents over
loopback HTTP, against the collector (synchronous=FULL) and against a bare aiohttp server that
answers the same three requests with no work. Reports the collector's own CPU time per job (from
/proc) and the ratio to the bare server's, which does not depend on how fast the client is.

    python bench/lifecycle.py [--agents 50] [--procs 3] [--seconds 10] [--rounds 3]

Each round measures the bare server, then the collector, on fresh servers; the figures are the
medians over rounds, and the ratio is taken within each round (this machine's speed moves by
tens of percent from one minute to the next; two measurements a few seconds apart move less).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Http, cpu_seconds, emit, main_thread_cpu_seconds, server, table


async def _agent(address: str, device: str, stop_at: float, counter: list[int]) -> None:
    http = Http(address)
    await http.request("POST", "/devices/register", {
        "device_id": device, "descriptor": {"platform": "linux"},
        "capabilities": ["benchmark"]})
    n = 0
    while time.monotonic() < stop_at:
        n += 1
        job_id = f"{device}-{n}"
        status, _ = await http.request("POST", "/jobs", {
            "schema": 1, "job_id": job_id, "workload": "benchmark", "executor": "device",
            "backend": "synthetic", "targets": {"device_id": device}})
        assert status == 201, status
        status, _ = await http.request("GET", f"/devices/{device}/next-job")
        assert status == 200, status
        status, _ = await http.request("POST", "/results", {
            "schema": 1, "kind": "result", "job_id": job_id, "device_id": device, "iter": 0,
            "final": True, "ok": True, "metrics": {"decode_tok_s": 1.0}})
        assert status == 200, status
        counter[0] += 1
    http.close()


def _client_process(address: str, prefix: str, agents: int, seconds: float,
                    out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    counter = [0]
    start_cpu = time.process_time()

    async def run() -> None:
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(_agent(address, f"{prefix}-{i}", stop_at, counter)
                               for i in range(agents)))

    asyncio.run(run())
    out.put((counter[0], time.process_time() - start_cpu))


def measure(kind: str, agents: int, procs: int, seconds: float) -> dict[str, float]:
    with server(kind) as (address, pid):
        queue: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
        per_proc = [agents // procs + (1 if i < agents % procs else 0) for i in range(procs)]
        workers = [multiprocessing.Process(target=_client_process,
                                           args=(address, f"{kind}{i}", n, seconds, queue))
                   for i, n in enumerate(per_proc) if n]
        cpu_before, wall_before = cpu_seconds(pid), time.monotonic()
        main_before = main_thread_cpu_seconds(pid)
        for worker in workers:
            worker.start()
        outcomes = [queue.get(timeout=seconds + 60) for _ in workers]
        for worker in workers:
            worker.join()
        wall = time.monotonic() - wall_before
        cpu = cpu_seconds(pid) - cpu_before
        main = main_thread_cpu_seconds(pid) - main_before
    jobs = sum(n for n, _ in outcomes)
    return {"jobs": jobs, "wall_s": wall, "jobs_per_s": jobs / wall,
            "server_cpu_s": cpu, "server_cpu_ms_per_job": 1000 * cpu / max(jobs, 1),
            "server_main_thread_ms_per_job": 1000 * main / max(jobs, 1),
            "client_cpu_s": sum(c for _, c in outcomes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--procs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="per server and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.agents, args.procs, args.seconds, args.rounds = 4, 2, 0.5, 1
    bares: list[dict[str, float]] = []
    collectors: list[dict[str, float]] = []
    ratios: list[float] = []
    for r in range(args.rounds):
        bare = measure("bare", args.agents, args.procs, args.seconds)
        emit({"bench": "lifecycle", "round": r, "server": "bare", **bare})
        ours = measure("collector", args.agents, args.procs, args.seconds)
        emit({"bench": "lifecycle", "round": r, "server": "collector", "synchronous": "FULL",
              **ours})
        bares.append(bare)
        collectors.append(ours)
        ratios.append(bare["server_cpu_ms_per_job"] / max(ours["server_cpu_ms_per_job"], 1e-9))

    def med(records: list[dict[str, float]], key: str) -> float:
        return statistics.median(record[key] for record in records)

    ratio = statistics.median(ratios)
    emit({"bench": "lifecycle", "figure": "lifecycle", "rounds": len(ratios),
          "bare_jobs_per_s": med(bares, "jobs_per_s"), "jobs_per_s": med(collectors, "jobs_per_s"),
          "bare_cpu_ms_per_job": med(bares, "server_cpu_ms_per_job"),
          "cpu_ms_per_job": med(collectors, "server_cpu_ms_per_job"), "cpu_ratio": ratio,
          "cpu_ratios": ratios, "target_ratio": ">= 0.33", "target_jobs_per_s": 1500,
          "cores": os.cpu_count()})
    table([
        ("bare server jobs/s", f"{med(bares, 'jobs_per_s'):.0f}",
         "the load generator's ceiling"),
        ("collector jobs/s", f"{med(collectors, 'jobs_per_s'):.0f}", "target >= 1500"),
        ("bare CPU ms/job", f"{med(bares, 'server_cpu_ms_per_job'):.3f}", ""),
        ("collector CPU ms/job", f"{med(collectors, 'server_cpu_ms_per_job'):.3f}", ""),
        ("  of which the loop's thread", f"{med(collectors, 'server_main_thread_ms_per_job'):.3f}",
         "the rest: the COMMIT thread"),
        ("CPU ratio bare/collector", f"{ratio:.2f}",
         "target >= 0.33; by round " + ", ".join(f"{r:.2f}" for r in ratios)),
    ])


if __name__ == "__main__":
    main()

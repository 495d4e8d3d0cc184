"""Where a job's CPU goes, by request: each server's CPU for the enqueues alone, then for the
claims and results (a device holds one job at a time, so a claim and its result come as a
pair), next to the bare server and the lifecycle's two other ceilings.

    python bench/lifecycle_split.py [--agents 16] [--procs 2] [--jobs 400] [--rounds 2]
                                    [--servers bare,durable,floor,collector]

Each agent registers, then enqueues `--jobs` jobs pinned to itself as fast as its answers come;
once every agent is done, each claims and closes them all (GET next-job, POST a final result).
`--agents` agents in each of `--procs` client processes. A phase's CPU (all the server's
threads, from /proc) is divided by the requests it answered, and the loop's thread is shown
alone. bench/lifecycle.py times the same requests interleaved and is the figure the targets
use; this one says which of them a gap between two servers lies in.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    Http,
    cpu_seconds,
    emit,
    main_thread_cpu_seconds,
    register_devices,
    server,
    table,
)
from bench.lifecycle import final_row, pinned_job

PHASES = ("enqueue", "claim+result")


async def _agent(address: str, device: str, phase: str, jobs: int) -> None:
    http = Http(address)
    for n in range(jobs):
        job_id = f"{device}-{n}"
        if phase == "enqueue":
            status, _ = await http.request("POST", "/jobs", pinned_job(device, job_id))
            assert status == 201, status
        else:
            status, _ = await http.request("GET", f"/devices/{device}/next-job")
            assert status == 200, status
            status, _ = await http.request("POST", "/results", final_row(device, job_id))
            assert status == 200, status
    http.close()


def _client(address: str, prefix: str, agents: int, phase: str, jobs: int,
            done: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    async def run() -> None:
        await asyncio.gather(*(_agent(address, f"{prefix}-{i}", phase, jobs)
                               for i in range(agents)))

    asyncio.run(run())
    done.put(True)


def phase(address: str, pid: int, name: str, agents: int, procs: int, jobs: int
          ) -> dict[str, float]:
    """One phase over every client process: CPU per job (all threads, the loop's) and jobs/s."""
    done: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    workers = [multiprocessing.Process(target=_client,
                                       args=(address, f"a{k}", agents, name, jobs, done))
               for k in range(procs)]
    cpu, loop, started = cpu_seconds(pid), main_thread_cpu_seconds(pid), time.monotonic()
    for worker in workers:
        worker.start()
    for _ in workers:
        done.get(timeout=600)
    for worker in workers:
        worker.join()
    count = agents * procs * jobs
    return {"cpu_us_per_job": 1e6 * (cpu_seconds(pid) - cpu) / count,
            "loop_us_per_job": 1e6 * (main_thread_cpu_seconds(pid) - loop) / count,
            "jobs_per_s": count / (time.monotonic() - started)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=16, help="in each client process")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=400, help="each agent's")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--servers", default="bare,durable,floor,collector")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.agents, args.procs, args.jobs, args.rounds = 2, 1, 5, 1
    kinds = args.servers.split(",")
    got: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for kind in kinds:  # a fresh server of each kind every round
            with server(kind) as (address, pid):
                asyncio.run(register_devices(address, [
                    f"a{k}-{i}" for k in range(args.procs) for i in range(args.agents)]))
                for name in PHASES:
                    figures = phase(address, pid, name, args.agents, args.procs, args.jobs)
                    emit({"bench": "lifecycle_split", "round": r, "server": kind,
                          "phase": name, **figures})
                    got.setdefault((kind, name), []).append(figures)

    def med(kind: str, name: str, key: str) -> float:
        return statistics.median(f[key] for f in got[(kind, name)])

    summary: dict[str, Any] = {"bench": "lifecycle_split", "figure": "lifecycle_split",
                               "rounds": args.rounds}
    rows = []
    for kind in kinds:
        per_job = sum(med(kind, name, "cpu_us_per_job") for name in PHASES)
        summary[kind] = {name: {"cpu_us_per_job": med(kind, name, "cpu_us_per_job"),
                                "loop_us_per_job": med(kind, name, "loop_us_per_job")}
                         for name in PHASES} | {"cpu_us_per_job": per_job}
        rows.append((kind, f"{per_job:.0f} us/job", " | ".join(
            f"{name} {med(kind, name, 'cpu_us_per_job'):.0f} "
            f"(loop {med(kind, name, 'loop_us_per_job'):.0f})" for name in PHASES)))
    emit(summary)
    table(rows)


if __name__ == "__main__":
    main()

"""Job lifecycle throughput: enqueue, claim by long poll, final result, by concurrent agents over
loopback HTTP, against the collector (synchronous=FULL) and against a bare aiohttp server that
answers the same three requests with no work. Reports the collector's own CPU time per job (from
/proc) and the ratio to the bare server's, which does not depend on how fast the client is.

    python bench/lifecycle.py [--agents 50] [--procs 3] [--seconds 12] [--slices 3] [--rounds 3]
                              [--pin] [--durable] [--floor]

Each round starts a fresh bare server and a fresh collector and loads them in turn, one at a
time, in short slices (bare, collector, collector, bare, bare, collector for three slices each),
so that both are measured across the same minute: this machine's speed moves by tens of percent
from one minute to the next, and a bare server measured a whole run before the collector made
single rounds' ratios range from 0.25 to 0.35 for the same tree. The ratio is taken within each
round, and the figures are the medians over rounds.

With --durable a third server takes its turns in every round: the bare server made durable
(bench/durable_server.py), which parses each body and commits the lifecycle's few statements
before answering, and does nothing else. Its ratio to the bare server is the best a durable
server on aiohttp and sqlite3 reaches here, the ceiling of the collector's own ratio. With
--floor another does that and also keeps the rules the spec sets for each request (the job and
result schemas, the claimant's authority, the device's capabilities; bench/floor_server.py):
the ceiling of any server that keeps them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
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
    pin_process,
    server,
    table,
)


def pinned_job(device: str, job_id: str) -> dict[str, Any]:
    """The lifecycle's job: the synthetic benchmark, pinned to `device`."""
    return {"schema": 1, "job_id": job_id, "workload": "benchmark", "executor": "device",
            "backend": "synthetic", "targets": {"device_id": device}}


def final_row(device: str, job_id: str) -> dict[str, Any]:
    """The lifecycle's one result row, which closes the job."""
    return {"schema": 1, "kind": "result", "job_id": job_id, "device_id": device, "iter": 0,
            "final": True, "ok": True, "metrics": {"decode_tok_s": 1.0}}


async def _agent(address: str, device: str, stop_at: float, counter: list[int],
                 interval: float = 0.0, stopped: Any = None) -> None:
    """One agent's job after job until stop_at (or until `stopped`, an Event, is set); with an
    `interval`, a job starts at most every that many seconds (a paced background load)."""
    http = Http(address)
    await http.request("POST", "/devices/register", {
        "device_id": device, "descriptor": {"platform": "linux"},
        "capabilities": ["benchmark"]})
    n = 0
    next_start = time.monotonic()
    while time.monotonic() < stop_at and not (stopped is not None and stopped.is_set()):
        if interval:
            next_start += interval
            await asyncio.sleep(max(0.0, next_start - time.monotonic()))
        n += 1
        job_id = f"{device}-{n}"
        status, _ = await http.request("POST", "/jobs", pinned_job(device, job_id))
        assert status == 201, status
        status, _ = await http.request("GET", f"/devices/{device}/next-job")
        assert status == 200, status
        status, _ = await http.request("POST", "/results", final_row(device, job_id))
        assert status == 200, status
        counter[0] += 1
    http.close()


def _client_process(address: str, prefix: str, agents: int, seconds: float,
                    out: multiprocessing.Queue,  # type: ignore[type-arg]
                    cores: set[int] | None = None) -> None:
    if cores:
        os.sched_setaffinity(0, cores)
    counter = [0]
    start_cpu = time.process_time()

    async def run() -> None:
        stop_at = time.monotonic() + seconds
        await asyncio.gather(*(_agent(address, f"{prefix}-{i}", stop_at, counter)
                               for i in range(agents)))

    asyncio.run(run())
    out.put((counter[0], time.process_time() - start_cpu))


def load(address: str, pid: int, prefix: str, agents: int, procs: int, seconds: float,
         client_cores: set[int] | None = None) -> dict[str, float]:
    """One slice of load against a running server: its CPU, jobs and wall time; the client
    processes run on `client_cores` when given."""
    queue: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    per_proc = [agents // procs + (1 if i < agents % procs else 0) for i in range(procs)]
    workers = [multiprocessing.Process(target=_client_process,
                                       args=(address, f"{prefix}-{i}", n, seconds, queue,
                                             client_cores))
               for i, n in enumerate(per_proc) if n]
    cpu_before, wall_before = cpu_seconds(pid), time.monotonic()
    main_before = main_thread_cpu_seconds(pid)
    for worker in workers:
        worker.start()
    outcomes = [queue.get(timeout=seconds + 60) for _ in workers]
    for worker in workers:
        worker.join()
    return {"jobs": sum(n for n, _ in outcomes), "wall_s": time.monotonic() - wall_before,
            "server_cpu_s": cpu_seconds(pid) - cpu_before,
            "server_main_thread_cpu_s": main_thread_cpu_seconds(pid) - main_before,
            "client_cpu_s": sum(c for _, c in outcomes)}


def _summary(slices: list[dict[str, float]]) -> dict[str, float]:
    total = {key: sum(s[key] for s in slices) for key in slices[0]}
    jobs = max(total["jobs"], 1)
    return {**total, "jobs_per_s": total["jobs"] / total["wall_s"],
            "server_cpu_ms_per_job": 1000 * total["server_cpu_s"] / jobs,
            "server_main_thread_ms_per_job": 1000 * total["server_main_thread_cpu_s"] / jobs}


def measure_round(r: int, agents: int, procs: int, seconds: float, slices: int,
                  pin: bool = False, kinds: tuple[str, ...] = ("bare", "collector")
                  ) -> dict[str, dict[str, float]]:
    """One round: each kind of server (fresh ones), all running, loaded in turn in `slices`
    slices each (bare, collector, collector, bare, ...), so that all are measured across the
    same minute of this machine; each slice loads one server alone."""
    got: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    with contextlib.ExitStack() as stack:
        running = {kind: stack.enter_context(server(kind)) for kind in kinds}
        client_cores = None
        if pin:  # each server on the first core, every client process on the second
            for _, pid in running.values():
                pin_process(pid, {0})
            client_cores = {1}
        for n in range(slices):
            for kind in kinds if n % 2 == 0 else reversed(kinds):
                address, pid = running[kind]
                got[kind].append(load(address, pid, f"{kind}{r}s{n}", agents, procs,
                                      seconds / slices, client_cores))
    return {kind: _summary(slices_of) for kind, slices_of in got.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--procs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=12.0, help="per server and round")
    parser.add_argument("--slices", type=int, default=3,
                        help="each server's seconds of a round come in this many turns")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pin", action="store_true",
                        help="the server on core 0, the clients on core 1 (two cores or more)")
    parser.add_argument("--durable", action="store_true",
                        help="also the bare server made durable (bench/durable_server.py)")
    parser.add_argument("--floor", action="store_true",
                        help="also that server keeping the spec's rules (bench/floor_server.py)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.agents, args.procs, args.seconds, args.slices, args.rounds = 4, 2, 1.0, 2, 1
    ceilings = tuple(kind for kind, wanted in (("durable", args.durable), ("floor", args.floor))
                     if wanted)
    kinds = ("bare", "collector", *ceilings)
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        got = measure_round(r, args.agents, args.procs, args.seconds, args.slices, args.pin,
                            kinds)
        for kind in kinds:
            emit({"bench": "lifecycle", "round": r, "server": kind, "slices": args.slices,
                  **({"synchronous": "FULL"} if kind != "bare" else {}), **got[kind]})
        rounds.append(got)

    def ratios_of(kind: str) -> list[float]:
        return [got["bare"]["server_cpu_ms_per_job"]
                / max(got[kind]["server_cpu_ms_per_job"], 1e-9) for got in rounds]

    def med(kind: str, key: str) -> float:
        return statistics.median(got[kind][key] for got in rounds)

    ratios = ratios_of("collector")
    ratio = statistics.median(ratios)
    floor: dict[str, Any] = {}
    for kind in ceilings:
        floor.update({f"{kind}_jobs_per_s": med(kind, "jobs_per_s"),
                      f"{kind}_cpu_ms_per_job": med(kind, "server_cpu_ms_per_job"),
                      f"{kind}_cpu_ratio": statistics.median(ratios_of(kind)),
                      f"{kind}_cpu_ratios": ratios_of(kind)})
    emit({"bench": "lifecycle", "figure": "lifecycle", "rounds": len(ratios),
          "bare_jobs_per_s": med("bare", "jobs_per_s"),
          "jobs_per_s": med("collector", "jobs_per_s"),
          "bare_cpu_ms_per_job": med("bare", "server_cpu_ms_per_job"),
          "cpu_ms_per_job": med("collector", "server_cpu_ms_per_job"), "cpu_ratio": ratio,
          "cpu_ratios": ratios, **floor, "pinned": args.pin, "target_ratio": ">= 0.5",
          "target_jobs_per_s": 4000, "cores": os.cpu_count()})
    what = {"durable": ("durable bare", "parse, commit the lifecycle's statements, nothing "
                        "else", "the ceiling of any durable server's ratio"),
            "floor": ("spec floor", "durable, and the spec's checks: schemas, claimant, "
                      "capability", "the ceiling of a server keeping the spec's rules")}
    durable_rows = [row for kind in ceilings for row in (
        (f"{what[kind][0]} jobs/s", f"{floor[f'{kind}_jobs_per_s']:.0f}", what[kind][1]),
        (f"{what[kind][0]} CPU ms/job", f"{floor[f'{kind}_cpu_ms_per_job']:.3f}", ""),
        (f"CPU ratio bare/{what[kind][0]}", f"{floor[f'{kind}_cpu_ratio']:.2f}",
         f"{what[kind][2]}; by round "
         + ", ".join(f"{r:.2f}" for r in floor[f"{kind}_cpu_ratios"])))]
    table([
        ("bare server jobs/s", f"{med('bare', 'jobs_per_s'):.0f}",
         "the load generator's ceiling"),
        ("collector jobs/s", f"{med('collector', 'jobs_per_s'):.0f}", "target >= 4000"),
        ("bare CPU ms/job", f"{med('bare', 'server_cpu_ms_per_job'):.3f}", ""),
        ("collector CPU ms/job", f"{med('collector', 'server_cpu_ms_per_job'):.3f}", ""),
        ("  of which the loop's thread",
         f"{med('collector', 'server_main_thread_ms_per_job'):.3f}",
         "the rest: the COMMIT thread"),
        ("CPU ratio bare/collector", f"{ratio:.2f}",
         "target >= 0.5; by round " + ", ".join(f"{r:.2f}" for r in ratios)),
        *durable_rows,
    ])

if __name__ == "__main__":
    main()

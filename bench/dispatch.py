"""Dispatch latency: an agent long-polls GET /devices/{id}/next-job, a job pinned to it is
enqueued, and the time from sending POST /jobs until the agent holds the job is recorded.

    python bench/dispatch.py [--trials 300] [--rounds 3] [--others 20] [--quick]

Ceiling, measured in the same run: the same two requests against the bare aiohttp server
(bench/bare_server.py), which does no work: POST /jobs, then GET next-job, timed from sending the
first until the second's answer is read. That is what the client, the loopback and aiohttp cost
on this machine. The collector path holds two durable commits (the enqueue, then the claim made
for the waiting poll), so the bench also measures this disk's commit time (SQLite, WAL,
synchronous=FULL, one row) and reports the durability floor, two commits, next to the figures.

Rounds alternate ceiling and collector so a noisy machine hits both alike; the reported figures
are the medians over rounds. `--others` idle agents long-poll at the same time (on other
devices), so the dispatcher has waiters to skip.

Both sides rest `--settle-ms` before each trial (the collector's poll must be waiting before the
job comes): a process that slept that long answers slower on this machine (a mean enqueue
answer of 1.4 ms after 5 ms idle, 3.4 ms after 30, 5.6 ms after 100), so a ceiling timed back
to back would compare a warm server with a cold one.

`--load N`: meanwhile, client processes run N jobs a second of the whole lifecycle (enqueue,
claim, final row, by paced agents on devices of their own) against the collector, the
condition the target names ("under 2,000 jobs/s"). The bare server gets the same requests at
the same rate. The load reached is reported beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Http, emit, percentile, server, table
from bench.lifecycle import _agent as lifecycle_agent

AGENT = "dispatch-agent"


def commit_floor_ms(commits: int = 200) -> dict[str, float]:
    """p50/p99 of one-row commits, WAL and synchronous=FULL, on the temp directory's disk
    (where bench.common.server puts the collector's database)."""
    with tempfile.TemporaryDirectory() as folder:
        conn = sqlite3.connect(Path(folder) / "floor.sqlite3", isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("CREATE TABLE t (n INTEGER)")
        times = []
        for n in range(commits):
            started = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO t VALUES (?)", (n,))
            conn.execute("COMMIT")
            times.append(1000 * (time.perf_counter() - started))
        conn.close()
    return {"commit_p50_ms": percentile(times, 0.5), "commit_p99_ms": percentile(times, 0.99)}


def job(n: int, tag: str) -> dict[str, Any]:
    return {"schema": 1, "job_id": f"dispatch-{tag}-{n}", "workload": "benchmark",
            "executor": "device", "backend": "synthetic", "targets": {"device_id": AGENT}}


async def register(http: Http, device: str) -> None:
    status, body = await http.request("POST", "/devices/register", {
        "device_id": device, "descriptor": {"platform": "linux"},
        "capabilities": ["benchmark"]})
    if status != 200:
        raise RuntimeError(f"register answered {status}: {body[:200]!r}")


async def finish(http: Http, job_id: str) -> None:
    """The agent's final row (untimed): the collector offers a device one job at a time."""
    status, body = await http.request("POST", "/results", {
        "schema": 1, "kind": "result", "job_id": job_id, "device_id": AGENT, "iter": 0,
        "final": True, "ok": True})
    if status != 200:
        raise RuntimeError(f"POST /results answered {status}: {body[:200]!r}")


async def idle_agent(address: str, device: str, stop: asyncio.Event) -> None:
    """Another agent, long-polling for jobs that never come (re-polling after each 204)."""
    http = Http(address)
    await register(http, device)
    while not stop.is_set():
        poll = asyncio.ensure_future(http.request("GET", f"/devices/{device}/next-job"))
        halt = asyncio.ensure_future(stop.wait())
        await asyncio.wait({poll, halt}, return_when=asyncio.FIRST_COMPLETED)
        if not poll.done():
            poll.cancel()
        halt.cancel()
    http.close()


async def collector_trials(address: str, trials: int, tag: str, settle_s: float
                           ) -> dict[str, list[float]]:
    agent, feeder = Http(address), Http(address)
    await register(agent, AGENT)
    latencies, acks = [], []

    async def poll() -> float:
        status, body = await agent.request("GET", f"/devices/{AGENT}/next-job")
        if status != 200:
            raise RuntimeError(f"the poll answered {status}: {body[:200]!r}")
        return time.perf_counter()

    for n in range(trials):
        held = asyncio.ensure_future(poll())
        await asyncio.sleep(settle_s)  # the poll's own first look has committed and found nothing
        if held.done():
            raise RuntimeError("the poll returned before a job was enqueued")
        started = time.perf_counter()
        status, body = await feeder.request("POST", "/jobs", job(n, tag))
        acked = time.perf_counter()
        if status != 201:
            raise RuntimeError(f"POST /jobs answered {status}: {body[:200]!r}")
        latencies.append(1000 * (await held - started))
        acks.append(1000 * (acked - started))
        await finish(agent, job(n, tag)["job_id"])  # a device holds one job at a time
    agent.close()
    feeder.close()
    return {"latency_ms": latencies, "enqueue_ack_ms": acks}


async def bare_trials(address: str, trials: int, settle_s: float) -> dict[str, list[float]]:
    http = Http(address)
    await http.request("GET", "/api/health")
    latencies, acks = [], []
    for n in range(trials):
        await asyncio.sleep(settle_s)  # as idle before each trial as the collector is
        started = time.perf_counter()
        status, _ = await http.request("POST", "/jobs", job(n, "bare"))
        acked = time.perf_counter()
        status2, _ = await http.request("GET", f"/devices/{AGENT}/next-job")
        done = time.perf_counter()
        assert status == 201 and status2 == 200, (status, status2)
        latencies.append(1000 * (done - started))
        acks.append(1000 * (acked - started))
        await finish(http, job(n, "bare")["job_id"])
    http.close()
    return {"latency_ms": latencies, "enqueue_ack_ms": acks}


async def writer_stats(address: str) -> dict[str, float]:
    http = Http(address)
    _, body = await http.request("GET", "/api/health")
    http.close()
    return dict(json.loads(body).get("writer") or {})


async def run_collector(address: str, trials: int, others: int, tag: str, settle_s: float
                        ) -> dict[str, list[float]]:
    stop = asyncio.Event()
    background = [asyncio.ensure_future(idle_agent(address, f"dispatch-idle-{tag}-{i}", stop))
                  for i in range(others)]
    await asyncio.sleep(0.2 + 0.01 * others)  # let them register and start waiting
    try:
        return await collector_trials(address, trials, tag, settle_s)
    finally:
        stop.set()
        await asyncio.gather(*background, return_exceptions=True)


def summary(samples: dict[str, list[float]]) -> dict[str, float]:
    lat = samples["latency_ms"]
    return {"trials": len(lat), "p50_ms": percentile(lat, 0.5), "p99_ms": percentile(lat, 0.99),
            "max_ms": max(lat), "enqueue_ack_p50_ms": percentile(samples["enqueue_ack_ms"], 0.5)}


def _load_process(address: str, prefix: str, agents: int, interval: float, stopped: Any,
                  out: Any) -> None:
    counter = [0]

    async def run() -> None:
        await asyncio.gather(*(lifecycle_agent(address, f"{prefix}-{i}", float("inf"), counter,
                                               interval, stopped) for i in range(agents)))

    started = time.monotonic()
    asyncio.run(run())
    out.put((counter[0], time.monotonic() - started))


class BackgroundLoad:
    """`rate` jobs a second of the whole lifecycle against one server, from LOAD_PROCS client
    processes of paced agents, until closed; `jobs_per_s` is what they reached."""

    def __init__(self, address: str, rate: float, tag: str) -> None:
        self.stopped = multiprocessing.Event()
        self.out: Any = multiprocessing.Queue()
        agents = max(LOAD_PROCS, int(rate * LOAD_AGENT_PERIOD_S))
        interval = agents / rate if rate else 0.0  # each agent's pace, so all reach `rate`
        per_proc = [agents // LOAD_PROCS + (i < agents % LOAD_PROCS) for i in range(LOAD_PROCS)]
        self.workers = [multiprocessing.Process(target=_load_process, args=(
            address, f"load-{tag}-{i}", n, interval, self.stopped, self.out))
            for i, n in enumerate(per_proc) if n] if rate else []
        self.jobs_per_s = 0.0

    def __enter__(self) -> BackgroundLoad:
        for worker in self.workers:
            worker.start()
        if self.workers:
            time.sleep(LOAD_WARMUP_S)  # registered and running at pace before the trials
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        outcomes = [self.out.get(timeout=60) for _ in self.workers]
        for worker in self.workers:
            worker.join()
        self.jobs_per_s = sum(jobs / max(wall, 1e-9) for jobs, wall in outcomes)


LOAD_PROCS = 2
LOAD_AGENT_PERIOD_S = 0.02  # each paced agent starts a job every 20 ms, at most
LOAD_WARMUP_S = 1.0


def writer_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The collector's own group-commit figures over the trials (GET /api/health "writer")."""
    batches = max(after.get("batches", 0) - before.get("batches", 0), 1)
    return {"batches": batches,
            "commit_ms_per_batch": 1000 * (after["commit_s"] - before["commit_s"]) / batches,
            "run_ms_per_batch": 1000 * (after["run_s"] - before["run_s"]) / batches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=300, help="trials per round and server")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--others", type=int, default=20, help="idle agents polling meanwhile")
    parser.add_argument("--settle-ms", type=float, default=30.0,
                        help="wait after sending the poll before enqueueing")
    parser.add_argument("--load", type=float, default=0.0,
                        help="jobs a second of background lifecycle load meanwhile")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.rounds, args.others = 10, 1, 2
    rounds: list[dict[str, Any]] = []
    settle_s = args.settle_ms / 1000
    with server("bare") as (bare_address, _), server("collector") as (address, _pid):
        for r in range(args.rounds):
            floor = commit_floor_ms(50 if args.quick else 100)
            with BackgroundLoad(bare_address, args.load, f"bare{r}") as bare_load:
                bare = summary(asyncio.run(bare_trials(bare_address, args.trials, settle_s)))
            bare["load_jobs_per_s"] = bare_load.jobs_per_s
            before = asyncio.run(writer_stats(address))
            with BackgroundLoad(address, args.load, f"r{r}") as load:
                ours = summary(asyncio.run(run_collector(address, args.trials, args.others,
                                                         f"r{r}", settle_s)))
            ours.update(writer_delta(before, asyncio.run(writer_stats(address))))
            ours["load_jobs_per_s"] = load.jobs_per_s
            # What no server could beat on this machine: the bare round trip plus the two
            # durable commits the path holds (the enqueue, then the claim).
            floor_ms = bare["p50_ms"] + 2 * floor["commit_p50_ms"]
            record = {"round": r, "bare": bare, "collector": ours, "disk": floor,
                      "p50_ratio": ours["p50_ms"] / bare["p50_ms"],
                      "p99_ratio": ours["p99_ms"] / bare["p99_ms"],
                      "floor_ms": floor_ms, "p50_over_floor": ours["p50_ms"] / floor_ms}
            emit({"bench": "dispatch", "figure": "round", **record})
            rounds.append(record)

    def med(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in rounds)

    result = {
        "bench": "dispatch", "figure": "dispatch_latency", "rounds": len(rounds),
        "trials_per_round": args.trials, "other_waiting_agents": args.others,
        "p50_ms": med("collector", "p50_ms"), "p99_ms": med("collector", "p99_ms"),
        "bare_p50_ms": med("bare", "p50_ms"), "bare_p99_ms": med("bare", "p99_ms"),
        "p50_ratio": statistics.median(r["p50_ratio"] for r in rounds),
        "p99_ratio": statistics.median(r["p99_ratio"] for r in rounds),
        "enqueue_ack_p50_ms": med("collector", "enqueue_ack_p50_ms"),
        "server_commit_ms_per_batch": med("collector", "commit_ms_per_batch"),
        "server_run_ms_per_batch": med("collector", "run_ms_per_batch"),
        "commit_p50_ms": med("disk", "commit_p50_ms"),
        "commit_p99_ms": med("disk", "commit_p99_ms"),
        "two_commits_ms": 2 * med("disk", "commit_p50_ms"),
        "floor_ms": statistics.median(r["floor_ms"] for r in rounds),
        "p50_over_floor": statistics.median(r["p50_over_floor"] for r in rounds),
        "load_jobs_per_s_asked": args.load,
        "load_jobs_per_s": med("collector", "load_jobs_per_s"),
        "bare_load_jobs_per_s": med("bare", "load_jobs_per_s"),
        "target": {"p50_ms": 3, "p99_ms": 2, "under_jobs_per_s": 2000}, "cores": os.cpu_count(),
    }
    emit(result)
    table([
        ("ceiling (bare) p50 ms", f"{result['bare_p50_ms']:.2f}", "POST /jobs + GET next-job"),
        ("ceiling (bare) p99 ms", f"{result['bare_p99_ms']:.2f}", ""),
        ("disk: one commit p50 ms", f"{result['commit_p50_ms']:.2f}", "WAL, synchronous=FULL"),
        ("floor: bare + 2 commits ms", f"{result['floor_ms']:.2f}", ""),
        ("dispatch p50 ms", f"{result['p50_ms']:.2f}", "target <= 3"),
        ("dispatch p99 ms", f"{result['p99_ms']:.2f}", "target <= 2"),
        ("p50 ratio collector/bare", f"{result['p50_ratio']:.1f}", ""),
        ("p99 ratio collector/bare", f"{result['p99_ratio']:.1f}", ""),
        ("p50 / floor", f"{result['p50_over_floor']:.2f}", "1.0 = only the disk's cost"),
        ("enqueue ack p50 ms", f"{result['enqueue_ack_p50_ms']:.2f}", "POST /jobs answered"),
        ("collector COMMIT ms per batch", f"{result['server_commit_ms_per_batch']:.2f}",
         "mean, its own writer figures"),
        ("background load jobs/s", f"{result['load_jobs_per_s']:.0f}",
         f"asked {args.load:.0f}; the bare server's {result['bare_load_jobs_per_s']:.0f}"),
    ])


if __name__ == "__main__":
    main()

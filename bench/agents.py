"""Agents held by one collector: N simulated agents each hold a long poll, beacon once a minute
and run the jobs of a steady job stream; the collector's CPU share, resident memory and cost per
beacon are reported for each N, next to a bare aiohttp server carrying the same load.

    python bench/agents.py [--agents 1000,5000,19900] [--procs 4] [--seconds 60] [--hold 25]
                           [--beacon-s 60] [--rate 50] [--phase-s 20] [--burst-rate 800]
                           [--no-bare] [--tree PATH] [--quick]

Each agent has its own keep-alive connection and loops: GET /devices/{id}/next-job (held for
`--hold` seconds, FLEET_LONG_POLL_S), and on a job, POST its final row and poll again. The
agents' first polls are spread over one hold, so their renewals are spread too. Every agent
beacons (POST /results, kind beacon) once every `--beacon-s` seconds at its own offset, over a
few shared connections per client process, as the real agent's presence thread does. A job
stream process enqueues `--rate` jobs a second (`--pinned` of them pinned to a random agent,
the rest for any agent that declared the workload).

A round for one N and one server, after the agents are registered and connected (untimed):

- warm-up: the first polls are placed over one hold;
- `main` (`--seconds`): the steady load; the server's CPU share (utime+stime from /proc over
  wall time) and VmRSS at its end are the figures;
- `quiet` (`--phase-s`): no beacons and no jobs, only the held polls renewing;
- `burst` (`--phase-s`): beacons at `--burst-rate` a second, no jobs. The cost of a beacon is
  (CPU in the burst - the burst's poll renewals at the quiet phase's CPU per renewal) / beacons
  in the burst: what one more beacon costs with N polls held (`us_per_beacon_raw` takes the
  quiet phase's CPU out whole; at 20,000 agents the renewals, 800 a second, vary between the
  two phases by more than the beacons cost). A wake-up that looks at every waiting poll makes
  it grow with N. The burst is long and dense (16,000 beacons by default) so that the beacons,
  not the renewals taken out, carry the burst's CPU: at 200 a second for 10 s they were under half
  of it at 20,000 agents, and the figure moved by ±200 us between runs of one tree.

The ceiling is a bare aiohttp server (this file with --serve-bare) answering the same requests
with no work (a poll sleeps its hold), under the same load. Client processes are separate
processes; the file-descriptor limit is raised to its hard limit and inherited by the servers:
N held polls need N descriptors in the server, so N is clipped to the limit less a reserve
(and the table says so). Memory per agent is (VmRSS at the end of `main` - VmRSS before the
agents registered) / N.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    ROOT,
    Http,
    bare_script_server,
    checkout,
    cpu_seconds,
    emit,
    main_thread_cpu_seconds,
    memory_kib,
    raise_nofile,
    register_devices,
    serve_bare_polls,
    server,
    table,
)

FD_RESERVE = 200       # descriptors the server needs besides the polls (files, beacon pools)
CONNECT_GATE = 32      # connects in flight per client process (the listen backlog is 128)
BEACON_CONNECTIONS = 8  # shared connections per client process for the beacons
JOB_CONNECTIONS = 4
WINDOWS = ("main", "quiet", "burst")


# -- the bare ceiling server ---------------------------------------------------------------------


def serve_bare(port: int, hold: float) -> None:
    serve_bare_polls(port, hold, ("/devices/register", "/results", "/jobs"))


def bare_server(hold: float) -> contextlib.AbstractContextManager[tuple[str, int]]:
    return bare_script_server(__file__, str(hold))


# -- clients -------------------------------------------------------------------------------------


class Plan:
    """The round's timeline (time.monotonic, which every process on Linux shares)."""

    def __init__(self, go: float, args: argparse.Namespace) -> None:
        self.go = go
        self.stagger = args.hold
        self.main = go + args.hold + args.settle
        self.quiet = self.main + args.seconds
        self.burst = self.quiet + args.phase_s
        self.end = self.burst + args.phase_s

    def window(self, at: float) -> str | None:
        if self.main <= at < self.quiet:
            return "main"
        if self.quiet <= at < self.burst:
            return "quiet"
        if self.burst <= at < self.end:
            return "burst"
        return None


class Counts:
    def __init__(self) -> None:
        self.by_window = {w: {"polls_204": 0, "jobs": 0, "beacons": 0, "errors": 0}
                         for w in WINDOWS}
        self.errors = 0

    def add(self, plan: Plan, at: float, what: str) -> None:
        window = plan.window(at)
        if window is not None:
            self.by_window[window][what] += 1
        if what == "errors":
            self.errors += 1


async def _sleep_until(at: float) -> None:
    delay = at - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


def beacon_body(device: str, rng: random.Random) -> dict[str, Any]:
    return {"schema": 1, "kind": "beacon", "device_id": device, "beacon": {
        "battery_pct": rng.randint(40, 100), "on_ac": True, "load_1m": round(rng.random(), 2),
        "idle_s": rng.randint(0, 3600), "mem_mb": 3500}}


async def _open(address: str, count: int) -> list[Http]:
    gate = asyncio.Semaphore(CONNECT_GATE)

    async def one() -> Http:
        http = Http(address)
        async with gate:
            await http.connect()
        return http

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def _agent(http: Http, device: str, first_at: float, plan: Plan, counts: Counts) -> None:
    await _sleep_until(first_at)
    while time.monotonic() < plan.end:
        try:
            status, body = await http.request("GET", f"/devices/{device}/next-job")
        except (OSError, ConnectionError, asyncio.IncompleteReadError):
            counts.add(plan, time.monotonic(), "errors")
            return
        at = time.monotonic()
        if status == 204:
            counts.add(plan, at, "polls_204")
            continue
        if status != 200:
            counts.add(plan, at, "errors")
            continue
        job = json.loads(body)
        status, _ = await http.request("POST", "/results", {
            "schema": 1, "kind": "result", "job_id": job["job_id"], "device_id": device,
            "iter": 0, "attempt": job.get("attempt", 1), "final": True, "ok": True})
        counts.add(plan, time.monotonic(), "jobs" if status == 200 else "errors")


def _beacon_schedule(devices: list[str], plan: Plan, args: argparse.Namespace,
                     procs: int, rng: random.Random) -> list[tuple[float, str]]:
    """Each agent's beacons once every beacon_s from its own offset until the quiet phase,
    then this process's share of the burst, round robin over its agents."""
    schedule = []
    for device in devices:
        at = plan.go + rng.uniform(0, args.beacon_s)
        while at < plan.quiet:
            schedule.append((at, device))
            at += args.beacon_s
    step = procs / max(args.burst_rate, 1e-9)
    at, n = plan.burst + rng.uniform(0, step), 0
    while at < plan.end:
        schedule.append((at, devices[n % len(devices)]))
        at, n = at + step, n + 1
    schedule.sort()
    return schedule


async def _beacons(address: str, schedule: list[tuple[float, str]], plan: Plan,
                   counts: Counts, rng: random.Random) -> None:
    due: asyncio.Queue[tuple[float, str] | None] = asyncio.Queue()

    async def sender() -> None:
        http = Http(address)
        while (item := await due.get()) is not None:
            at, device = item
            try:
                status, _ = await http.request("POST", "/results", beacon_body(device, rng))
            except (OSError, ConnectionError, asyncio.IncompleteReadError):
                counts.add(plan, at, "errors")
                http = Http(address)
                continue
            counts.add(plan, at, "beacons" if status == 200 else "errors")
        http.close()

    senders = [asyncio.create_task(sender()) for _ in range(BEACON_CONNECTIONS)]
    for at, device in schedule:
        await _sleep_until(at)
        due.put_nowait((at, device))
    for _ in senders:
        due.put_nowait(None)
    await asyncio.gather(*senders)


def _client(address: str, devices: list[str], register: bool, procs: int, seed: int,
            args: argparse.Namespace, start: Any, ready: Any, out: Any) -> None:
    """Register (untimed), connect every agent, then run the round's plan."""
    raise_nofile()
    rng = random.Random(seed)
    loop = asyncio.new_event_loop()
    if register:
        loop.run_until_complete(register_devices(address, devices))
    conns = loop.run_until_complete(_open(address, len(devices)))
    ready.put(True)
    plan = Plan(start.get(), args)
    counts = Counts()
    started = time.process_time()

    async def run() -> None:
        agents = [asyncio.create_task(_agent(
            http, device, plan.go + rng.uniform(0, plan.stagger), plan, counts))
            for http, device in zip(conns, devices, strict=True)]
        await _beacons(address, _beacon_schedule(devices, plan, args, procs, rng), plan,
                       counts, rng)
        await _sleep_until(plan.end)
        for task in agents:
            task.cancel()
        await asyncio.gather(*agents, return_exceptions=True)
        for http in conns:
            http.close()

    loop.run_until_complete(run())
    loop.close()
    out.put({"counts": counts.by_window, "errors": counts.errors,
             "cpu_s": time.process_time() - started})


def _job_stream(address: str, devices: list[str], seed: int, args: argparse.Namespace,
                start: Any, ready: Any, out: Any) -> None:
    """`rate` jobs a second from the end of the warm-up until the quiet phase."""
    rng = random.Random(seed)
    ready.put(True)
    plan = Plan(start.get(), args)
    sent, errors = [0], [0]

    async def run() -> None:
        due: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        async def sender() -> None:
            http = Http(address)
            while (spec := await due.get()) is not None:
                status, _ = await http.request("POST", "/jobs", spec)
                if status == 201:
                    sent[0] += 1
                else:
                    errors[0] += 1
            http.close()

        senders = [asyncio.create_task(sender()) for _ in range(JOB_CONNECTIONS)]
        at, n = plan.go + plan.stagger, 0
        while at < plan.quiet:
            await _sleep_until(at)
            spec: dict[str, Any] = {"schema": 1, "job_id": f"stream-{seed}-{n}",
                                    "workload": "benchmark", "executor": "device",
                                    "backend": "synthetic"}
            if rng.random() < args.pinned:
                spec["targets"] = {"device_id": rng.choice(devices)}
            due.put_nowait(spec)
            at, n = at + 1 / args.rate, n + 1
        for _ in senders:
            due.put_nowait(None)
        await asyncio.gather(*senders)

    if args.rate > 0:
        asyncio.run(run())
    out.put({"jobs_sent": sent[0], "job_errors": errors[0]})


# -- one round -----------------------------------------------------------------------------------


async def _health(address: str) -> dict[str, Any]:
    http = Http(address)
    try:
        _, body = await http.request("GET", "/api/health")
    finally:
        http.close()
    return dict(json.loads(body))


def _cpu(pid: int) -> tuple[float, float]:
    return cpu_seconds(pid), main_thread_cpu_seconds(pid)


def run_round(kind: str, address: str, pid: int, agents: int, args: argparse.Namespace,
              tag: str) -> dict[str, Any]:
    devices = [f"ag-{tag}-{i}" for i in range(agents)]
    shares = [devices[i::args.procs] for i in range(args.procs)]
    shares = [s for s in shares if s]
    rss_start = memory_kib(pid)["VmRSS"]
    ready: Any = multiprocessing.Queue()
    out: Any = multiprocessing.Queue()
    starts: list[Any] = [multiprocessing.Queue() for _ in range(len(shares) + 1)]
    workers = [multiprocessing.Process(target=_client, args=(
        address, share, kind == "collector", len(shares), i, args, starts[i], ready, out))
        for i, share in enumerate(shares)]
    workers.append(multiprocessing.Process(target=_job_stream, args=(
        address, devices, len(shares), args, starts[-1], ready, out)))
    for worker in workers:
        worker.start()
    for _ in workers:
        ready.get(timeout=900)
    plan = Plan(time.monotonic() + 0.5, args)
    for queue in starts:
        queue.put(plan.go)
    marks: dict[str, tuple[float, float]] = {}
    for name, at in (("main", plan.main), ("quiet", plan.quiet), ("burst", plan.burst),
                     ("end", plan.end)):
        time.sleep(max(0.0, at - time.monotonic()))
        marks[name] = _cpu(pid)
        if name == "quiet":
            rss_main = memory_kib(pid)["VmRSS"]
            waiting = int(asyncio.run(_health(address)).get("waiting_polls", 0))
    outcomes = [out.get(timeout=args.hold + 600) for _ in workers]
    for worker in workers:
        worker.join()
    counts = {w: {k: sum(o["counts"][w][k] for o in outcomes if "counts" in o)
                  for k in ("polls_204", "jobs", "beacons", "errors")} for w in WINDOWS}
    stream = next(o for o in outcomes if "jobs_sent" in o)

    def spent(a: str, b: str, thread: int = 0) -> float:
        return marks[b][thread] - marks[a][thread]

    quiet_cpu, burst_cpu = spent("quiet", "burst"), spent("burst", "end")
    burst_beacons = counts["burst"]["beacons"]
    # The held polls renew in both phases, not always as many in each: their cost per renewal
    # comes from the quiet phase, and the burst's renewals are taken out at that price.
    per_renewal = quiet_cpu / max(counts["quiet"]["polls_204"], 1)
    beacons_cpu = burst_cpu - per_renewal * counts["burst"]["polls_204"]
    return {
        "server": kind, "agents": agents, "hold_s": args.hold, "seconds": args.seconds,
        "cpu_share": spent("main", "quiet") / args.seconds,
        "main_thread_share": spent("main", "quiet", 1) / args.seconds,
        "quiet_cpu_share": quiet_cpu / args.phase_s,
        "burst_cpu_share": burst_cpu / args.phase_s,
        "us_per_beacon": 1e6 * beacons_cpu / max(burst_beacons, 1),
        "us_per_beacon_raw": 1e6 * (burst_cpu - quiet_cpu) / max(burst_beacons, 1),
        "us_per_renewal": 1e6 * per_renewal,
        "waiting_polls": waiting, "rss_start_kib": rss_start, "rss_kib": rss_main,
        "kib_per_agent": (rss_main - rss_start) / max(agents, 1),
        "beacons_per_s": counts["main"]["beacons"] / args.seconds,
        "jobs_per_s": counts["main"]["jobs"] / args.seconds,
        "polls_204_per_s": counts["main"]["polls_204"] / args.seconds,
        "burst_beacons": burst_beacons, "jobs_sent": stream["jobs_sent"],
        "errors": sum(o.get("errors", 0) for o in outcomes) + stream["job_errors"],
        "client_cpu_s": sum(o.get("cpu_s", 0.0) for o in outcomes),
        "loadavg": Path("/proc/loadavg").read_text().split()[0],
    }


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve-bare":
        serve_bare(int(sys.argv[2]), float(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", default="1000,5000,19900",
                        help="comma-separated numbers of agents, one round each")
    parser.add_argument("--procs", type=int, default=4, help="client processes")
    parser.add_argument("--hold", type=float, default=25.0, help="FLEET_LONG_POLL_S, seconds")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds after the first polls are placed before measuring")
    parser.add_argument("--seconds", type=float, default=60.0, help="the main window")
    parser.add_argument("--beacon-s", type=float, default=60.0, help="each agent's beacon period")
    parser.add_argument("--rate", type=float, default=50.0, help="jobs a second in the stream")
    parser.add_argument("--pinned", type=float, default=0.5,
                        help="the share of the stream's jobs pinned to one agent")
    parser.add_argument("--phase-s", type=float, default=20.0,
                        help="length of the quiet and burst phases")
    parser.add_argument("--burst-rate", type=float, default=800.0,
                        help="beacons a second in the burst phase")
    parser.add_argument("--no-bare", action="store_true", help="skip the bare server")
    parser.add_argument("--tree", type=checkout, default=ROOT,
                        help="run the collector from this checkout (default: this one)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.agents, args.procs, args.hold, args.settle = "20,60", 2, 1.0, 0.5
        args.seconds, args.beacon_s, args.rate, args.phase_s, args.burst_rate = (
            2.0, 1.0, 10.0, 1.0, 50.0)
    limit = raise_nofile()
    wanted = [int(n) for n in args.agents.split(",") if n.strip()]
    sizes = [min(n, limit - FD_RESERVE) for n in wanted]
    records: list[dict[str, Any]] = []
    for n, agents in enumerate(sizes):
        env = {"FLEET_LONG_POLL_S": str(args.hold)}
        kinds = ("collector",) if args.no_bare else ("bare", "collector")
        for kind in kinds:
            context = (bare_server(args.hold) if kind == "bare"
                       else server("collector", env, tree=args.tree.resolve()))
            with context as (address, pid):
                record = run_round(kind, address, pid, agents, args, f"r{n}{kind[0]}")
            record.update({"wanted": wanted[n], "nofile_limit": limit})
            emit({"bench": "agents", "figure": "round", **record})
            records.append(record)
    ours = [r for r in records if r["server"] == "collector"]
    bare = {r["agents"]: r for r in records if r["server"] == "bare"}
    costs = [r["us_per_beacon"] for r in ours]
    largest = ours[-1]
    emit({"bench": "agents", "figure": "agents", "agents": [r["agents"] for r in ours],
          "cpu_shares": [r["cpu_share"] for r in ours],
          "bare_cpu_shares": [bare[r["agents"]]["cpu_share"] if r["agents"] in bare else None
                              for r in ours],
          "us_per_beacon": costs, "rss_mib": [r["rss_kib"] / 1024 for r in ours],
          "kib_per_agent": [r["kib_per_agent"] for r in ours],
          "beacon_cost_spread": (max(costs) / max(min(costs), 1e-9)) if costs else None,
          "largest": largest["agents"], "largest_cpu_share": largest["cpu_share"],
          "nofile_limit": limit, "target": {"agents": 20000, "cpu_share": 0.5},
          "cores": os.cpu_count()})
    rows = []
    for r in ours:
        b = bare.get(r["agents"])
        clipped = f" (asked {r['wanted']}; fd limit {limit})" if r["wanted"] != r["agents"] else ""
        rows += [
            (f"{r['agents']} agents: CPU share", f"{r['cpu_share']:.1%}",
             (f"bare server {b['cpu_share']:.1%}"
              + (f" with {b['errors']} errors, not a ceiling" if b and b["errors"] else "")
              + "; " if b else "") + "target <= 50% at 20,000" + clipped),
            (f"{r['agents']} agents: per beacon", f"{r['us_per_beacon']:.0f} us",
             (f"bare server {b['us_per_beacon']:.0f} us; " if b else "")
             + "should not grow with the agents"),
            (f"{r['agents']} agents: RSS", f"{r['rss_kib'] / 1024:.0f} MiB",
             f"{r['kib_per_agent']:.1f} KiB an agent; {r['jobs_per_s']:.0f} jobs/s, "
             f"{r['beacons_per_s']:.0f} beacons/s, {r['waiting_polls']} polls held, "
             f"{r['errors']} errors"),
        ]
    if len(costs) > 1:
        rows.append(("beacon cost, largest/smallest", f"{costs[-1] / max(costs[0], 1e-9):.2f}",
                     "about 1 when independent of the agents"))
    table(rows)


if __name__ == "__main__":
    main()

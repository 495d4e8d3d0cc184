"""Idle long polls held at once: many agents poll GET /devices/{id}/next-job with nothing to
take, each must be answered 204 when its hold (FLEET_LONG_POLL_S) runs out, and the collector's
resident memory per held poll is reported.

    python bench/idle_polls.py [--polls 5000] [--procs 4] [--hold 5] [--rounds 3] [--quick]

Several client processes first open every connection (the connect burst is kept apart, so that
the polls are all held together), then send every poll at once. While they are held the bench
reads the collector's `waiting_polls` (GET /api/health) and its VmRSS (/proc) every 0.1 s; the
cost per poll is (VmRSS at the peak - VmRSS before the connections were opened) / polls held at
the peak, so it includes the connection's own memory. A poll is answered
on time when it gets 204 no earlier than the hold and no later than the hold plus its first
claim's wait plus `--slack` seconds.

Ceiling, measured in the same run: a bare aiohttp server (this file with --serve-bare) whose
handler only sleeps the hold and answers 204, held open by the same clients. Its memory per poll
is what the framework, a connection and a pending request cost; the collector's figure is
reported next to it as a ratio. Each round starts fresh server processes so that memory freed by
an earlier round cannot hide this round's growth. The file-descriptor limit (RLIMIT_NOFILE) is
raised to its hard limit here, and the servers inherit it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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
    bare_script_server,
    cpu_seconds,
    emit,
    memory_kib,
    percentile,
    raise_nofile,
    register_devices,
    serve_bare_polls,
    server,
    table,
)

CONNECT_GATE = 32  # connects in flight per client process (the listen backlog is 128)


# -- the bare ceiling server ---------------------------------------------------------------------


def serve_bare(port: int, hold: float) -> None:
    serve_bare_polls(port, hold)


def bare_server(hold: float) -> contextlib.AbstractContextManager[tuple[str, int]]:
    return bare_script_server(__file__, str(hold))


# -- clients -------------------------------------------------------------------------------------


async def _open(address: str, count: int) -> list[Http]:
    gate = asyncio.Semaphore(CONNECT_GATE)

    async def one() -> Http:
        http = Http(address)
        async with gate:
            await http.connect()
        return http

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def _hold(conns: list[Http], devices: list[str]) -> list[tuple[int, float]]:
    async def one(http: Http, device: str) -> tuple[int, float]:
        started = time.monotonic()
        try:
            status, _ = await http.request("GET", f"/devices/{device}/next-job")
        except (OSError, ConnectionError, asyncio.IncompleteReadError):
            return -2, time.monotonic() - started
        return status, time.monotonic() - started

    try:
        return await asyncio.gather(*(one(h, d) for h, d in zip(conns, devices, strict=True)))
    finally:
        for http in conns:
            http.close()


def _client(address: str, devices: list[str], register: bool, ready: Any, go: Any,
            out: Any) -> None:
    """Register (untimed), then open every connection, then send every poll at once: the
    connect burst is kept apart from the polls so the polls are all held together."""
    if register:
        asyncio.run(register_devices(address, devices))
    ready.put(True)
    go[0].wait()
    loop = asyncio.new_event_loop()
    started = time.process_time()
    opened = time.monotonic()
    conns = loop.run_until_complete(_open(address, len(devices)))
    ready.put(time.monotonic() - opened)
    go[1].wait()
    outcomes = loop.run_until_complete(_hold(conns, devices))
    loop.close()
    out.put({"outcomes": outcomes, "cpu_s": time.process_time() - started})


async def _health(address: str) -> dict[str, Any]:
    http = Http(address)
    try:
        _, body = await http.request("GET", "/api/health")
    finally:
        http.close()
    return dict(json.loads(body))


def run_round(kind: str, address: str, pid: int, args: argparse.Namespace, tag: str
              ) -> dict[str, Any]:
    devices = [f"idle-{tag}-{i}" for i in range(args.polls)]
    shares = [devices[i::args.procs] for i in range(args.procs)]
    ready: Any = multiprocessing.Queue()
    out: Any = multiprocessing.Queue()
    go = (multiprocessing.Event(), multiprocessing.Event())
    workers = [multiprocessing.Process(target=_client, args=(
        address, share, kind == "collector", ready, go, out)) for share in shares if share]
    for worker in workers:
        worker.start()
    for _ in workers:
        ready.get(timeout=600)
    time.sleep(0.5)
    before = memory_kib(pid)
    go[0].set()  # open the connections
    connect_s = max(ready.get(timeout=600) for _ in workers)
    connected = memory_kib(pid)
    cpu_before = cpu_seconds(pid)
    go[1].set()  # send the polls
    opened = time.monotonic()
    peak = {"waiting": 0, "rss_kib": before["VmRSS"], "at_s": 0.0}
    deadline = opened + args.hold + 60
    while time.monotonic() < deadline and out.empty():
        waiting = int(asyncio.run(_health(address)).get("waiting_polls", 0))
        rss = memory_kib(pid)["VmRSS"]
        if waiting > peak["waiting"] or (waiting == peak["waiting"] and rss > peak["rss_kib"]):
            peak = {"waiting": waiting, "rss_kib": rss, "at_s": time.monotonic() - opened}
        time.sleep(0.1)
    results = [out.get(timeout=args.hold + 600) for _ in workers]
    for worker in workers:
        worker.join()
    after = memory_kib(pid)
    outcomes = [o for r in results for o in r["outcomes"]]
    elapsed = [e for s, e in outcomes if s == 204]
    # On time: not before the hold, and not later than the hold plus the slack; a poll's first
    # claim is a committed write, so under a burst of thousands it waits its turn first.
    on_time = sum(1 for s, e in outcomes
                  if s == 204 and args.hold - 0.05 <= e <= args.hold + args.slack)
    grown = peak["rss_kib"] - before["VmRSS"]
    return {
        "server": kind, "polls": args.polls, "hold_s": args.hold,
        "peak_waiting": peak["waiting"], "peak_at_s": round(peak["at_s"], 2),
        "answered_204": len(elapsed), "on_time": on_time,
        "errors": sum(1 for s, _ in outcomes if s not in (204,)),
        "late_p50_s": percentile([e - args.hold for e in elapsed], 0.5) if elapsed else 0.0,
        "late_max_s": max((e - args.hold for e in elapsed), default=0.0),
        "connect_s": connect_s, "rss_before_kib": before["VmRSS"],
        "rss_connected_kib": connected["VmRSS"], "rss_peak_kib": peak["rss_kib"],
        "hwm_growth_kib": after["VmHWM"] - before["VmHWM"],
        "kib_per_poll": grown / max(peak["waiting"], 1),
        "server_cpu_s": cpu_seconds(pid) - cpu_before,
        "client_cpu_s": sum(r["cpu_s"] for r in results),
    }


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve-bare":
        serve_bare(int(sys.argv[2]), float(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--polls", type=int, default=5000)
    parser.add_argument("--procs", type=int, default=4, help="client processes")
    parser.add_argument("--hold", type=float, default=5.0, help="FLEET_LONG_POLL_S, seconds")
    parser.add_argument("--slack", type=float, default=2.0,
                        help="seconds past the hold still counted on time")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.polls, args.procs, args.hold, args.rounds = 40, 2, 1.0, 1
    limit = raise_nofile(args.polls + 1024)
    env = {"FLEET_LONG_POLL_S": str(args.hold)}
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        with bare_server(args.hold) as (address, pid):
            bare = run_round("bare", address, pid, args, f"r{r}")
        with server("collector", env) as (address, pid):
            ours = run_round("collector", address, pid, args, f"r{r}")
        ratio = ours["kib_per_poll"] / max(bare["kib_per_poll"], 1e-9)
        for record in (bare, ours):
            emit({"bench": "idle_polls", "figure": "round", "round": r, **record})
        rounds.append({"bare": bare, "collector": ours, "ratio": ratio})

    def med(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in rounds)

    result = {
        "bench": "idle_polls", "figure": "idle_polls", "polls": args.polls, "hold_s": args.hold,
        "rounds": len(rounds), "nofile_limit": limit,
        "held": med("collector", "peak_waiting"), "on_time": med("collector", "on_time"),
        "kib_per_poll": med("collector", "kib_per_poll"),
        "bare_kib_per_poll": med("bare", "kib_per_poll"),
        "ratio": statistics.median(r["ratio"] for r in rounds),
        "late_max_s": med("collector", "late_max_s"),
        "bare_on_time": med("bare", "on_time"),
        "target": {"held": 20000, "kib_per_poll": 10}, "cores": os.cpu_count(),
    }
    emit(result)
    table([
        ("polls opened", f"{args.polls}", f"{args.procs} client processes"),
        ("held at once (peak)", f"{result['held']:.0f}", "target 20000"),
        ("answered 204 on time", f"{result['on_time']:.0f}", f"hold {args.hold} s"),
        ("latest answer past hold s", f"{result['late_max_s']:.2f}", ""),
        ("collector KiB per poll", f"{result['kib_per_poll']:.1f}", "target <= 10"),
        ("bare aiohttp KiB per poll", f"{result['bare_kib_per_poll']:.1f}", "the ceiling"),
        ("ratio collector/bare", f"{result['ratio']:.2f}", ""),
    ])


if __name__ == "__main__":
    main()

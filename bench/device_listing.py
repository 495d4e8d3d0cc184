"""What one request over the whole registry costs everything else: a registry filled to
`--devices` devices at the registration's limits (256 capabilities of 200 characters, 64 pools
of 100, a descriptor of 14 KB), then one request asked while two probes poll every 20 ms, one
that needs the database's shared reader (`GET /api/jobs/<none>`, a 404 after a read) and one
that needs only the event loop (`GET /api/health`). The request (`--ask`): `listing`, the
device listing (`GET /api/devices`); `fanout`, a fan-out whose match expression every device
is asked and none passes (refused with 422, so each round asks the same); `preview`, the same
spec's preview (`POST /api/jobs/preview-targets`, answered with no device); `undeclared`, a job
of a workload no device declares (refused with 422 once every device's list was looked at);
`executors`, the executor listing (`GET /api/executors`, which looks for devices attached to
one in every descriptor); `enroll`, the enrolment page's data (`GET /api/enroll`, the pools in
use); `metrics`, a scrape (`GET /metrics`); `overview`, the dashboard's overview
(`GET /api/overview`); `register`, a new device's registration, refused at the registry's bound
(507) when `--devices` is FLEET_MAX_DEVICES (the default).

    python bench/device_listing.py [--devices 25000] [--rounds 2]
                                   [--ask listing|fanout|preview|undeclared|executors|enroll|
                                         metrics|overview|register]
                                   [--against PATH] [--quick]

Reported per server: the listing's time and size, the worst wait of each probe while it ran
(what every other client of the collector saw), and the collector's peak memory. The ceiling
is each probe's worst wait over the same time with no listing asked. With `--against PATH` (a
`git worktree` of another commit) a collector from that tree is measured in the same rounds on
the same data. Anyone who can reach the collector's port can fill its registry this way (the
registration is open, bounded by FLEET_MAX_DEVICES).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sqlite3
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, checkout, emit, memory_kib, server, table


def wide_device(device_id: str) -> dict[str, Any]:
    """A registration at the limits validation allows; of its 256 capabilities the first is
    `benchmark`, the workload the fan-out and the preview of `--ask` name."""
    return {"device_id": device_id,
            "pools": [f"p{k:02d}" + "x" * 96 for k in range(64)],
            "capabilities": ["benchmark", *(f"c{k:03d}" + "y" * 196 for k in range(1, 256))],
            "descriptor": {"platform": "linux", "model": "m" * 100,
                           **{f"f{k}": "z" * 150 for k in range(90)}}}


def fill(address: str, data: Path, devices: int) -> None:
    """One device registered over HTTP, copied in SQL to `devices` (the collector running: the
    copies are the rows its own registration wrote, with last_seen spread a second apart)."""
    request = urllib.request.Request(f"http://{address}/devices/register",
                                     data=json.dumps(wide_device("wide-0")).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200
    conn = sqlite3.connect(data / "fleet.sqlite3", timeout=30)
    columns = [row[1] for row in conn.execute("PRAGMA table_info(devices)")]
    copied = ", ".join("'wide-' || i" if c == "device_id" else "last_seen - i"
                       if c == "last_seen" else c for c in columns)
    with conn:
        conn.execute(f"WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE "
                     f"i < ?) INSERT INTO devices ({', '.join(columns)}) SELECT {copied} "
                     "FROM n, devices WHERE device_id = 'wide-0'", (devices - 1,))
    conn.close()


async def probe(address: str, path: str, stop: Any) -> float:
    """The worst answer time of `path`, asked every 20 ms until `stop` is set."""
    host, port = address.rsplit(":", 1)
    worst = 0.0
    reader, writer = await asyncio.open_connection(host, int(port))
    while not stop.is_set():
        started = time.monotonic()
        await exchange(reader, writer, host, path)
        worst = max(worst, time.monotonic() - started)
        await asyncio.sleep(0.02)
    writer.close()
    return worst


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str,
                   path: str, method: str = "GET", payload: Any = None) -> bytes:
    body = b"" if payload is None else json.dumps(payload).encode()
    sent = f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n" if body else ""
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{sent}\r\n".encode() + body)
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return await reader.readexactly(length)


def probes(address: str, stop: Any, worst: Any) -> None:
    """In a process of its own, so the listing's 136 MB read by this one never delays them."""
    async def run() -> list[float]:
        return list(await asyncio.gather(probe(address, "/api/jobs/none", stop),
                                         probe(address, "/api/health", stop)))
    worst.put(asyncio.run(run()))


# A match every device is asked and none passes: the model of every copy is "m" * 100.
NO_DEVICE_MATCH = "platform == 'linux' && model ~ 'm{3}x'"
ASKED = {
    "listing": ("GET", "/api/devices", None),
    "fanout": ("POST", "/jobs", {"schema": 1, "job_id": "bench-fanout", "workload": "benchmark",
                                 "backend": "synthetic", "executor": "device", "fanout": True,
                                 "targets": {"match": NO_DEVICE_MATCH}}),
    "executors": ("GET", "/api/executors", None),
    "enroll": ("GET", "/api/enroll", None),
    "metrics": ("GET", "/metrics", None),
    "overview": ("GET", "/api/overview", None),
    "register": ("POST", "/devices/register", {"device_id": "bench-newcomer"}),
    "undeclared": ("POST", "/jobs", {"schema": 1, "job_id": "bench-undeclared",
                                     "workload": "nobody-declares", "executor": "device"}),
    "preview": ("POST", "/api/jobs/preview-targets", {"workload": "benchmark",
                                                       "executor": "device",
                                                       "targets": {"match": NO_DEVICE_MATCH}}),
}


def probed(address: str, seconds: float | None, ask: str | None) -> dict[str, Any]:
    """The probes' worst waits over `seconds`, or while one request of ASKED is answered."""
    stop, worst = multiprocessing.Event(), multiprocessing.Queue()
    prober = multiprocessing.Process(target=probes, args=(address, stop, worst))
    prober.start()
    time.sleep(0.2)
    record: dict[str, Any] = {}
    if ask:
        method, path, payload = ASKED[ask]

        async def asked() -> bytes:
            host, port = address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            body = await exchange(reader, writer, host, path, method, payload)
            writer.close()
            return body
        started = time.monotonic()
        body = asyncio.run(asked())
        answer = json.loads(body) if body.startswith(b"{") else {}  # /metrics is text
        listed = answer.get("devices")  # the overview's is a dict of counts
        record.update(listing_s=time.monotonic() - started, bytes=len(body),
                      devices=len(listed) if isinstance(listed, list) else 0,
                      answer=answer.get("error"))
    else:
        time.sleep(seconds or 0)
    stop.set()
    record["reader_s"], record["loop_s"] = worst.get(timeout=60)
    prober.join()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=25_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ask", choices=sorted(ASKED), default="listing",
                        help="the request over the whole registry (default: the listing)")
    parser.add_argument("--against", type=checkout, default=None, metavar="PATH",
                        help="a checkout of another commit, measured in the same rounds")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.devices, args.rounds = 50, 1
    trees = {"this tree": ROOT, **({"against": args.against} if args.against else {})}
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "data"
        data.mkdir()
        for round_no in range(args.rounds):
            for name, tree in trees.items():
                with server("collector", tree=tree, data_dir=data) as (address, pid):
                    if not found[name] and name == "this tree":
                        fill(address, data, args.devices)
                    idle = probed(address, 1.0 if args.quick else 3.0, ask=None)
                    record = probed(address, None, ask=args.ask)
                    record.update(worst_reader_s=record.pop("reader_s"),
                                  worst_loop_s=record.pop("loop_s"),
                                  idle_worst_reader_s=idle["reader_s"],
                                  idle_worst_loop_s=idle["loop_s"])
                    record["peak_rss_mb"] = memory_kib(pid)["VmHWM"] / 1024
                record.update(bench="device_listing", ask=args.ask, server=name,
                              round=round_no + 1)
                emit(record)
                found[name].append(record)
    rows = []
    for name, records in found.items():
        def median(key: str, records: list[dict[str, Any]] = records) -> float:
            return statistics.median(r[key] for r in records)
        summary = {key: median(key) for key in ("listing_s", "bytes", "worst_reader_s",
                                                "worst_loop_s", "idle_worst_reader_s",
                                                "idle_worst_loop_s", "peak_rss_mb")}
        emit({"bench": "device_listing", "figure": "device_listing", "ask": args.ask,
              "server": name, "devices": args.devices, "rounds": args.rounds, **summary})
        rows += [(f"{name}: {args.ask}", f"{summary['listing_s']:.2f} s",
                  f"{summary['bytes'] / 1e6:.1f} MB, {args.devices:,} devices"),
                 (f"{name}: worst shared-reader wait", f"{summary['worst_reader_s']:.3f} s",
                  f"idle: {summary['idle_worst_reader_s']:.3f} s"),
                 (f"{name}: worst loop wait", f"{summary['worst_loop_s']:.3f} s",
                  f"idle: {summary['idle_worst_loop_s']:.3f} s"),
                 (f"{name}: peak RSS", f"{summary['peak_rss_mb']:.0f} MiB", "")]
    table(rows)


if __name__ == "__main__":
    main()

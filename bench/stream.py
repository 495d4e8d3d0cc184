"""Live stream fan-out: many SSE clients (GET /api/stream) held by several client processes
against a real collector process, while topic events carrying their send time are published.
Reports delivery latency from publish to receipt (p50, p99, max), whether every client got every
event, and the collector's memory per connected client.

    python bench/stream.py [--clients 500] [--procs 4] [--events 100] [--rate 20]
                           [--client lean|aiohttp]

Latency is measured as receipt time minus the `sent` time the publisher wrote into the payload
just before its POST /api/events/{topic}, so it includes the HTTP request, the committed write
(synchronous=FULL), the fan-out and the client process reading its share of the frames. All the
processes run on this machine, so their clocks are one clock, and they share its cores: the
client processes' CPU time is reported next to the collector's, because on a small machine a
costly load generator shows up as latency that is not the collector's.

The default client (`lean`) is an asyncio protocol per connection that decodes the chunked body
and the frames in its data_received, on uvloop when installed. `--client aiohttp` uses one
aiohttp response per connection read by its own task, as a browser-like library client would;
it costs several times more CPU per frame.
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
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Http, cpu_seconds, emit, memory_kib, percentile, server, table


def _record(client: LeanClient | Client, data: dict[str, Any]) -> None:
    """Two latencies per event: from the publisher's `sent` (before its POST) and from the
    event's `at` (stamped when the hub published it, after the commit), both to receipt."""
    received = time.time()
    client.latencies.append(received - data["payload"]["sent"])
    client.fanout.append(received - datetime.fromisoformat(data["at"]).timestamp())
    client.seen.add(data["payload"]["n"])


class LeanClient(asyncio.Protocol):
    """One SSE connection read in data_received: HTTP/1.1 chunked decoding and frame splitting
    by hand, no task per connection (the load generator should cost little next to the
    collector it measures)."""

    def __init__(self, topic: str, host: str) -> None:
        self.topic = topic
        self.host = host
        self.latencies: list[float] = []
        self.fanout: list[float] = []
        self.seen: set[int] = set()
        self.transport: asyncio.Transport | None = None
        self.raw = bytearray()      # bytes as received
        self.body = bytearray()     # de-chunked body not yet split into frames
        self.headers_done = False
        self.chunk_left = -1        # bytes of the current chunk still to come (+2 for CRLF)
        self.hello: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.events = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport.write(f"GET /api/stream HTTP/1.1\r\nHost: {self.host}\r\n"
                        "Accept: text/event-stream\r\n\r\n".encode())

    def connection_lost(self, exc: Exception | None) -> None:
        for future in (self.hello, self.done):
            if not future.done():
                future.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.raw += data
        if not self.headers_done:
            end = self.raw.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.raw[:end]).lower()
            if not head.startswith(b"http/1.1 200") or b"transfer-encoding: chunked" not in head:
                if not self.hello.done():
                    self.hello.set_exception(
                        RuntimeError(f"unexpected stream answer: {head[:200]!r}"))
                assert self.transport is not None
                self.transport.close()
                return
            del self.raw[:end + 4]
            self.headers_done = True
        self._dechunk()
        self._take_frames()

    def _dechunk(self) -> None:
        raw = self.raw
        while True:
            if self.chunk_left < 0:
                line_end = raw.find(b"\r\n")
                if line_end < 0:
                    return
                self.chunk_left = int(raw[:line_end], 16) + 2
                del raw[:line_end + 2]
            if len(raw) < self.chunk_left:
                return
            self.body += raw[:self.chunk_left - 2]
            del raw[:self.chunk_left]
            self.chunk_left = -1

    def _take_frames(self) -> None:
        *frames, rest = self.body.split(b"\n\n")
        if not frames:
            return
        self.body = bytearray(rest)
        for frame in frames:
            if frame.startswith(b"retry:") and not self.hello.done():
                self.hello.set_result(None)
            if not frame.startswith(b"id:") or b"\nevent: topic\n" not in frame:
                continue
            data = json.loads(frame.split(b"\ndata: ", 1)[1])
            if data.get("topic") == self.topic:
                _record(self, data)
        if len(self.seen) >= self.events and not self.done.done():
            self.done.set_result(None)


async def _lean_run(url: str, topic: str, clients: int, events: int, timeout_s: float,
                    ready: Any) -> dict[str, Any]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    loop = asyncio.get_running_loop()
    conns = [LeanClient(topic, host) for _ in range(clients)]
    gate = asyncio.Semaphore(50)

    async def connect(client: LeanClient) -> None:
        client.events = events
        async with gate:
            await loop.create_connection(lambda: client, host, int(port))
            await asyncio.wait_for(client.hello, 30)

    await asyncio.gather(*(connect(c) for c in conns))
    cpu_started = time.process_time()
    ready.put(clients)
    await asyncio.wait([asyncio.ensure_future(c.done) for c in conns], timeout=timeout_s)
    cpu_s = time.process_time() - cpu_started
    for client in conns:
        if client.transport is not None:
            client.transport.close()
    return {"latencies": [x for c in conns for x in c.latencies],
            "fanout": [x for c in conns for x in c.fanout],
            "received": [len(c.seen) for c in conns], "cpu_s": cpu_s}


class Client:
    """One SSE connection; collects the delivery latency of each event of the bench topic."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.latencies: list[float] = []
        self.fanout: list[float] = []
        self.seen: set[int] = set()
        self.response: aiohttp.ClientResponse | None = None
        self.buffer = b""

    async def connect(self, session: aiohttp.ClientSession, url: str) -> None:
        self.response = await session.get(url + "/api/stream")
        if self.response.status != 200:
            raise RuntimeError(f"the stream answered {self.response.status}")
        while b"event: hello" not in self.buffer:
            self.buffer += await self.response.content.readany()

    def _take_frames(self) -> None:
        *frames, self.buffer = self.buffer.split(b"\n\n")
        for frame in frames:
            if not frame.startswith(b"id:") or b"\nevent: topic\n" not in frame:
                continue
            data = json.loads(frame.split(b"\ndata: ", 1)[1])
            if data.get("topic") == self.topic:
                _record(self, data)

    async def receive(self, events: int, deadline: float) -> None:
        assert self.response is not None
        self._take_frames()
        loop = asyncio.get_running_loop()
        while len(self.seen) < events and loop.time() < deadline:
            try:
                chunk = await asyncio.wait_for(self.response.content.readany(),
                                               max(0.01, deadline - loop.time()))
            except TimeoutError:
                break
            if not chunk:
                break  # the server ended the stream (dropped or stopping)
            self.buffer += chunk
            self._take_frames()
        self.response.close()


def _client_process(kind: str, url: str, topic: str, clients: int, events: int,
                    timeout_s: float, ready: Any, out: Any) -> None:
    if kind == "lean":
        runner: Any = asyncio.run
        with contextlib.suppress(ImportError):
            import uvloop
            runner = uvloop.run
        out.put(runner(_lean_run(url, topic, clients, events, timeout_s, ready)))
        return

    async def run() -> dict[str, Any]:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            conns = [Client(topic) for _ in range(clients)]
            gate = asyncio.Semaphore(50)

            async def connect(client: Client) -> None:
                async with gate:
                    await client.connect(session, url)

            await asyncio.gather(*(connect(c) for c in conns))
            cpu_started = time.process_time()
            ready.put(clients)
            deadline = asyncio.get_running_loop().time() + timeout_s
            await asyncio.gather(*(c.receive(events, deadline) for c in conns))
        return {"latencies": [x for c in conns for x in c.latencies],
                "fanout": [x for c in conns for x in c.fanout],
                "received": [len(c.seen) for c in conns],
                "cpu_s": time.process_time() - cpu_started}

    out.put(asyncio.run(run()))


async def _publish(url: str, topic: str, events: int, rate: float,
                   payload_bytes: int) -> tuple[list[float], list[float]]:
    """Publish at `rate`; the POST round trips (commit and fan-out included, as the reply
    follows both). Meanwhile a probe asks for an unknown /api path (a 404 from the middleware,
    no database) every PROBE_S on its own connection: its round trips show how long the
    collector's event loop is held at a time, the fan-out's stalls included."""
    http = Http(url.removeprefix("http://"))
    pad = "x" * max(0, payload_bytes)
    round_trips: list[float] = []
    probes: list[float] = []
    done = asyncio.Event()
    prober = asyncio.create_task(_probe(url, probes, done))
    for n in range(events):
        started = time.monotonic()
        status, body = await http.request("POST", f"/api/events/{topic}",
                                          {"sent": time.time(), "n": n, "pad": pad})
        round_trips.append(time.monotonic() - started)
        if status != 201:
            raise RuntimeError(f"publishing answered {status}: {body[:200]!r}")
        await asyncio.sleep(max(0.0, 1 / rate - (time.monotonic() - started)))
    done.set()
    await prober
    http.close()
    return round_trips, probes


PROBE_S = 0.005


async def _probe(url: str, probes: list[float], done: asyncio.Event) -> None:
    http = Http(url.removeprefix("http://"))
    while not done.is_set():
        started = time.monotonic()
        status, _body = await http.request("GET", "/api/bench-probe-404")
        if status != 404:
            raise RuntimeError(f"the probe answered {status}")
        probes.append(time.monotonic() - started)
        await asyncio.sleep(PROBE_S)
    http.close()


def _health(url: str) -> dict[str, Any]:
    async def get() -> dict[str, Any]:
        http = Http(url.removeprefix("http://"))
        _status, body = await http.request("GET", "/api/health")
        http.close()
        return dict(json.loads(body))

    return asyncio.run(get())


def _percentile(values: list[float], fraction: float) -> float | None:
    return percentile(values, fraction) if values else None


def run(url: str, pid: int | None, args: argparse.Namespace) -> dict[str, Any]:
    topic = "bench-stream-" + uuid.uuid4().hex[:8]
    ready: Any = multiprocessing.Queue()
    out: Any = multiprocessing.Queue()
    per_proc = [args.clients // args.procs + (1 if i < args.clients % args.procs else 0)
                for i in range(args.procs)]
    timeout_s = args.events / args.rate + 60
    load_before = Path("/proc/loadavg").read_text().split()[0]  # the machine is shared
    rss_before = memory_kib(pid)["VmRSS"] if pid else None
    workers = [multiprocessing.Process(target=_client_process, args=(
        args.client, url, topic, n, args.events, timeout_s + 120, ready, out))
        for n in per_proc if n]
    connect_started = time.monotonic()
    for worker in workers:
        worker.start()
    connected = sum(ready.get(timeout=180) for _ in workers)
    connect_s = time.monotonic() - connect_started
    health = _health(url)
    rss_connected = memory_kib(pid)["VmRSS"] if pid else None
    cpu_before = cpu_seconds(pid) if pid else None
    round_trips, probes = asyncio.run(_publish(url, topic, args.events, args.rate,
                                               args.payload))
    outcomes = [out.get(timeout=timeout_s + 180) for _ in workers]
    for worker in workers:
        worker.join()
    after = _health(url)
    latencies = [x for o in outcomes for x in o["latencies"]]
    fanout = [x for o in outcomes for x in o["fanout"]]
    received = [r for o in outcomes for r in o["received"]]
    return {
        "client": args.client,
        "clients": args.clients, "procs": len(workers), "events": args.events,
        "rate_per_s": args.rate, "payload_bytes": args.payload,
        "connected": connected, "stream_clients_seen": health["stream_clients"],
        "connect_s": round(connect_s, 3),
        "expected": args.clients * args.events, "delivered": sum(received),
        "clients_complete": sum(1 for r in received if r == args.events),
        "p50_ms": _ms(_percentile(latencies, 0.50)), "p99_ms": _ms(_percentile(latencies, 0.99)),
        "max_ms": _ms(max(latencies) if latencies else None),
        "mean_ms": _ms(statistics.fmean(latencies) if latencies else None),
        "fanout_p50_ms": _ms(_percentile(fanout, 0.50)),
        "fanout_p99_ms": _ms(_percentile(fanout, 0.99)),
        "post_p50_ms": _ms(_percentile(round_trips, 0.50)),
        "post_p99_ms": _ms(_percentile(round_trips, 0.99)),
        "probe_p50_ms": _ms(_percentile(probes, 0.50)),
        "probe_p99_ms": _ms(_percentile(probes, 0.99)),
        "probe_max_ms": _ms(max(probes) if probes else None),
        "dropped_clients": after.get("stream_dropped_clients", 0)
                           - health.get("stream_dropped_clients", 0),
        "server_rss_kib_before": rss_before, "server_rss_kib_connected": rss_connected,
        "server_kib_per_client": (round((rss_connected - rss_before) / max(connected, 1), 1)
                                  if rss_before and rss_connected else None),
        "server_cpu_s_publishing": (round(cpu_seconds(pid) - cpu_before, 3)
                                    if pid and cpu_before is not None else None),
        "client_cpu_s": round(sum(o["cpu_s"] for o in outcomes), 3),
        "loadavg_before": load_before,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=500, help="SSE clients in all")
    parser.add_argument("--procs", type=int, default=4, help="client processes")
    parser.add_argument("--events", type=int, default=100, help="topic events to publish")
    parser.add_argument("--rate", type=float, default=20.0, help="events published per second")
    parser.add_argument("--payload", type=int, default=100, help="padding bytes per event")
    parser.add_argument("--client", choices=("lean", "aiohttp"), default="lean",
                        help="the SSE client the client processes run (see the docstring)")
    parser.add_argument("--url", help="an already running collector (default: start one)")
    args = parser.parse_args()
    if args.clients < 1 or args.procs < 1 or args.events < 1 or args.rate <= 0:
        parser.error("--clients, --procs, --events and --rate must be positive")
    args.procs = min(args.procs, args.clients)
    if args.url:
        figures = run(args.url.rstrip("/"), None, args)
    else:
        with server("collector") as (address, pid):
            figures = run(f"http://{address}", pid, args)
    emit({"bench": "stream", "figure": "delivery", "cores": os.cpu_count(), **figures})
    table([
        ("SSE clients connected", f"{figures['connected']}",
         f"health said {figures['stream_clients_seen']}; in {figures['connect_s']} s"),
        ("events delivered", f"{figures['delivered']}/{figures['expected']}",
         f"{figures['clients_complete']} clients got every event"),
        ("latency p50 ms", f"{figures['p50_ms']}", "publish (POST) to receipt"),
        ("latency p99 ms", f"{figures['p99_ms']}", f"max {figures['max_ms']} ms"),
        ("from hub publish p50/p99 ms",
         f"{figures['fanout_p50_ms']}/{figures['fanout_p99_ms']}",
         "event's `at` (after the commit) to receipt"),
        ("POST round trip p50/p99 ms", f"{figures['post_p50_ms']}/{figures['post_p99_ms']}",
         "commit (synchronous=FULL) and fan-out, before the reply"),
        ("loop probe p50/p99/max ms",
         f"{figures['probe_p50_ms']}/{figures['probe_p99_ms']}/{figures['probe_max_ms']}",
         f"a 404 every {PROBE_S * 1000:g} ms meanwhile: how long the loop is held"),
        ("CPU s collector/clients", f"{figures['server_cpu_s_publishing']}/"
         f"{figures['client_cpu_s']}", f"{figures['client']} client; load avg "
         f"{figures['loadavg_before']} at start"),
        ("clients dropped", f"{figures['dropped_clients']}", "too slow to keep up"),
        ("server KiB per client", f"{figures['server_kib_per_client']}", "RSS growth / clients"),
    ])
    if figures["delivered"] != figures["expected"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

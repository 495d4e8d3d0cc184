"""Shared pieces of the benchmarks: servers as separate processes, a lean HTTP/1.1 client,
process CPU and memory from /proc, and the one-JSON-object-per-line report.

The client speaks keep-alive HTTP/1.1 over asyncio streams (no client library), so that the load
generator costs as little as possible and its own ceiling can be shown next to the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.collector import free_port, stop_process  # noqa: E402  (one definition, shared)

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat."""
    return _stat_cpu(Path(f"/proc/{pid}/stat"))


def main_thread_cpu_seconds(pid: int) -> float:
    """utime + stime of a process's main thread alone (its event loop's, in our services): the
    part that bounds throughput, since one thread runs every request and transaction body."""
    return _stat_cpu(Path(f"/proc/{pid}/task/{pid}/stat"))


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """utime + stime of each thread of a process, by thread id (a thread that ends meanwhile
    is left out)."""
    seconds = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            seconds[int(task.name)] = _stat_cpu(task / "stat")
        except OSError:
            continue
    return seconds


def pin_process(pid: int, cores: set[int]) -> None:
    """Keep a running process, every thread it has now, on these cores (threads it starts
    later inherit the mask of the thread that starts them)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cores)


def _stat_cpu(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class ClientRun:
    outcomes: list[Any]  # what each client process put on `out`, in the order they finished
    wall_s: float
    server_cpu_s: float
    server_main_cpu_s: float = 0.0  # the server's main thread alone (its event loop's)


def run_clients(target: Callable[..., None], per_process: list[tuple[Any, ...]], pid: int,
                wait_s: float) -> ClientRun:
    """One client process per argument tuple, running target(*args, ready, go, out).

    Each puts something on `ready` once set up (connected, registered), then waits for `go`; the
    server's CPU and the wall clock are measured from releasing them all together until each has
    put its outcome on `out`, so the set-up is never part of a figure.
    """
    ready: Any = multiprocessing.Queue()
    out: Any = multiprocessing.Queue()
    go = multiprocessing.Event()
    workers = [multiprocessing.Process(target=target, args=(*args, ready, go, out))
               for args in per_process]
    for worker in workers:
        worker.start()
    for _ in workers:
        ready.get(timeout=120)
    cpu_before, wall_before = cpu_seconds(pid), time.monotonic()
    main_before = main_thread_cpu_seconds(pid)
    go.set()
    outcomes = [out.get(timeout=wait_s) for _ in workers]
    wall = time.monotonic() - wall_before
    cpu = cpu_seconds(pid) - cpu_before
    main = main_thread_cpu_seconds(pid) - main_before
    for worker in workers:
        worker.join()
    return ClientRun(outcomes, wall, cpu, main)


def memory_kib(pid: int) -> dict[str, int]:
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0])
    return values


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile of a non-empty sample (`fraction` 0.5: the median)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def table(rows: list[tuple[str, str, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    print()
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:>14}  {note}")
    print()


def wait_http(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1):
            return
        time.sleep(0.02)
    raise RuntimeError(f"{url} did not answer")


def checkout(text: str) -> Path:
    """An argparse type for a tree to run the collector from (a `git worktree` of another
    commit): refused with a sentence when it holds no fleet_min package."""
    path = Path(text).resolve()
    if not (path / "fleet_min" / "__main__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a checkout of fleet_min (no "
                                         "fleet_min/__main__.py); make one with git worktree add")
    return path


@contextlib.contextmanager
def server(kind: str, env: dict[str, str] | None = None, tree: Path = ROOT,
           data_dir: Path | None = None) -> Iterator[tuple[str, int]]:
    """Start the collector ('collector'), the bare aiohttp server ('bare'), the bare server
    made durable ('durable') or that one keeping the spec's rules ('floor') as a process; the
    collector runs from `tree`, a checkout of this repository (this one by default), on a
    fresh data directory or on `data_dir` (a bench that fills the database itself)."""
    port = free_port()
    with (contextlib.nullcontext(str(data_dir)) if data_dir is not None
          else tempfile.TemporaryDirectory()) as data:
        if kind == "collector":
            argv = [sys.executable, "-m", "fleet_min", "collector", "--port", str(port),
                    "--data", data, "--bind", "127.0.0.1"]
            health = "/api/health"
        elif kind in ("durable", "floor"):
            argv = [sys.executable, str(ROOT / "bench" / f"{kind}_server.py"), str(port), data]
            health = "/api/health"
        else:
            argv = [sys.executable, str(ROOT / "bench" / "bare_server.py"), str(port)]
            health = "/api/health"
        proc = subprocess.Popen(argv, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree),
                                                     "FLEET_LOG_LEVEL": "WARNING", **(env or {})},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_http(f"http://127.0.0.1:{port}{health}")
            yield f"127.0.0.1:{port}", proc.pid
        finally:
            stop_process(proc)


class Http:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, address: str) -> None:
        self.host, port = address.rsplit(":", 1)
        self.port = int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        if self.writer is None:
            await self.connect()
        assert self.reader is not None and self.writer is not None
        payload = b"" if body is None else json.dumps(body).encode()
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Length: "
                f"{len(payload)}\r\nContent-Type: application/json\r\n\r\n").encode()
        self.writer.write(head + payload)
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("server closed the connection")
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        data = await self.reader.readexactly(length) if length else b""
        return status, data

    def close(self) -> None:
        if self.writer:
            self.writer.close()


@contextlib.contextmanager
def bare_script_server(script: str, *args: str) -> Iterator[tuple[str, int]]:
    """Run a bench's own bare aiohttp server (`script --serve-bare PORT ARGS...`, answering
    GET /api/health once it listens) for the block: its address and pid."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, script, "--serve-bare", str(port), *args],
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/api/health")
        yield f"127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def raise_nofile(needed: int | None = None) -> int:
    """Raise this process's descriptor limit (inherited by the servers it starts) to `needed`,
    or to the hard limit when None; the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if needed is None:
        if hard == resource.RLIM_INFINITY:
            return soft
        needed = hard
    if soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def serve_bare_polls(port: int, hold: float, posts: Iterable[str] = ()) -> None:
    """The ceiling server of the poll benches: a bare aiohttp app whose long poll only sleeps
    `hold` and answers 204, with GET /api/health (the polls held) and each path of `posts`
    answered {"ok": true} after reading its body (201 for /jobs), doing no work."""
    from aiohttp import web

    with contextlib.suppress(ImportError):
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    held = [0]

    async def next_job(request: web.Request) -> web.Response:
        held[0] += 1
        try:
            await asyncio.sleep(hold)
        finally:
            held[0] -= 1
        return web.Response(status=204)

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"ok": True}, status=201 if request.path == "/jobs" else 200)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "waiting_polls": held[0]})

    app = web.Application()
    app.router.add_get("/devices/{device_id}/next-job", next_job)
    for path in posts:
        app.router.add_post(path, answer)
    app.router.add_get("/api/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def register_devices(address: str, devices: list[str], connections: int = 8) -> None:
    """Register each device (declaring benchmark) over `connections` keep-alive connections."""
    async def worker(mine: list[str]) -> None:
        http = Http(address)
        for device in mine:
            status, body = await http.request("POST", "/devices/register", {
                "device_id": device, "descriptor": {"platform": "linux"},
                "capabilities": ["benchmark"]})
            if status != 200:
                raise RuntimeError(f"register answered {status}: {body[:200]!r}")
        http.close()

    await asyncio.gather(*(worker(devices[i::connections]) for i in range(connections)))

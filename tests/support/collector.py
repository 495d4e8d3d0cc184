"""Shared test helpers: real collector processes, free ports, spec builders."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def stop_process(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM,
                 timeout: float = 15) -> int:
    """Send sig (SIGTERM), then SIGKILL if it has not ended in time; the exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# Ports handed to servers the tests start come from below Linux's range for outgoing connections
# (32768-60999 by default), so no client socket of a test running beside it takes the port
# between this check and the server's bind; each pytest-xdist worker has a slice of its own, and
# within a process the ports are handed out in turn, never twice in a row.
_PORT_SLICE = 1800


def _port_sequence() -> Iterator[int]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    low = 12000 + (int(worker) % 11 if worker.isdigit() else 0) * _PORT_SLICE
    start = random.randrange(_PORT_SLICE)
    while True:
        for offset in range(_PORT_SLICE):
            yield low + (start + offset) % _PORT_SLICE


_PORTS = _port_sequence()


def free_port() -> int:
    """A port nothing on 127.0.0.1 listens on now (see above for why it stays free)."""
    for _ in range(_PORT_SLICE):
        port = next(_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # the whole slice taken: let the kernel choose
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def job(job_id: str, workload: str = "benchmark", executor: str = "device", **fields: Any
        ) -> dict[str, Any]:
    spec: dict[str, Any] = {"schema": 1, "job_id": job_id, "workload": workload,
                            "executor": executor}
    if workload == "benchmark" and executor == "device" and "backend" not in fields:
        spec["backend"] = "synthetic"
    spec.update(fields)
    return spec


def registration(device_id: str, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"device_id": device_id,
                            "descriptor": {"platform": "linux", "kind": "sbc", "ram_mb": 4096,
                                           "model": "Pi 5", "os": "Debian 12"}}
    body.update(fields)
    return body


def result_row(job_id: str, device_id: str, iteration: int = 0, **fields: Any) -> dict[str, Any]:
    return {"schema": 1, "kind": "result", "job_id": job_id, "device_id": device_id,
            "iter": iteration, **fields}


def host_job(job_id: str, workload: str, **fields: Any) -> dict[str, Any]:
    return job(job_id, workload=workload, executor="host", **fields)


def attached_registration(device_id: str, executor: str) -> dict[str, Any]:
    """A device as a host executor registers one attached to it."""
    return registration(device_id, capabilities=[], descriptor={
        "platform": "android", "serial": device_id, "attached_to": executor,
        "simulator": False})


async def executor_claim(client: Any, name: str, query: str = "") -> str | None:
    """A host executor's poll through an in-process client: the job id, or None on 204."""
    resp = await client.get(f"/executor/next-job?name={name}{query}")
    assert resp.status in (200, 204), await resp.text()
    return None if resp.status == 204 else (await resp.json())["job_id"]


def beacon(device_id: str, job_id: str | None = None, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"schema": 1, "kind": "beacon", "device_id": device_id,
                            "beacon": fields}
    if job_id:
        body["job_id"] = job_id
    return body


def age_rows(db_path: Path, sql: str, params: tuple[Any, ...] = ()) -> None:
    """Move recorded times into the past in the real database file (the tests' clock)."""
    edit_rows(db_path, sql, params)


def edit_rows(db_path: Path, sql: str, params: tuple[Any, ...] = ()) -> None:
    """Change rows in the real database file behind the collector's back (as an older version
    or another tool may have left them)."""
    conn = sqlite3.connect(db_path, timeout=30)
    try:
        conn.execute(sql, params)
        conn.commit()
    finally:
        conn.close()


class HttpClient:
    """A tiny blocking JSON client for tests that talk to a separate process."""

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")

    def request(self, method: str, path: str, body: Any = None, timeout: float = 30,
                headers: dict[str, str] | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
                return resp.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as err:
            raw = err.read()
            return err.code, json.loads(raw) if raw else None

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return self.request("POST", path, body if body is not None else {}, **kw)


class CollectorProcess:
    def __init__(self, data_dir: Path, port: int | None = None,
                 env: dict[str, str] | None = None, argv: list[str] | None = None,
                 cwd: Path | None = None, bind: str = "127.0.0.1") -> None:
        self.data_dir = data_dir
        self.bind = bind  # --bind, comma-separated; keep 127.0.0.1 in it for `client` below
        self.port = port or free_port()
        self.extra_env = env or {}
        self.argv = argv or [sys.executable, "-m", "fleet_min", "collector"]
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"collector-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def client(self) -> HttpClient:
        return HttpClient(self.url)

    def start(self, wait: bool = True) -> CollectorProcess:
        env = {**os.environ, "FLEET_LONG_POLL_S": "2", "FLEET_SWEEP_S": "1",
               "PYTHONPATH": str(ROOT), **self.extra_env}
        # The collector makes its data directory itself (with its mode); the log sits beside it.
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [*self.argv, "--port", str(self.port), "--data", str(self.data_dir),
             "--bind", self.bind],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd)
        log.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"collector exited {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(OSError):
                status, _ = self.client.get("/api/health", timeout=2)
                if status == 200:
                    return
            time.sleep(0.05)
        raise AssertionError(f"collector did not answer within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc is None:
            return 0
        code = stop_process(self.proc, sig, timeout)
        self.proc = None
        return code

    def kill9(self) -> None:
        self.stop(signal.SIGKILL)


@contextlib.contextmanager
def running_collector(data_dir: Path, **kw: Any) -> Iterator[CollectorProcess]:
    proc = CollectorProcess(data_dir, **kw).start()
    try:
        yield proc
    finally:
        proc.stop()


async def ended_before_a_device_listing(client: Any, paths: list[str]) -> int:
    """Ask for every path at once (each must answer 200), then for the device listing, which
    must list only the device "d": how many of the first requests had ended by the time the
    listing answered. Then wait for all of them. For costly reads that run on worker threads:
    however many are asked for, a listing must not wait behind them."""

    async def ask(path: str) -> None:
        resp = await client.get(path)
        assert resp.status == 200, await resp.text()
        await resp.read()

    asked = [asyncio.create_task(ask(path)) for path in paths]
    await asyncio.sleep(0.05)  # every one asked for
    resp = await client.get("/api/devices")
    assert resp.status == 200 and [d["device_id"] for d in (await resp.json())["devices"]] == ["d"]
    ended = sum(task.done() for task in asked)
    await asyncio.gather(*asked)
    return ended


async def wait_for_polls(client: Any, count: int) -> None:
    """Until the collector behind an aiohttp test client holds `count` long polls waiting."""
    for _ in range(300):
        if (await (await client.get("/api/health")).json())["waiting_polls"] == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{count} polls never waited")


def status_kib(pid: int, key: str) -> int:
    """A figure of the process's /proc status in KiB: VmRSS now, VmHWM its peak so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} for {pid}")


def wait_until(check: Callable[[], bool], timeout: float) -> bool:
    """Whether `check` came true within `timeout` seconds (asked every 50 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()

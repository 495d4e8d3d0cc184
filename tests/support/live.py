"""Live services for the contract tests: a seeded collector process and a control-plane daemon
over a fake host, both real subprocesses on free ports; and slow clients that trickle requests."""

from __future__ import annotations

import re
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tests.support import cp_fakes as fakes
from tests.support.collector import CollectorProcess
from tests.support.controlplane import Daemon, Host
from tests.support.cp_fixtures import BUSY_RUNNER, populate
from tests.support.fake_github import FakeGitHub
from tests.support.web_seed import Seeded, seed

# Short holds so fuzzed long polls end quickly; NORMAL sync: durability is not what is tested.
COLLECTOR_ENV = {"FLEET_LONG_POLL_S": "0.3", "FLEET_SQLITE_SYNCHRONOUS": "NORMAL",
                 "FLEET_SSE_KEEPALIVE_S": "1", "FLEET_LOG_LEVEL": "WARNING"}


@dataclass
class LiveCollector:
    proc: CollectorProcess
    seeded: Seeded

    @property
    def url(self) -> str:
        return self.proc.url


@dataclass
class LiveControlPlane:
    daemon: Daemon
    host: Host
    runner: str  # a runner that exists on the fake host

    @property
    def url(self) -> str:
        return self.daemon.url

    @property
    def token(self) -> str:
        return self.daemon.token


def start_collector(root: Path, **env: str) -> Iterator[LiveCollector]:
    proc = CollectorProcess(root / "data", env={**COLLECTOR_ENV, **env}).start()
    try:
        yield LiveCollector(proc, seed(proc.client))
    finally:
        proc.stop()


def start_controlplane(root: Path, **env: str) -> Iterator[LiveControlPlane]:
    github = FakeGitHub()
    github.start()
    host = Host(root, github)
    host.env.update({"FLEET_TICK_S": "1", "FLEET_BUSY_TICK_S": "1", "FLEET_GITHUB_S": "1",
                     "FLEET_LOG_LEVEL": "WARNING", **env})
    try:
        populate(host)
        daemon = Daemon(host)
        try:
            yield LiveControlPlane(daemon, host, BUSY_RUNNER)
        finally:
            daemon.stop()
    finally:
        fakes.kill_all_listeners(host.root)
        github.stop()


# --------------------------------------------------------------------------------------------
# Slow clients: started once per session, early, so their long wait overlaps the other tests.

SLOW_CAP_S = 100.0  # a probe gives up here: above aiohttp's 75-second keep-alive bound


@dataclass
class SlowClient:
    """A client that opens a connection, writes `head` and then one `trickle` a second, and
    records how the server ended it: "closed", "answered <status>", or "open" after the cap."""

    label: str
    base: str
    head: bytes
    trickle: bytes
    outcome: str = "running"
    seconds: float = 0.0

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name=f"slow-{self.label}", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        parts = urlsplit(self.base)
        started = time.monotonic()
        try:
            with socket.create_connection((parts.hostname or "", parts.port or 80),
                                          timeout=10) as sock:
                sock.sendall(self.head)
                self.outcome = self._trickle(sock, started)
        except OSError as exc:
            self.outcome = f"closed ({type(exc).__name__})"
        self.seconds = round(time.monotonic() - started, 1)

    def _trickle(self, sock: socket.socket, started: float) -> str:
        while time.monotonic() - started < SLOW_CAP_S:
            if self.trickle:
                sock.sendall(self.trickle)
            ready, _, _ = select.select([sock], [], [], 1.0)
            if ready:
                data = sock.recv(4096)
                if not data:
                    return "closed"
                status = re.match(rb"HTTP/1\.1 (\d{3})", data)
                return f"answered {status.group(1).decode()}" if status else f"sent {data[:40]!r}"
        return "open"


@dataclass
class SlowProbes:
    clients: dict[str, SlowClient]
    threads: list[threading.Thread]

    def result(self, label: str) -> SlowClient:
        for thread in self.threads:
            thread.join(SLOW_CAP_S + 30)
        return self.clients[label]

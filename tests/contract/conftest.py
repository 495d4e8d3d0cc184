"""Live services for the contract tests: a seeded collector process and a control-plane daemon
over a fake host (runner installations, fake systemctl on PATH, a fake GitHub API), both real
subprocesses on free ports.

`collector_live` and `controlplane_live` are shared by the session (the schemathesis run and
the slow clients); `start_collector` / `start_controlplane` give a module its own services, for
tests that compare the data before and after (test_hostile.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.live import (
    LiveCollector,
    LiveControlPlane,
    SlowClient,
    SlowProbes,
    start_collector,
    start_controlplane,
)


@pytest.fixture(scope="session")
def collector_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveCollector]:
    yield from start_collector(tmp_path_factory.mktemp("contract-collector"))


@pytest.fixture(scope="session")
def controlplane_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveControlPlane]:
    yield from start_controlplane(tmp_path_factory.mktemp("contract-cp"))


@pytest.fixture(scope="session")
def slow_probes(collector_live: LiveCollector,
                controlplane_live: LiveControlPlane) -> SlowProbes:
    head = b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    body = (b"POST /api/jobs/preview-targets HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
    upload = (b"POST /artifacts HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/octet-stream\r\nContent-Length: 100000\r\n\r\n")
    clients = {
        "collector header": SlowClient("collector header", collector_live.url, head, b"a"),
        "collector idle": SlowClient("collector idle", collector_live.url, b"", b""),
        "collector json body": SlowClient("collector json body", collector_live.url, body,
                                          b" "),
        "collector upload": SlowClient("collector upload", collector_live.url, upload, b"x"),
        "controlplane header": SlowClient("controlplane header", controlplane_live.url,
                                          head.replace(b"/api/health", b"/api/state"), b"a"),
        "controlplane idle": SlowClient("controlplane idle", controlplane_live.url, b"", b""),
        "controlplane json body": SlowClient(
            "controlplane json body", controlplane_live.url,
            body.replace(b"/api/jobs/preview-targets", b"/api/host/heartbeat").replace(
                b"Host: 127.0.0.1\r\n", b"Host: 127.0.0.1\r\nAuthorization: Bearer "
                + controlplane_live.token.encode() + b"\r\n"), b" "),
    }
    return SlowProbes(clients, [client.start() for client in clients.values()])

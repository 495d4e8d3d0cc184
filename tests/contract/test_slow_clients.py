"""Slow clients (slow loris): a client that trickles its request must not hold a connection for
ever, nor stall anyone else.

aiohttp has no separate header or body read timeout. What ends a connection that never
completes a request is its keep-alive timer: armed when the connection opens, it closes the
connection when no complete request has arrived by then. `web.run_app` (the collector) sets it
to 75 s; a bare `web.AppRunner` (the control plane) leaves aiohttp's default of 3630 s. A request
whose head is complete but whose body trickles is read by our handlers, with no timer at all.

The probes (tests/contract/conftest.py `slow_probes`) run in threads from the start of the
session against the shared live services, each giving up after SLOW_CAP_S; these tests collect
their outcome, so their wait overlaps the schemathesis run when the whole suite runs.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from tests.support.live import LiveCollector, SlowProbes
from tests.support.raw_http import send, status_of

# Each probe waits out a server's keep-alive bound (75 s): a fault loop, out of the fast lane.
pytestmark = pytest.mark.slow

ENDED = ("closed", "answered 4")


@pytest.mark.parametrize("label", ["collector header", "collector idle",
                                   "controlplane header", "controlplane idle"])
def test_a_connection_without_a_complete_request_is_closed(label: str,
                                                           slow_probes: SlowProbes) -> None:
    probe = slow_probes.result(label)
    assert probe.outcome.startswith(ENDED), (
        f"{label}: still {probe.outcome} after {probe.seconds} s (aiohttp's keep-alive timer is "
        "the only bound: pass keepalive_timeout to web.AppRunner)")
    print(f"{label}: {probe.outcome} after {probe.seconds} s")


@pytest.mark.parametrize("label", ["collector json body", "controlplane json body",
                                   "collector upload"])
def test_a_trickling_body_is_cut_off(label: str, slow_probes: SlowProbes) -> None:
    probe = slow_probes.result(label)
    assert probe.outcome.startswith(ENDED), (
        f"{label}: still {probe.outcome} after {probe.seconds} s: a body that trickles in "
        "holds its handler with no time limit")
    print(f"{label}: {probe.outcome} after {probe.seconds} s")


def test_many_slow_clients_do_not_stall_the_service(collector_live: LiveCollector) -> None:
    parts = urlsplit(collector_live.url)
    sockets = []
    try:
        for i in range(100):
            sock = socket.create_connection((parts.hostname or "", parts.port or 80), timeout=10)
            sock.sendall(b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow-%d: " % i)
            sockets.append(sock)
        for _ in range(3):
            for sock in sockets:
                sock.sendall(b"a")
            assert send(collector_live.url, "GET", "/api/health").status == 200
            reply = send(collector_live.url, "POST", "/jobs/sweep")
            assert reply.status == 200, reply
    finally:
        for sock in sockets:
            sock.close()


def test_a_body_sent_in_pieces_is_read_whole(collector_live: LiveCollector) -> None:
    """TCP delivers a body in as many pieces as it likes; the JSON reader must wait for all."""
    body = json.dumps({"workload": "benchmark", "backend": "synthetic",
                       "targets": {"match": "ram_mb >= 1"}}).encode()
    parts = urlsplit(collector_live.url)
    with socket.create_connection((parts.hostname or "", parts.port or 80), timeout=30) as sock:
        sock.sendall(b"POST /api/jobs/preview-targets HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        for piece in (body[:10], body[10:30], body[30:]):
            sock.sendall(piece)
            time.sleep(0.2)  # lets the server read each piece on its own
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert status_of(answer) == 200, answer[:400]

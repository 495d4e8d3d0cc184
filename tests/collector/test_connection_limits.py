"""What one client's connections may cost a real collector process, over real sockets: a
request head is held to a few dozen lines, so unfinished heads stay small; a client that stops
reading a download or a live-mirror stream is cut off after the write-stall deadline, and the
mirror's viewers share one copy of a frame; connections past a cap below the descriptor limit
are closed at once, so the health check and SQLite still have descriptors; one peer may hold
only its share of that cap, loopback any number; a body that is not what its Content-Encoding
says is a 400 without a traceback. Memory is read from /proc/<pid>/status (VmRSS, VmHWM); each
wait below is a deadline, not a measurement."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import ipaddress
import json
import os
import select
import socket
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.collector import (
    CollectorProcess,
    HttpClient,
    job,
    registration,
    status_kib,
    wait_until,
)

pytestmark = pytest.mark.slow

MIB = 1 << 20
STALL_S = 2
# The collector run under plain asyncio (no uvloop), with a descriptor limit when asked: the
# same entry point as `python -m fleet_min`.
_BOOT = ("import resource, sys\n"
         "limit = int(sys.argv.pop(1))\n"
         "if limit: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))\n"
         "if sys.argv.pop(1) == 'asyncio': sys.modules['uvloop'] = None\n"
         "from fleet_min.cli import main\n"
         "raise SystemExit(main())\n")


def collector(tmp_path: Path, loop: str = "uvloop", nofile: int = 0,
              env: dict[str, str] | None = None, bind: str = "127.0.0.1") -> CollectorProcess:
    argv = [sys.executable, "-c", _BOOT, str(nofile), loop, "collector"]
    return CollectorProcess(tmp_path / "data", argv=argv, env=env, bind=bind).start()


@pytest.fixture
def started() -> Iterator[list[CollectorProcess]]:
    procs: list[CollectorProcess] = []
    yield procs
    for proc in procs:
        proc.stop()


def raw_request(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request on a connection of its own: the status and the body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def unread_bytes(port: int) -> int:
    """Bytes the kernel holds that the collector has not read yet, on its side of every
    connection to `port` (rx_queue in /proc/net/tcp)."""
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port:
            total += int(fields[4].split(":")[1], 16)
    return total


def small_window_socket(port: int) -> socket.socket:
    """A client that reads nothing: a 4 KiB receive buffer, so the collector's answer piles up
    on the collector's side."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    return sock


def drain_until_closed(sock: socket.socket, timeout: float = 30) -> int:
    """Read what was queued for a client until the collector's side is closed: the bytes."""
    sock.settimeout(timeout)
    received = 0
    try:
        while chunk := sock.recv(1 << 20):
            received += len(chunk)
    except ConnectionResetError:
        pass
    return received


# -- request heads --------------------------------------------------------------------------------


def test_a_head_past_the_limits_is_refused_and_unfinished_heads_stay_small(tmp_path, started):
    proc = collector(tmp_path)
    started.append(proc)
    start = b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"

    def lines(count: int, size: int) -> bytes:
        return b"".join(b"X-H%d: %s\r\n" % (i, b"a" * size) for i in range(count))

    assert raw_request(proc.port, start + lines(40, 10) + b"\r\n")[0] in (400, 431)
    assert raw_request(proc.port, start + lines(1, 9000) + b"\r\n")[0] in (400, 431)
    # A browser's head with a Cookie that other sites on the host name filled still passes.
    assert raw_request(proc.port, start + lines(20, 100) + b"Cookie: " + b"c" * 8000
                       + b"\r\n\r\n")[0] == 200

    # 200 connections each send 125 header lines of 8,000 bytes (within aiohttp's defaults)
    # and never end the head; with those defaults each held about 2 MiB of the collector.
    attack = start + lines(125, 8000)
    before = status_kib(proc.proc.pid, "VmRSS")
    socks = []
    for _ in range(200):
        sock = socket.create_connection(("127.0.0.1", proc.port), timeout=30)
        socks.append(sock)
        with contextlib.suppress(OSError):  # refused and closed before the head was all sent
            sock.sendall(attack)
    assert wait_until(lambda: unread_bytes(proc.port) == 0, 60)
    assert proc.client.get("/api/health")[0] == 200
    grown = status_kib(proc.proc.pid, "VmRSS") - before
    for sock in socks:
        sock.close()
    assert grown < 200 * 1280, f"RSS grew {grown} KiB for 200 unfinished heads"


# -- clients that stop reading --------------------------------------------------------------------


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])  # read and write; sendfile
def test_a_download_never_read_is_cut_while_an_honest_one_completes(tmp_path, started, loop):
    proc = collector(tmp_path, loop, env={"FLEET_WRITE_STALL_S": str(STALL_S)})
    started.append(proc)
    data = os.urandom(32 * MIB)
    upload = urllib.request.Request(f"{proc.url}/artifacts", data=data, method="POST",
                                    headers={"Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(upload, timeout=60) as resp:
        sha = json.loads(resp.read())["sha256"]

    stuck = small_window_socket(proc.port)
    stuck.sendall(f"GET /artifacts/{sha} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    with urllib.request.urlopen(f"{proc.url}/artifacts/{sha}", timeout=60) as resp:
        assert hashlib.sha256(resp.read()).hexdigest() == sha

    assert wait_until(lambda: "took nothing for 2 s" in proc.log(), 30), proc.log()
    assert drain_until_closed(stuck) < len(data)
    stuck.close()
    assert wait_until(lambda: proc.client.get("/api/health")[1]["connections"]["held"] == 1, 10)
    assert "Traceback" not in proc.log()


def post_bulky_jobs(proc: CollectorProcess, count: int) -> None:
    """Jobs whose params are near the 1 MiB a body may be: a job's own record carries its
    spec whole (listings cut it down)."""
    for n in range(count):
        assert proc.client.post("/jobs", job(f"bulky-{n}", params={
            "blob": "x" * 900_000}))[0] == 201


def pipelined_records(count: int, close: bool = False) -> bytes:
    """Requests for the bulky jobs' records, one after another on one connection: the answers
    together are more than the kernel's socket buffers take (about 3 MB here)."""
    requests = [f"GET /api/jobs/bulky-{n} HTTP/1.1\r\nHost: 127.0.0.1\r\n" for n in range(count)]
    if close:
        requests[-1] += "Connection: close\r\n"
    return "".join(request + "\r\n" for request in requests).encode()


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_large_answer_never_read_is_cut_and_its_memory_returns(tmp_path, started, loop):
    # aiohttp hands a whole JSON answer to the transport at once: a client that asks for
    # megabytes and reads none of it held them for as long as it kept the socket.
    proc = collector(tmp_path, loop, env={"FLEET_WRITE_STALL_S": str(STALL_S)})
    started.append(proc)
    post_bulky_jobs(proc, 12)
    stuck = [small_window_socket(proc.port) for _ in range(4)]
    for sock in stuck:
        sock.sendall(pipelined_records(12))  # 10.8 MB of answers each
    # Cut by the collector while their clients still hold them open, reading nothing.
    assert wait_until(lambda: proc.client.get("/api/health")[1]["connections"]["held"] == 1,
                      30), proc.log()
    assert "took nothing for 2 s of the" in proc.log()
    for sock in stuck:
        assert drain_until_closed(sock) < 10 * MIB
        sock.close()
    assert "Traceback" not in proc.log()


def test_a_slow_steady_reader_of_a_large_answer_is_not_cut(tmp_path, started):
    proc = collector(tmp_path, env={"FLEET_WRITE_STALL_S": str(STALL_S)})
    started.append(proc)
    post_bulky_jobs(proc, 6)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.connect(("127.0.0.1", proc.port))
    sock.sendall(pipelined_records(6, close=True))  # 5.4 MB of answers
    # About 640 KiB a second, with pauses: far slower than the answers could go, never idle
    # for the stall time, so every answer arrives whole.
    answer = b""
    sock.settimeout(30)
    while True:
        time.sleep(0.1)
        chunk = sock.recv(64 << 10)
        if not chunk:
            break
        answer += chunk
    sock.close()
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 6
    assert answer.count(b"x" * 900_000) == 6
    assert "took nothing" not in proc.log()


def start_mirror(proc: CollectorProcess, frame: bytes) -> None:
    client = proc.client
    assert client.post("/jobs", job("run", workload="soak", executor="host",
                                    params={"app_id": "com.example"}))[0] == 201
    assert client.get("/executor/next-job?name=lab")[0] == 200
    post = urllib.request.Request(f"{proc.url}/api/jobs/run/mirror?executor=lab", data=frame,
                                  method="POST", headers={"Content-Type": "image/jpeg"})
    with urllib.request.urlopen(post, timeout=30) as resp:
        assert resp.status == 204


def test_mirror_viewers_that_never_read_share_one_frame_and_are_cut(tmp_path, started):
    proc = collector(tmp_path, env={"FLEET_WRITE_STALL_S": str(STALL_S),
                                    "FLEET_MAX_MIRROR_BYTES": "8M"})
    started.append(proc)
    frame = b"\xff\xd8\xff\xe0" + os.urandom(4 * MIB) + b"\xff\xd9"
    start_mirror(proc, frame)
    peak = status_kib(proc.proc.pid, "VmHWM")  # the frame's own upload already counted

    viewers = [small_window_socket(proc.port) for _ in range(40)]
    for sock in viewers:
        sock.sendall(b"GET /api/jobs/run/mirror HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    # Each viewer is sent the held frame as soon as it joins; then, reading nothing, it is cut.
    wait_until(lambda: "took nothing for 2 s" in proc.log(), 30)
    grown = status_kib(proc.proc.pid, "VmHWM") - peak
    assert grown < 40 * 4 * 1024 // 4, f"peak RSS grew {grown} KiB for 40 viewers of 4 MiB"
    assert "took nothing for 2 s" in proc.log()
    for sock in viewers:
        assert drain_until_closed(sock) < len(frame)
        sock.close()
    assert "Traceback" not in proc.log()


# 1.6 MB of replay: more than the new send buffer, less than the kernel grew one to.
EVENTS = 400


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_stream_clients_that_never_read_a_replay_are_cut(tmp_path, started, loop):
    """Topic events of 4 KB, replayed to clients that asked from the start and read none of it:
    the kernel took each client's megabytes whole into a send buffer grown to its maximum
    (1 GB of kernel memory for 300 clients, seconds of the event loop to copy it in), the
    transport held nothing past its high-water mark, and nothing ever cut them. A stream's send
    buffer is now small, so what the client does not take waits where the stall watch sees it."""
    proc = collector(tmp_path, loop, env={"FLEET_WRITE_STALL_S": str(STALL_S)})
    started.append(proc)
    payload = json.dumps({"x": "y" * 4000}).encode()
    for _ in range(EVENTS):
        status, _ = raw_request(proc.port, b"POST /api/events/fill HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                b"Content-Type: application/json\r\nConnection: close\r\n"
                                b"Content-Length: %d\r\n\r\n" % len(payload), payload)
        assert status == 201, status
    clients = [small_window_socket(proc.port) for _ in range(5)]
    for sock in clients:
        sock.sendall(b"GET /api/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nLast-Event-ID: 0\r\n\r\n")
    assert wait_until(lambda: proc.log().count("took nothing for 2 s") >= 1, 30), proc.log()
    for sock in clients:
        # Cut: what was queued ends (a client left open would see the replay, then keep-alives,
        # and never the end of its connection).
        assert drain_until_closed(sock, timeout=20) < EVENTS * len(payload)
        sock.close()
    assert "Traceback" not in proc.log()


# -- the descriptor limit -------------------------------------------------------------------------


@pytest.mark.parametrize(("loop", "cap"), [("uvloop", 400 - 128),
                                           ("asyncio", 400 - 128 - 128)])  # its accept burst
def test_connections_past_the_cap_are_closed_and_the_database_still_opens(tmp_path, started,
                                                                         loop, cap):
    proc = collector(tmp_path, loop, nofile=400)
    started.append(proc)
    client = proc.client
    status, health = client.get("/api/health")
    assert status == 200 and health["connections"]["cap"] == cap
    assert wait_until(lambda: client.get("/api/health")[1]["connections"]["held"] == 1, 10)

    extra = 150  # past the cap, and past the descriptor limit with the cap's connections
    socks = [socket.create_connection(("127.0.0.1", proc.port), timeout=10)
             for _ in range(cap + extra)]

    def closed() -> list[socket.socket]:
        readable, _, _ = select.select(socks, [], [], 0)  # an idle held one has nothing to say
        return readable

    assert wait_until(lambda: len(closed()) >= extra, 30), proc.log()
    assert wait_until(lambda: "new ones are closed at once" in proc.log(), 10), proc.log()
    refused = closed()
    assert extra <= len(refused) <= extra + 1  # the first health check's may not be gone yet
    held = [sock for sock in socks if sock not in refused]
    for sock in held[:10]:
        sock.close()

    def health_answers() -> bool:
        try:
            return client.get("/api/health", timeout=5)[0] == 200
        except OSError:
            return False

    assert wait_until(health_answers, 30), proc.log()
    report = client.get("/api/health")[1]["connections"]
    assert report["cap"] == cap and report["held"] <= cap and report["refused"] >= extra
    assert client.post("/jobs", job("after-the-cap"))[0] == 201  # SQLite still writes
    assert client.get("/jobs/after-the-cap")[0] == 200
    for sock in socks:
        sock.close()
    assert "Traceback" not in proc.log() and " ERROR " not in proc.log(), proc.log()


# -- one peer's share ----------------------------------------------------------------------------


def bindable(address: str) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family) as sock:
            sock.bind((address, 0))
    except OSError:
        return False
    return True


def own_address(family: socket.AddressFamily) -> str | None:
    """An address of this machine's own that is not loopback (nor link-local): the one it
    would send from to another host (a UDP connect sends nothing), else one its host name
    resolves to (IPv4) or one of its interfaces has (IPv6, from /proc/net/if_inet6)."""
    found = []
    probe = "192.0.2.1" if family == socket.AF_INET else "2001:db8::1"  # documentation nets
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as udp:
        udp.connect((probe, 9))
        found.append(str(udp.getsockname()[0]))
    with contextlib.suppress(OSError):
        found += [str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None,
                                                                 family)]
    if family == socket.AF_INET6 and Path("/proc/net/if_inet6").exists():
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            found.append(str(ipaddress.IPv6Address(bytes.fromhex(line.split()[0]))))
    for address in found:
        ip = ipaddress.ip_address(address.partition("%")[0])
        if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified) and bindable(address):
            return address
    return None


def lan_address() -> str:
    """This machine's own non-loopback IPv4 address: a connection to it from it comes from it,
    so the collector sees a peer that is not loopback."""
    address = own_address(socket.AF_INET)
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from as a peer "
                    "that is not loopback")
    return address


def connect(address: str, port: int, count: int) -> list[socket.socket]:
    return [socket.create_connection((address, port), timeout=10) for _ in range(count)]


def closed(socks: list[socket.socket]) -> list[socket.socket]:
    """The connections the collector has closed (an idle held one has nothing to say)."""
    return select.select(socks, [], [], 0)[0]


def health_answers(proc: CollectorProcess) -> bool:
    try:
        return proc.client.get("/api/health", timeout=5)[0] == 200
    except OSError:
        return False


def connections(proc: CollectorProcess) -> dict[str, int]:
    report: dict[str, int] = proc.client.get("/api/health")[1]["connections"]
    return report


def holds(proc: CollectorProcess, count: int) -> bool:
    """The collector holds `count` connections besides the health check asking."""
    return wait_until(lambda: connections(proc)["held"] == count + 1, 10)


# Two listening sockets: asyncio's loop keeps a burst of 128 aside for each.
@pytest.mark.parametrize(("loop", "nofile", "cap", "share"), [
    ("uvloop", 400, 400 - 128, (400 - 128) // 4),  # a quarter of the cap
    ("asyncio", 600, 600 - 128 - 2 * 128, 64)])  # a quarter of 216 is under the least share
def test_one_peer_holds_only_its_share_of_the_cap_and_loopback_is_still_served(
        tmp_path, started, loop, nofile, cap, share):
    lan = lan_address()
    proc = collector(tmp_path, loop, nofile=nofile, bind=f"127.0.0.1,{lan}")
    started.append(proc)

    # A LAN neighbour opens as many connections as the whole cap, and more.
    flood = connect(lan, proc.port, cap + 20)
    assert flood[0].getsockname()[0] == lan  # a peer that is not loopback
    # The health check still answers, over loopback, and SQLite still writes.
    assert wait_until(lambda: health_answers(proc), 15), proc.log()
    assert proc.client.post("/jobs", job("past-the-share"))[0] == 201
    assert wait_until(lambda: len(closed(flood)) >= len(flood) - share, 20), proc.log()
    assert holds(proc, share), connections(proc)
    assert len(closed(flood)) == len(flood) - share
    report = connections(proc)
    assert report["cap"] == cap and report["peer_cap"] == share
    # asyncio's loop makes (and counts) a burst of protocols before it knows their peers, so
    # part of the flood may meet the cap itself there; none of it is counted as held.
    assert report["peer_refused"] + report["refused"] == len(flood) - share
    assert report["peer_refused"] >= 1 and (loop == "asyncio" or report["refused"] == 0)
    assert wait_until(lambda: f"{lan} holds {share} connections, the most one peer may hold "
                              f"(FLEET_MAX_PEER_CONNECTIONS); new ones from it are closed at "
                              f"once" in proc.log(), 10), proc.log()

    # Once they are closed, nothing is left counted: the peer has its whole share again.
    for sock in flood:
        sock.close()
    assert holds(proc, 0), connections(proc)
    again = connect(lan, proc.port, share + 5)
    assert wait_until(lambda: len(closed(again)) >= 5, 20), proc.log()
    assert holds(proc, share), connections(proc)
    assert len(closed(again)) == 5
    for sock in again:
        sock.close()
    assert holds(proc, 0), connections(proc)
    assert "Traceback" not in proc.log() and " ERROR " not in proc.log(), proc.log()


def test_each_peer_has_a_share_of_its_own(tmp_path, started):
    lan = lan_address()
    lan6 = own_address(socket.AF_INET6)
    if lan6 is None:
        pytest.skip("this machine has no IPv6 address but loopback and link-local ones, so no "
                    "second peer that is not loopback")
    proc = collector(tmp_path, env={"FLEET_MAX_PEER_CONNECTIONS": "8"},
                     bind=f"127.0.0.1,{lan},{lan6}")
    started.append(proc)
    first = connect(lan, proc.port, 20)
    assert wait_until(lambda: len(closed(first)) >= 12, 20), proc.log()
    # The first peer is at its share; the second is served, up to a share of its own.
    assert HttpClient(f"http://[{lan6}]:{proc.port}").get("/api/health")[0] == 200
    assert holds(proc, 8), connections(proc)  # that request's connection is gone again
    second = connect(lan6, proc.port, 20)
    assert wait_until(lambda: len(closed(second)) >= 12, 20), proc.log()
    assert holds(proc, 16), connections(proc)
    assert len(closed(first)) == len(closed(second)) == 12
    with pytest.raises(OSError):  # the first peer's next connection is closed unanswered
        HttpClient(f"http://{lan}:{proc.port}").get("/api/health", timeout=5)
    for sock in first + second:
        sock.close()
    assert holds(proc, 0), connections(proc)
    assert connections(proc)["peer_refused"] == 12 + 12 + 1


def test_loopback_is_exempt_from_the_share(tmp_path, started):
    hosts = ["127.0.0.1"] + (["::1"] if bindable("::1") else [])
    proc = collector(tmp_path, env={"FLEET_MAX_PEER_CONNECTIONS": "8"}, bind=",".join(hosts))
    started.append(proc)
    local = [sock for host in hosts for sock in connect(host, proc.port, 40)]
    assert holds(proc, len(local)), connections(proc)
    assert closed(local) == []
    report = connections(proc)
    assert report["peer_cap"] == 8 and report["peer_refused"] == 0 and report["refused"] == 0
    for sock in local:
        sock.close()
    assert holds(proc, 0), connections(proc)


def test_a_share_of_0_turns_the_rule_off(tmp_path, started):
    lan = lan_address()
    proc = collector(tmp_path, env={"FLEET_MAX_PEER_CONNECTIONS": "0"},
                     bind=f"127.0.0.1,{lan}")
    started.append(proc)
    socks = connect(lan, proc.port, 100)  # past the least share (64) auto would give
    assert holds(proc, len(socks)), connections(proc)
    assert closed(socks) == []
    assert connections(proc)["peer_cap"] == 0
    for sock in socks:
        sock.close()


# -- bodies ---------------------------------------------------------------------------------------


def test_a_body_not_in_its_content_encoding_is_a_400_without_a_traceback(tmp_path, started):
    proc = collector(tmp_path)
    started.append(proc)
    body = json.dumps(registration("plain")).encode()

    def post(encoded: bytes) -> tuple[int, bytes]:
        head = (f"POST /devices/register HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nContent-Encoding: gzip\r\n"
                f"Content-Length: {len(encoded)}\r\nConnection: close\r\n\r\n").encode()
        return raw_request(proc.port, head, encoded)

    for _ in range(5):
        status, answer = post(body)
        assert status == 400
        assert "content-encoding" in json.loads(answer)["error"].lower()
    assert post(gzip.compress(body))[0] in (200, 201)  # a real gzip body is still read
    log = proc.log()
    assert "Traceback" not in log and " ERROR " not in log, log


@pytest.mark.parametrize("path", ["/results", "/api/events/t1"])
def test_an_encoded_body_refused_is_not_read_on(tmp_path, started, path):
    """aiohttp reads on through a body its handler left unread, for up to 10 s, inflating each
    piece of a Content-Encoding on the event loop: one gzip megabyte (a gigabyte of zeros)
    refused at once with 413 still held the loop up to a second. The collector answers and
    closes instead, without waiting for the rest. Closing a socket with bytes still arriving
    resets it, so a sender still sending may see the reset before the 413: either ends it."""
    proc = collector(tmp_path)
    started.append(proc)
    zeros = gzip.compress(bytes(64 << 20), compresslevel=1)  # 64 MiB of zeros, ~64 KiB sent
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\nContent-Encoding: gzip\r\n"
            f"Content-Length: {2 << 20}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", proc.port), timeout=30) as sock:
        sock.sendall(head + zeros)  # a part of the declared 2 MiB: the rest never comes
        sock.settimeout(5)  # well inside aiohttp's 10 s of lingering
        answer = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                pytest.fail(f"the connection stayed open after the answer: {answer[:200]!r}")
            except ConnectionResetError:
                break
            if not chunk:
                break
            answer += chunk
    assert answer == b"" or answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert proc.client.get("/api/health")[0] == 200

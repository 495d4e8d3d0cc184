"""The live stream (GET /api/stream) through HTTP against real collectors: the hello, the event
each write path emits, Last-Event-ID resume, keep-alives, the client count, 500 clients at once
and a client that stops reading."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fleet_min.sse import EventHub, stream
from tests.support.collector import CollectorProcess, beacon, job, registration, result_row
from tests.support.stream import READ_TIMEOUT_S, StreamReader, parse_frame


def has_fields(data: dict[str, Any], **expected: Any) -> None:
    for key, value in expected.items():
        assert key in data, (key, data)
        assert data[key] == value, (key, data)


# -- shape -------------------------------------------------------------------------------------


async def test_hello_on_connect(client):
    health = await (await client.get("/api/health")).json()
    async with StreamReader(client) as reader:
        assert reader.hello["collector"] == health["collector"]
        assert reader.hello["instance"] == health["instance"]
        assert reader.hello["at"].endswith("Z")
        assert reader.hello_retry is not None and int(reader.hello_retry) > 0
        assert reader.response is not None
        assert reader.response.headers["Cache-Control"] == "no-cache"
        # sent with the head, before any event: a stream is never framed or sniffed
        assert reader.response.headers["X-Content-Type-Options"] == "nosniff"
        assert reader.response.headers["X-Frame-Options"] == "DENY"


async def test_every_write_path_emits_its_documented_event(client):
    async with StreamReader(client) as reader:
        await client.post("/devices/register", json=registration("d1"))
        has_fields(await reader.next_of("device"), type="device", device_id="d1")

        await client.post("/jobs", json=job("j1"))
        has_fields(await reader.next_of("job"), job_id="j1", status="queued",
                   workload="benchmark", executor="device")

        assert (await client.get("/devices/d1/next-job")).status == 200
        has_fields(await reader.next_of("job"), job_id="j1", status="claimed",
                   workload="benchmark", executor="device")

        await client.post("/results", json=beacon("d1", "j1", battery_pct=80))
        has_fields(await reader.next_of("beacon"), device_id="d1", job_id="j1",
                   lease_renewed=True, preempt=False)

        await client.post("/results", json=result_row("j1", "d1", 1, ok=True))
        has_fields(await reader.next_of("result"), job_id="j1", device_id="d1", iter=1,
                   final=False)

        await client.post("/results", json=result_row("j1", "d1", 0, final=True, ok=True))
        has_fields(await reader.next_of("result"), job_id="j1", device_id="d1", iter=0,
                   final=True)
        has_fields(await reader.next_of("job"), job_id="j1", status="done")


async def test_an_idle_beacon_names_no_job(client):
    await client.post("/devices/register", json=registration("d2"))
    async with StreamReader(client) as reader:
        await client.post("/results", json=beacon("d2", battery_pct=50))
        has_fields(await reader.next_of("beacon"), device_id="d2", job_id=None,
                   lease_renewed=False, preempt=False)


async def test_a_refused_write_emits_nothing(client):
    async with StreamReader(client) as reader:
        resp = await client.post("/jobs", json={"schema": 1})
        assert resp.status == 400
        await client.post("/devices/register", json=registration("marker"))
        first = await reader.event()  # the refused job left no event ahead of the marker
        assert first["type"] == "device" and first["device_id"] == "marker"


# -- resume ------------------------------------------------------------------------------------


async def _device_ids(reader: StreamReader, count: int) -> list[tuple[str, str]]:
    seen = []
    while len(seen) < count:
        data = await reader.event()
        if data["type"] == "device":
            seen.append((data["_id"], data["device_id"]))
    return seen


async def test_last_event_id_replays_only_later_events(client):
    async with StreamReader(client) as reader:
        for name in ("r1", "r2", "r3"):
            await client.post("/devices/register", json=registration(name))
        seen = await _device_ids(reader, 3)
    await client.post("/devices/register", json=registration("r4"))  # while disconnected
    resume_after = seen[1][0]  # the id of r2's event
    async with StreamReader(client, last_event_id=resume_after) as again:
        replayed = await _device_ids(again, 2)
        assert [name for _, name in replayed] == ["r3", "r4"]
        assert replayed[0][0] == seen[2][0]  # the same id as first delivered
        await client.post("/devices/register", json=registration("r5"))
        assert (await _device_ids(again, 1))[0][1] == "r5"  # live after the replay, no repeats


async def test_resume_by_query_parameter_and_garbage_ids(client):
    async with StreamReader(client) as reader:
        await client.post("/devices/register", json=registration("q1"))
        await client.post("/devices/register", json=registration("q2"))
        (first_id, _), _second = await _device_ids(reader, 2)
    async with StreamReader(client, url=f"/api/stream?last_event_id={first_id}") as again:
        assert [n for _, n in await _device_ids(again, 1)] == ["q2"]
    async with StreamReader(client, last_event_id="not-a-number") as fresh:
        await client.post("/devices/register", json=registration("q3"))
        assert [n for _, n in await _device_ids(fresh, 1)] == ["q3"]  # no replay at all


# -- keep-alive --------------------------------------------------------------------------------


async def test_keep_alive_comments_when_idle(aiohttp_client):
    # The collector's keep-alive interval is fixed at 15 s (not a setting yet), so the
    # interval is shortened on a real server running the same stream() the collector serves.
    hub = EventHub()

    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream(request, hub, lambda: {"collector": "test"}, keepalive_s=0.1)

    app = web.Application()
    app.router.add_get("/api/stream", handler)
    client = await aiohttp_client(app)
    async with StreamReader(client) as reader:
        comments = [await reader.frame() for _ in range(2)]
        assert all(f["comments"] == ["keep-alive"] and f["data"] is None for f in comments)
        hub.publish({"type": "job", "job_id": "k"})
        has_fields(await reader.next_of("job"), job_id="k")
    await client.close()
    hub.close()


# -- the client count --------------------------------------------------------------------------


async def _stream_clients_until(client, want: int) -> int:
    """Poll /api/health until stream_clients reaches `want` (a readiness wait, 10 s cap)."""
    for _ in range(500):
        count = (await (await client.get("/api/health")).json())["stream_clients"]
        if count == want:
            return count
        await asyncio.sleep(0.02)
    return count


async def test_stream_clients_counts_and_drops_back(client):
    readers = [StreamReader(client) for _ in range(3)]
    for reader in readers:
        await reader.__aenter__()
    assert await _stream_clients_until(client, 3) == 3
    readers[0].close()
    readers[1].close()
    # A departed client is noticed when the server next writes to it (an event or the
    # keep-alive); an event makes that immediate.
    await client.post("/devices/register", json=registration("nudge"))
    assert await _stream_clients_until(client, 1) == 1
    has_fields(await readers[2].next_of("device"), device_id="nudge")
    readers[2].close()
    await client.post("/devices/register", json=registration("nudge2"))
    assert await _stream_clients_until(client, 0) == 0


# -- many clients and a stuck one, against a real collector process ------------------------------


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS line")


async def _health(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/api/health") as resp:
        return dict(await resp.json())


async def _until_health(session, url, condition, timeout_s=60.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        health = await _health(session, url)
        if condition(health) or asyncio.get_running_loop().time() > deadline:
            return health
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_500_concurrent_clients_each_receive_an_event(tmp_path):
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_SQLITE_SYNCHRONOUS": "NORMAL"})
    proc.start()
    connector = aiohttp.TCPConnector(limit=0)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            readers = [StreamReader(session, proc.url + "/api/stream") for _ in range(500)]
            gate = asyncio.Semaphore(64)

            async def connect(reader: StreamReader) -> None:
                async with gate:
                    await reader.__aenter__()

            await asyncio.gather(*(connect(r) for r in readers))
            health = await _health(session, proc.url)
            assert health["stream_clients"] == 500
            async with session.post(proc.url + "/api/events/fanout",
                                    json={"hello": "everyone"}) as resp:
                assert resp.status == 201
            got = await asyncio.gather(*(r.next_of("topic") for r in readers))
            assert all(g["payload"] == {"hello": "everyone"} for g in got)
            for reader in readers:
                reader.close()
            async with session.post(proc.url + "/api/events/fanout", json="bye"):
                pass
            health = await _until_health(session, proc.url, lambda h: h["stream_clients"] == 0)
            assert health["stream_clients"] == 0
            assert health["stream_dropped_clients"] == 0  # every one left; none was too slow
    finally:
        assert proc.stop() == 0, proc.log()


async def _publish_many(session, url, count, size, concurrency=16) -> None:
    payload = {"blob": "p" * size}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for n in range(count):
        queue.put_nowait(n)

    async def worker() -> None:
        while not queue.empty():
            queue.get_nowait()
            async with session.post(url + "/api/events/flood", json=payload) as resp:
                assert resp.status == 201

    await asyncio.gather(*(worker() for _ in range(concurrency)))


class TopicCounter:
    """Counts topic events as raw bytes arrive: a reader quick enough to keep up with a flood
    (frame-by-frame parsing in the test's own loop would fall behind and rightly be dropped)."""

    MARKER = b"event: topic\n"

    def __init__(self, reader: StreamReader) -> None:
        assert reader.response is not None
        self.response = reader.response
        self.received = 0
        self.task = asyncio.create_task(self._count())

    async def _count(self) -> None:
        tail = b""
        async for chunk in self.response.content.iter_any():
            data = tail + chunk
            self.received += data.count(self.MARKER)
            tail = data[-(len(self.MARKER) - 1):]

    async def reach(self, count: int, timeout_s: float = 60.0) -> int:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.received < count and not self.task.done():
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.02)
        return self.received


def _stuck_client(port: int) -> socket.socket:
    """A client that asks for the stream and then never reads a byte."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /api/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Accept: text/event-stream\r\n\r\n")
    return sock


async def _flood_until_dropped(session, url) -> int:
    """Publish ~4 KiB events (small enough to ride on the stream) until a client is dropped.

    The kernel's send buffer takes the first few MiB for the stuck client; then its queue of
    256 events fills and the hub drops it."""
    published = 0
    while published < 8000:
        await _publish_many(session, url, 250, 3900, concurrency=4)
        published += 250
        if (await _health(session, url))["stream_dropped_clients"]:
            break
    return published


@pytest.mark.slow
async def test_a_client_that_stops_reading_is_dropped_without_growing_memory(tmp_path):
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_SQLITE_SYNCHRONOUS": "NORMAL"})
    proc.start()
    pid = proc.proc.pid  # type: ignore[union-attr]
    stuck = _stuck_client(proc.port)
    try:
        async with (aiohttp.ClientSession() as session,
                    StreamReader(session, proc.url + "/api/stream") as reading):
            await _until_health(session, proc.url, lambda h: h["stream_clients"] == 2)
            counter = TopicCounter(reading)
            published = await _flood_until_dropped(session, proc.url)
            health = await _health(session, proc.url)
            assert health["stream_dropped_clients"] == 1 and health["stream_clients"] == 1
            before_kib = _rss_kib(pid)
            await _publish_many(session, proc.url, 2000, 3900, concurrency=4)  # ~8 MiB more
            after_kib = _rss_kib(pid)
            published += 2000
            # The reading client was not held back: it gets every event published.
            assert await counter.reach(published) == published
            health = await _health(session, proc.url)
            assert health["stream_clients"] == 1 and health["stream_dropped_clients"] == 1
            counter.task.cancel()
        # Once dropped, the stuck client costs nothing more: the next 8 MiB did not pile up
        # anywhere (the replay buffer was already full of same-sized frames).
        assert after_kib - before_kib < 4 * 1024, (before_kib, after_kib)
    finally:
        with contextlib.suppress(OSError):
            stuck.close()
        assert proc.stop() == 0, proc.log()


# -- the direct-write hub: order under a flood, the dropped client's socket, HTTP/1.0 and HEAD ----


class IdChecker:
    """Reads a stream as fast as bytes arrive and checks that event ids come one after another
    (every event reaches every client that keeps up, in the order it was published)."""

    ID_LINE = re.compile(rb"(?:^|\n)id: (\d+)\n")

    def __init__(self, reader: StreamReader) -> None:
        assert reader.response is not None
        self.response = reader.response
        self.ids: list[int] = []
        self.gaps: list[tuple[int, int]] = []
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        tail = b""
        async for chunk in self.response.content.iter_any():
            data = tail + chunk
            end = data.rfind(b"\n\n") + 2  # only whole frames; the rest waits for more bytes
            for match in self.ID_LINE.finditer(data, 0, end):
                event_id = int(match.group(1))
                if self.ids and event_id != self.ids[-1] + 1:
                    self.gaps.append((self.ids[-1], event_id))
                self.ids.append(event_id)
            tail = data[end:]

    async def reach(self, count: int, timeout_s: float = 60.0) -> int:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while len(self.ids) < count and not self.task.done():
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.02)
        return len(self.ids)


def _read_until_closed(sock: socket.socket, timeout_s: float = 30.0) -> str:
    """Read (and discard) what the stuck client was sent until the server closes the
    connection: 'closed' (FIN or RST), or 'open' if it is still open after timeout_s."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(1 << 16):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return "closed"
    except TimeoutError:
        return "open"
    return "closed"


@pytest.mark.slow
async def test_a_slow_client_is_dropped_and_disconnected_while_fast_ones_get_every_event_in_order(
        tmp_path):
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_SQLITE_SYNCHRONOUS": "NORMAL"})
    proc.start()
    stuck = _stuck_client(proc.port)
    try:
        async with aiohttp.ClientSession() as session:
            readers = [StreamReader(session, proc.url + "/api/stream") for _ in range(3)]
            for reader in readers:
                await reader.__aenter__()
            await _until_health(session, proc.url, lambda h: h["stream_clients"] == 4)
            checkers = [IdChecker(reader) for reader in readers]
            published = await _flood_until_dropped(session, proc.url)
            health = await _health(session, proc.url)
            assert health["stream_dropped_clients"] == 1 and health["stream_clients"] == 3
            # The hub closed the dropped client's connection: reading what reached its socket
            # ends in EOF or a reset instead of waiting forever.
            assert await asyncio.to_thread(_read_until_closed, stuck) == "closed"
            await _publish_many(session, proc.url, 200, 100, concurrency=8)
            published += 200
            for checker in checkers:
                assert await checker.reach(published) == published
                assert checker.gaps == []  # no event lost or reordered for a client that keeps up
                checker.task.cancel()
            for reader in readers:
                reader.close()
    finally:
        with contextlib.suppress(OSError):
            stuck.close()
        assert proc.stop() == 0, proc.log()


async def _raw_request(port: int, head: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    return reader, writer


async def test_an_http_1_0_client_gets_bare_frames(client):
    reader, writer = await _raw_request(
        client.port,
        b"GET /api/stream HTTP/1.0\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n")
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
        assert head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0]
        assert b"transfer-encoding" not in head.lower()  # the body is the frames themselves
        hello = parse_frame(await asyncio.wait_for(reader.readuntil(b"\n\n"), READ_TIMEOUT_S))
        assert hello["event"] == "hello"
        await client.post("/devices/register", json=registration("old-client"))
        while True:
            frame = parse_frame(await asyncio.wait_for(reader.readuntil(b"\n\n"),
                                                       READ_TIMEOUT_S))
            if frame["event"] == "device":
                break
        assert frame["data"]["device_id"] == "old-client" and frame["id"] is not None
    finally:
        writer.close()


async def test_head_answers_at_once_without_subscribing(client):
    resp = await client.head("/api/stream")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert (await (await client.get("/api/health")).json())["stream_clients"] == 0


async def test_events_published_together_arrive_in_order(aiohttp_client):
    # Events published in one turn of the loop go out as one write per client; on the wire
    # they are still separate frames, in publishing order.
    hub = EventHub()

    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream(request, hub, lambda: {"collector": "test"})

    app = web.Application()
    app.router.add_get("/api/stream", handler)
    client = await aiohttp_client(app)
    async with StreamReader(client) as reader:
        for n in range(50):
            hub.publish({"type": "job", "job_id": f"b{n}"})
        got = [await reader.next_of("job") for _ in range(50)]
        assert [g["job_id"] for g in got] == [f"b{n}" for n in range(50)]
    await client.close()
    hub.close()


async def test_shutdown_ends_open_streams(tmp_path):
    proc = CollectorProcess(tmp_path / "data", env={"FLEET_SQLITE_SYNCHRONOUS": "NORMAL"})
    proc.start()
    try:
        async with (aiohttp.ClientSession() as session,
                    StreamReader(session, proc.url + "/api/stream") as reader):
            assert reader.response is not None
            await _until_health(session, proc.url, lambda h: h["stream_clients"] == 1)
            stopping = asyncio.create_task(asyncio.to_thread(proc.stop))
            # The stream ends (cleanly or by a reset) rather than hanging on.
            with contextlib.suppress(aiohttp.ClientPayloadError, aiohttp.ClientConnectionError):
                while await asyncio.wait_for(reader.response.content.readany(), READ_TIMEOUT_S):
                    pass
            assert await stopping == 0, proc.log()
    finally:
        proc.stop()

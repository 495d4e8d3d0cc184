"""The SSE hub's stream of whole states (`EventHub(latest_only=True)`, the control plane's
snapshot per tick), served by fleet_min.sse.stream on a real aiohttp server: a new client starts
from the current state, a client behind skips to the newest state and is never dropped for it,
keep-alives, the client count, shutdown, HTTP/1.0 clients. The hub's event mode (the collector's
stream) is tested in tests/collector/test_stream.py."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web

from fleet_min.sse import EventHub, stream
from tests.support.stream import READ_TIMEOUT_S, parse_frame

HANG_GUARD_S = 30.0  # not a performance bound: only turns a hang into a failure


def state_app(hub: EventHub, keepalive_s: float = 15.0,
              headers: dict[str, str] | None = None) -> web.Application:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream(request, hub, None, keepalive_s=keepalive_s, headers=headers)

    app = web.Application()
    app.router.add_get("/api/stream", handler)
    return app


def payload(n: int, pad: int = 0) -> bytes:
    return json.dumps({"n": n, "pad": "x" * pad}, separators=(",", ":")).encode()


async def next_frame(resp: Any) -> dict[str, Any]:
    raw = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), READ_TIMEOUT_S)
    return parse_frame(raw)


async def next_state(resp: Any) -> dict[str, Any]:
    """The next frame that carries a state (keep-alives skipped); it has no id or event name."""
    while True:
        frame = await next_frame(resp)
        if frame["data"] is not None:
            assert frame["id"] is None and frame["event"] is None, frame
            return frame["data"]  # type: ignore[no-any-return]


async def until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(HANG_GUARD_S):
        while not predicate():
            await asyncio.sleep(0.02)


async def test_a_new_client_starts_from_the_current_state_and_gets_each_new_one(
        aiohttp_client: Any) -> None:
    hub = EventHub(latest_only=True)
    for n in range(3):
        hub.publish_latest(payload(n))
    assert hub.latest == payload(2)
    client = await aiohttp_client(state_app(hub, headers={"X-Frame-Options": "DENY"}))
    resp = await client.get("/api/stream")
    assert resp.headers["Content-Type"] == "text/event-stream"
    assert resp.headers["X-Frame-Options"] == "DENY"
    assert (await next_state(resp))["n"] == 2  # not the states before it, and no hello
    for n in (3, 4):
        hub.publish_latest(payload(n))
        await asyncio.sleep(0)
    assert [(await next_state(resp))["n"] for _ in range(2)] == [3, 4]
    resp.close()
    hub.close()


async def test_states_published_in_one_turn_go_out_as_the_last_alone(aiohttp_client: Any
                                                                      ) -> None:
    hub = EventHub(latest_only=True)
    hub.publish_latest(payload(0))
    client = await aiohttp_client(state_app(hub))
    resp = await client.get("/api/stream")
    assert (await next_state(resp))["n"] == 0
    for n in range(1, 6):
        hub.publish_latest(payload(n))  # no await between: one turn of the loop
    assert (await next_state(resp))["n"] == 5
    hub.publish_latest(payload(6))
    assert (await next_state(resp))["n"] == 6
    assert hub.published == 7
    resp.close()
    hub.close()


async def test_before_any_state_the_client_gets_its_headers_and_keep_alives(
        aiohttp_client: Any) -> None:
    hub = EventHub(latest_only=True)
    client = await aiohttp_client(state_app(hub, keepalive_s=0.1))
    resp = await asyncio.wait_for(client.get("/api/stream"), READ_TIMEOUT_S)
    assert resp.status == 200
    frames = [await next_frame(resp) for _ in range(3)]
    assert all(f["comments"] == ["keep-alive"] and f["data"] is None for f in frames)
    hub.publish_latest(payload(1))
    assert (await next_state(resp))["n"] == 1
    resp.close()
    hub.close()


async def test_clients_are_counted_and_close_ends_every_stream(aiohttp_client: Any) -> None:
    hub = EventHub(latest_only=True)
    hub.publish_latest(payload(0))
    client = await aiohttp_client(state_app(hub))
    streams = [await client.get("/api/stream") for _ in range(3)]
    for resp in streams:
        await next_state(resp)
    assert hub.clients == 3
    streams[0].close()
    hub.publish_latest(payload(1))  # a departed client is noticed when the hub next writes
    await until(lambda: hub.clients == 2)
    hub.close()
    for resp in streams[1:]:
        assert (await next_state(resp))["n"] == 1
        async with asyncio.timeout(HANG_GUARD_S):
            assert await resp.content.read() == b""  # the response ended
    assert hub.clients == 0 and hub.dropped_clients == 0


def _stuck_client(port: int) -> socket.socket:
    """A client that asks for the stream and then reads nothing until told to."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /api/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return sock


def _read_until(sock: socket.socket, marker: bytes) -> bytes:
    sock.settimeout(READ_TIMEOUT_S)
    got = b""
    while marker not in got:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        got += chunk
    return got


async def test_a_client_behind_skips_to_the_newest_state_and_is_never_dropped(
        aiohttp_client: Any) -> None:
    # depth=2 would drop this client in the hub's event mode; states replace, never pile up.
    hub = EventHub(depth=2, latest_only=True)
    client = await aiohttp_client(state_app(hub))
    stuck = await asyncio.to_thread(_stuck_client, client.port)
    try:
        await until(lambda: hub.clients == 1)
        count = 64  # 16 MiB: far past what the kernel's buffers take for a client not reading
        for n in range(count):
            hub.publish_latest(payload(n, pad=256 * 1024))
            await asyncio.sleep(0)  # each state is written (or held) on its own
        assert hub.clients == 1 and hub.dropped_clients == 0
        last = f'"n":{count - 1},'.encode()
        received = await asyncio.to_thread(_read_until, stuck, last)
        assert last in received  # it caught up with the newest state
        frames = received.count(b"data: {")
        assert 0 < frames < count  # and skipped states on the way
        assert hub.clients == 1 and hub.dropped_clients == 0
    finally:
        stuck.close()
        hub.close()


async def test_an_http_1_0_client_gets_bare_frames(aiohttp_client: Any) -> None:
    hub = EventHub(latest_only=True)
    hub.publish_latest(payload(7))
    client = await aiohttp_client(state_app(hub))
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(b"GET /api/stream HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
        assert b" 200 " in head.split(b"\r\n")[0] and b"transfer-encoding" not in head.lower()
        first = await asyncio.wait_for(reader.readuntil(b"\n\n"), READ_TIMEOUT_S)
        assert first == b"data: " + payload(7) + b"\n\n"
        hub.publish_latest(payload(8))
        second = await asyncio.wait_for(reader.readuntil(b"\n\n"), READ_TIMEOUT_S)
        assert second == b"data: " + payload(8) + b"\n\n"
    finally:
        writer.close()
        hub.close()

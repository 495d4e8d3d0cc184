"""The hub writes an event to its clients FAN_OUT_SLICE at a time, one slice per turn of the event
loop: other work runs between slices, every client still gets every event once and in order
(events published during a fan-out follow it), and a stream of whole states skips a state that
a newer one replaced mid-way. Real aiohttp server, real sockets."""

from __future__ import annotations

import asyncio
import json
import re
import select
from collections.abc import Callable
from typing import Any

from aiohttp import web

from fleet_min.sse import FAN_OUT_SLICE, EventHub, stream
from tests.support.stream import READ_TIMEOUT_S

CLIENTS = 3 * FAN_OUT_SLICE + 10  # four slices
EVENT = re.compile(rb"id: (\d+)\nevent: [a-z]+\ndata: (\{.*?\})\n\n")
STATE = re.compile(rb"\r\ndata: (\{.*?\})\n\n")


def _app(hub: EventHub) -> web.Application:
    hello: Callable[[], dict[str, Any]] | None = None if hub.latest_only else dict

    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream(request, hub, hello)

    app = web.Application()
    app.router.add_get("/api/stream", handler)
    return app


class Raw:
    """One stream client on a plain socket: what arrived, undecoded."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.got = b""

    @classmethod
    async def open(cls, port: int, first: bytes) -> Raw:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /api/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        raw = cls(reader, writer)
        await raw.until(lambda got: first in got)
        raw.got = b""  # the headers and the first frame
        return raw

    async def until(self, done: Callable[[bytes], bool]) -> None:
        async with asyncio.timeout(READ_TIMEOUT_S):
            while not done(self.got):
                chunk = await self.reader.read(65536)
                assert chunk, "the stream ended"
                self.got += chunk

    def fileno(self) -> int:
        return int(self.writer.get_extra_info("socket").fileno())

    def events(self) -> list[int]:
        return [json.loads(m.group(2))["n"] for m in EVENT.finditer(self.got)]

    def states(self) -> list[int]:
        return [json.loads(m.group(1))["n"] for m in STATE.finditer(self.got)]


async def _clients(aiohttp_server: Any, hub: EventHub, first: bytes) -> list[Raw]:
    server = await aiohttp_server(_app(hub))
    gate = asyncio.Semaphore(50)

    async def one() -> Raw:
        async with gate:
            return await Raw.open(server.port, first)

    clients = await asyncio.gather(*(one() for _ in range(CLIENTS)))
    assert hub.clients == CLIENTS
    return list(clients)


async def test_other_work_runs_between_the_slices_of_a_fan_out(aiohttp_server: Any) -> None:
    hub = EventHub()
    clients = await _clients(aiohttp_server, hub, b"event: hello")
    readable: list[int] = []

    def between() -> None:
        # Scheduled right after the publish: it runs after the fan-out's first slice and
        # before its last. Loopback data is in the receiving socket as soon as it is sent.
        ready, _, _ = select.select(clients, [], [], 0)
        readable.append(len(ready))

    hub.publish({"type": "topic", "n": 1})
    asyncio.get_running_loop().call_soon(between)
    await asyncio.gather(*(c.until(lambda got: b"\n\n" in got) for c in clients))
    assert 0 < readable[0] < CLIENTS, readable
    assert all(c.events() == [1] for c in clients)
    hub.close()


async def test_events_published_during_a_fan_out_follow_it_in_order(aiohttp_server: Any
                                                                    ) -> None:
    hub = EventHub()
    clients = await _clients(aiohttp_server, hub, b"event: hello")
    loop = asyncio.get_running_loop()
    hub.publish({"type": "topic", "n": 1})
    for n in (2, 3):  # each lands in the middle of the fan-out before it
        loop.call_soon(hub.publish, {"type": "topic", "n": n})
    await asyncio.gather(*(c.until(lambda got: got.count(b"\n\n") >= 3) for c in clients))
    for client in clients:
        assert client.events() == [1, 2, 3]
        ids = [int(m.group(1)) for m in EVENT.finditer(client.got)]
        assert ids == sorted(ids)
    hub.close()


async def test_a_state_replaced_mid_fan_out_is_skipped_by_the_rest(aiohttp_server: Any
                                                                  ) -> None:
    hub = EventHub(latest_only=True)
    hub.publish_latest(b'{"n":0}')
    clients = await _clients(aiohttp_server, hub, b'{"n":0}\n\n')
    hub.publish_latest(b'{"n":1}')
    asyncio.get_running_loop().call_soon(hub.publish_latest, b'{"n":2}')
    await asyncio.gather(*(c.until(lambda got: b'{"n":2}' in got) for c in clients))
    seen = [c.states() for c in clients]
    assert all(states in ([1, 2], [2]) for states in seen), seen
    assert [1, 2] in seen and [2] in seen  # the first slice had 1; the rest went on to 2
    hub.close()

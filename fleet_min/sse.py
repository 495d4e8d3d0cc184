"""Server-sent events: a hub that fans events out to many clients without letting one slow
client grow memory or slow the others.

Each event is encoded once into the bytes every client receives. A client owns a bounded queue;
when it is full the client is dropped (it reconnects and resumes with Last-Event-ID from the
bounded replay buffer). Keep-alive comments keep proxies and idle connections open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from aiohttp import web

from fleet_min.timeutil import iso, now

log = logging.getLogger(__name__)

_DROP = b""  # sentinel put in a queue to end its stream


class Subscriber:
    __slots__ = ("dropped", "on_drop", "queue")

    def __init__(self, depth: int) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=depth)
        self.dropped = False
        # Closes the client's connection: a slow client is stuck in a write that only the
        # closing of its socket ends, and its kernel buffers are released only then.
        self.on_drop: Callable[[], None] | None = None


class _Event:
    __slots__ = ("_frame", "at", "event", "id")

    def __init__(self, event_id: int, at: float, event: dict[str, Any]) -> None:
        self.id = event_id
        self.at = at
        self.event = event
        self._frame: bytes | None = None

    def frame(self) -> bytes:
        """The bytes every client receives, encoded once."""
        if self._frame is None:
            payload = {"at": iso(self.at), **self.event}
            self._frame = (f"id: {self.id}\nevent: {self.event['type']}\n"
                           f"data: {json.dumps(payload, separators=(',', ':'))}\n\n").encode()
        return self._frame


class EventHub:
    def __init__(self, replay: int = 1000, depth: int = 256) -> None:
        # Events are kept as they came and encoded only when a client needs the bytes: a
        # collector nobody watches does not pay for encoding every write.
        self._buffer: deque[_Event] = deque(maxlen=replay)
        self._subscribers: set[Subscriber] = set()
        self._depth = depth
        # Ids start from the clock (microseconds) so they keep rising across restarts: a client
        # resuming with an id from an earlier run gets no replay rather than a wrong one.
        self._next_id = int(time.time() * 1_000_000)
        self.published = 0
        self.dropped_clients = 0

    @property
    def clients(self) -> int:
        return len(self._subscribers)

    def publish(self, event: dict[str, Any]) -> None:
        item = _Event(self._next_id, now(), event)
        self._next_id += 1
        self._buffer.append(item)
        self.published += 1
        if not self._subscribers:
            return
        frame = item.frame()
        for subscriber in list(self._subscribers):
            try:
                subscriber.queue.put_nowait(frame)
            except asyncio.QueueFull:
                self._drop(subscriber)

    def _drop(self, subscriber: Subscriber) -> None:
        self._subscribers.discard(subscriber)
        subscriber.dropped = True
        self.dropped_clients += 1
        with contextlib.suppress(asyncio.QueueEmpty):
            subscriber.queue.get_nowait()  # make room for the sentinel
        subscriber.queue.put_nowait(_DROP)
        if subscriber.on_drop is not None:
            subscriber.on_drop()

    def subscribe(self, last_event_id: int | None) -> tuple[Subscriber, list[bytes]]:
        subscriber = Subscriber(self._depth)
        replay = ([item.frame() for item in self._buffer if item.id > last_event_id]
                  if last_event_id is not None else [])
        self._subscribers.add(subscriber)
        return subscriber, replay

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.discard(subscriber)

    def close(self) -> None:
        for subscriber in list(self._subscribers):
            self._drop(subscriber)


def _last_event_id(request: web.Request) -> int | None:
    raw = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
    if raw is None:
        return None
    try:
        return max(0, int(raw))
    except ValueError:
        return None


async def stream(request: web.Request, hub: EventHub, hello: Callable[[], dict[str, Any]],
                 keepalive_s: float = 15.0) -> web.StreamResponse:
    """Serve one client until it leaves, is dropped, or the service stops."""
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no"})
    await response.prepare(request)
    subscriber, replay = hub.subscribe(_last_event_id(request))
    transport = request.transport
    if transport is not None:
        subscriber.on_drop = transport.abort
    try:
        greeting = json.dumps({"type": "hello", "at": iso(now()), **hello()},
                              separators=(",", ":"))
        await response.write(f"retry: 2000\nevent: hello\ndata: {greeting}\n\n".encode())
        for frame in replay:
            await response.write(frame)
        while True:
            try:
                frame = await asyncio.wait_for(subscriber.queue.get(), keepalive_s)
            except TimeoutError:
                frame = b": keep-alive\n\n"
            if not frame:  # the drop sentinel
                break
            await response.write(frame)
    except (ConnectionResetError, asyncio.CancelledError):
        pass  # the client left, or the service is stopping: both end this stream quietly
    finally:
        hub.unsubscribe(subscriber)
    return response

"""Server-sent events: a hub that fans events out to many clients without letting one slow
client grow memory or slow the others.

Each event is encoded once, chunk framing included, into the bytes every client receives, and
the hub writes those bytes straight into each client's transport: a non-blocking call that the
kernel normally takes whole at once. Per event (or per burst of events published in one turn of
the loop) and client that is one send, with no queue and no task wake-up (with a queue and a
writer task per client, the wake-ups cost more than the sends). The sends are nearly all of a
publish's cost (each runs the kernel's side of the socket, 8 to 14 µs here), so they go out
FAN_OUT_SLICE clients per turn of the loop: 2,000 clients no longer hold every other request up
for the 20 to 30 ms their sends take together. Events published meanwhile follow once every
client has the earlier ones, so each client still gets them in order.

A client whose transport already holds more unsent bytes than `BEHIND_BYTES` is behind: its
events wait in its own backlog, which its handler writes out as the socket drains. A backlog that
reaches its depth drops the client: its connection is closed at once (so the kernel frees its
buffers) and it reconnects, resuming with Last-Event-ID from the bounded replay buffer.
Keep-alive comments keep proxies and idle connections open.

The same hub also serves a stream of whole states (`EventHub(latest_only=True)`, the control
plane's snapshot per tick): `publish_latest` replaces the one state it keeps, a client that
connects starts from it, and a client that is behind has its backlog replaced by the newest
state rather than lengthened, so it skips the states in between and is never dropped for them.
Such frames are `data: <payload>` alone, with no id or event name: nothing is replayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import hdrs, web

from fleet_min.http import SECURITY_HEADERS
from fleet_min.timeutil import iso, now

log = logging.getLogger(__name__)

# Unsent bytes a transport may hold before its client counts as behind. Past the kernel's own
# socket buffer (often MiBs), so a client that reads at all stays on the direct path; the same as
# asyncio's default high-water mark, the point where aiohttp's own writes start waiting.
BEHIND_BYTES = 64 * 1024

_KEEPALIVE = b": keep-alive\n\n"

# Clients written to per turn of the event loop (a few milliseconds of sends).
FAN_OUT_SLICE = 64

# The kernel's send buffer of a stream's socket while its replay is written (Linux books twice
# this). Left to itself it grows to megabytes (tcp_wmem's maximum), all of it taken before the
# transport holds a byte: 300 clients that asked for the replay of 1,000 events of 4 KB and
# read none of it held 1 GB of kernel memory, copying it in stalled the event loop for seconds,
# and since the transport never held past its high-water mark, nothing ever cut them
# (serving.StallWatch). Bounded, a replay waits in the transport for the client to take it, and
# one that takes none is cut. Once the replay is out, the buffer is raised again as far as a
# process may set it (net.core.wmem_max on Linux, 208 KiB by default, which the kernel doubles):
# a set size no longer grows by itself, but bursts of a hundred events still wait in the kernel,
# not in the process. A stream without a replay keeps the system's own buffer.
REPLAY_SEND_BUFFER = 128 * 1024


def _chunk(frame: bytes) -> tuple[bytes, int]:
    """An SSE frame as one HTTP/1.1 chunk, and the length of the chunk's head: clients on a
    chunked response take the chunk, others the frame inside it."""
    head = f"{len(frame):x}\r\n".encode()
    return head + frame + b"\r\n", len(head)


class _Event:
    __slots__ = ("_head", "_wire", "at", "event", "id")

    def __init__(self, event_id: int, at: float, event: dict[str, Any]) -> None:
        self.id = event_id
        self.at = at
        self.event = event
        self._wire: bytes | None = None
        self._head = 0

    def wire(self) -> bytes:
        """The frame as one HTTP/1.1 chunk, encoded once and shared by every client."""
        if self._wire is None:
            payload = {"at": iso(self.at), **self.event}
            self._wire, self._head = _chunk(
                (f"id: {self.id}\nevent: {self.event['type']}\n"
                 f"data: {json.dumps(payload, separators=(',', ':'))}\n\n").encode())
        return self._wire

    def frame(self) -> memoryview:
        """The bare SSE frame (no chunk framing), a view into the same bytes."""
        return memoryview(self.wire())[self._head:-2]


class _State:
    """A whole state as one frame (`data: <payload>`, no id or event name), framed only when a
    client needs the bytes, once for all of them."""

    __slots__ = ("_head", "_wire", "payload")

    def __init__(self, payload: bytes) -> None:
        # The payload is compact JSON (json.dumps never emits a raw newline): one `data:` line.
        self.payload = payload
        self._wire: bytes | None = None
        self._head = 0

    def wire(self) -> bytes:
        if self._wire is None:
            self._wire, self._head = _chunk(b"data: " + self.payload + b"\n\n")
        return self._wire

    def frame(self) -> memoryview:
        return memoryview(self.wire())[self._head:-2]


_Item = _Event | _State


class _FanOut:
    """One write of `items` to the subscribers there were when it began, a slice per turn."""

    __slots__ = ("bare", "done", "items", "targets", "wire")

    def __init__(self, items: list[_Item], targets: tuple[Subscriber, ...]) -> None:
        self.items = items
        self.targets = targets
        self.done = 0  # targets written to (or passed over) so far
        self.wire = items[0].wire() if len(items) == 1 else b"".join(i.wire() for i in items)
        self.bare: bytes | None = None  # the frames without chunk framing, for HTTP/1.0

    def bare_frames(self) -> bytes:
        if self.bare is None:
            self.bare = b"".join(i.frame() for i in self.items)
        return self.bare


class Subscriber:
    __slots__ = ("backlog", "chunked", "ended", "held", "sent_at", "transport", "waiter")

    def __init__(self, transport: asyncio.Transport, chunked: bool) -> None:
        self.transport = transport
        self.chunked = chunked  # False for an HTTP/1.0 client: its body is the bare frames
        # While held, the handler owns the order of writes (the hello and the replay are not out
        # yet, or a backlog is being written): publishing appends to the backlog instead.
        self.held = True
        self.backlog: deque[memoryview] = deque()
        self.ended = False  # dropped, gone, or the hub closed: the handler ends the stream
        self.sent_at = time.monotonic()  # the last write to this client, for keep-alives
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        """Until the backlog gets an event, the stream ends, or timeout_s passes."""
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can lose a cancel that
            # arrives with the wake-up (see fleet_min/controlplane/loops.py).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self.waiter
        finally:
            self.waiter = None


class EventHub:
    def __init__(self, replay: int = 1000, depth: int = 256, *, latest_only: bool = False
                 ) -> None:
        # Events are kept as they came and encoded only when a client needs the bytes: a
        # collector nobody watches does not pay for encoding every write.
        self._buffer: deque[_Event] = deque(maxlen=replay)
        self._subscribers: set[Subscriber] = set()
        self._unsent: list[_Item] = []  # published, not yet written to the subscribers
        self._fanout: _FanOut | None = None  # a write to every subscriber under way
        self._depth = depth
        self.latest_only = latest_only
        self._latest: _State | None = None  # latest_only: the state a new client starts from
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
        # The writes happen just after the publisher's turn of the loop: its reply is not held
        # up by 500 sends, and events published together go out as one write per client.
        self._unsent.append(item)
        if len(self._unsent) == 1:
            try:
                asyncio.get_running_loop().call_soon(self._flush)
            except RuntimeError:  # published from outside the loop (a test, a shutdown path)
                self._flush()

    @property
    def latest(self) -> bytes | None:
        """latest_only: the payload last published (None before the first)."""
        return self._latest.payload if self._latest is not None else None

    def publish_latest(self, payload: bytes) -> None:
        """latest_only: make `payload` the current state and send it to every client. States
        published in one turn of the loop go out as the last of them alone."""
        item = self._latest = _State(payload)
        self.published += 1
        if not self._subscribers:
            return
        queued = bool(self._unsent)
        self._unsent = [item]
        if not queued:
            try:
                asyncio.get_running_loop().call_soon(self._flush)
            except RuntimeError:  # published from outside the loop (a test, a shutdown path)
                self._flush()

    def _flush(self) -> None:
        """Start writing what was published to every subscriber (a slice now, the rest in the
        next turns); while a fan-out is under way, what was published after it waits for it."""
        if self._fanout is not None:
            return  # the fan-out under way starts the next one when it ends
        items, self._unsent = self._unsent, []
        if items and self._subscribers:
            self._fanout = _FanOut(items, tuple(self._subscribers))
            self._continue(self._fanout)

    def _continue(self, fanout: _FanOut) -> None:
        if fanout is not self._fanout:
            return  # finished meanwhile by _complete
        if self.latest_only and self._unsent:
            fanout.done = len(fanout.targets)  # a newer state is waiting: the rest get that
        self._write(fanout, fanout.done + FAN_OUT_SLICE)
        if fanout.done < len(fanout.targets):
            try:
                asyncio.get_running_loop().call_soon(self._continue, fanout)
                return
            except RuntimeError:  # outside the loop (a test, a shutdown path): all at once
                self._write(fanout, len(fanout.targets))
        self._fanout = None
        if self._unsent:
            self._flush()

    def _complete(self) -> None:
        """Every published event written to every subscriber now (before a new subscriber is
        added or the hub closes)."""
        while self._fanout is not None or (self._unsent and self._subscribers):
            if self._fanout is None:
                items, self._unsent = self._unsent, []
                self._fanout = _FanOut(items, tuple(self._subscribers))
            self._write(self._fanout, len(self._fanout.targets))
            self._fanout = None
        self._unsent.clear()

    def _write(self, fanout: _FanOut, end: int) -> None:
        sent_at = time.monotonic()
        subscribers, items = self._subscribers, fanout.items
        for subscriber in fanout.targets[fanout.done:end]:
            if subscriber not in subscribers:
                continue  # left, or was dropped, since the fan-out began
            transport = subscriber.transport
            if transport.is_closing():
                self._end(subscriber)  # the client left; noticed here, not counted as dropped
            elif subscriber.held or transport.get_write_buffer_size() > BEHIND_BYTES:
                self._hold(subscriber, items)
            elif subscriber.chunked:
                transport.write(fanout.wire)
                subscriber.sent_at = sent_at
            else:
                transport.write(fanout.bare_frames())
                subscriber.sent_at = sent_at
        fanout.done = min(end, len(fanout.targets))

    def _hold(self, subscriber: Subscriber, items: list[_Item]) -> None:
        if self.latest_only:
            # Only the newest state matters: it replaces whatever the client has not had yet,
            # so its backlog stays one frame however far behind it is.
            subscriber.backlog.clear()
            subscriber.backlog.append(items[-1].frame())
            subscriber.held = True
            subscriber.wake()
            return
        for item in items:
            if len(subscriber.backlog) >= self._depth:
                self.dropped_clients += 1
                self._end(subscriber)
                # Closing the socket ends a write its handler may be parked in and frees the
                # kernel's buffers now, rather than whenever the client gets round to closing.
                subscriber.transport.abort()
                return
            subscriber.backlog.append(item.frame())
        subscriber.held = True
        subscriber.wake()

    def _end(self, subscriber: Subscriber) -> None:
        self._subscribers.discard(subscriber)
        subscriber.ended = True
        subscriber.wake()

    def subscribe(self, transport: asyncio.Transport, chunked: bool,
                  last_event_id: int | None) -> tuple[Subscriber, list[memoryview]]:
        """A held subscriber (its handler releases it after the hello and the replay) and the
        buffered frames after last_event_id."""
        self._complete()  # events still unsent belong to the subscribers already there
        subscriber = Subscriber(transport, chunked)
        if self.latest_only:  # a new client starts from the current state
            replay = [self._latest.frame()] if self._latest is not None else []
        else:
            replay = ([item.frame() for item in self._buffer if item.id > last_event_id]
                      if last_event_id is not None else [])
        self._subscribers.add(subscriber)
        return subscriber, replay

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.discard(subscriber)

    def close(self) -> None:
        """End every stream: a client that keeps up gets the end of its response; one that is
        behind would hold the shutdown up, so its connection is closed."""
        self._complete()
        for subscriber in tuple(self._subscribers):
            self._end(subscriber)
            if subscriber.held:
                subscriber.transport.abort()


def _last_event_id(request: web.Request) -> int | None:
    raw = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
    if raw is None:
        return None
    try:
        return max(0, int(raw))
    except ValueError:
        return None


async def stream(request: web.Request, hub: EventHub,
                 hello: Callable[[], dict[str, Any]] | None, keepalive_s: float = 15.0,
                 headers: Mapping[str, str] | None = None) -> web.StreamResponse:
    """Serve one client until it leaves, is dropped, or the service stops. `hello` gives the
    fields of the first event (None: no hello, as for a hub of states); `headers` are added to
    the response's own."""
    # The middleware adds the security headers to a response it is handed back, which a stream
    # is only after it ends: they are set here, before the head is sent.
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no", **SECURITY_HEADERS, **(headers or {})})
    await response.prepare(request)
    transport = request.transport
    if request.method == hdrs.METH_HEAD or transport is None or transport.is_closing():
        return response  # no body to stream, or nobody to stream it to
    chunked = response.headers.get(hdrs.TRANSFER_ENCODING) == "chunked"
    subscriber, replay = hub.subscribe(transport, chunked, _last_event_id(request))
    try:
        # The first write goes through aiohttp's writer (which sends the headers with it); from
        # then on the hub may write to the transport itself.
        if hello is not None:
            greeting = json.dumps({"type": "hello", "at": iso(now()), **hello()},
                                  separators=(",", ":"))
            await response.write(f"retry: 2000\nevent: hello\ndata: {greeting}\n\n".encode())
        elif not replay:
            await response.write(_KEEPALIVE)  # nothing to send yet; the headers go out now
        bounded = len(replay) > 1  # (a hub of states replays its one state)
        if bounded:
            _set_send_buffer(transport, REPLAY_SEND_BUFFER)
        for frame in replay:
            await response.write(frame)
        if bounded:
            _set_send_buffer(transport, _system_send_buffer())
        await _serve(response, subscriber, keepalive_s)
    except (ConnectionResetError, asyncio.CancelledError):
        pass  # the client left, or the service is stopping: both end this stream quietly
    finally:
        hub.unsubscribe(subscriber)
    return response


def _set_send_buffer(transport: asyncio.BaseTransport, size: int) -> None:
    """Set the stream's socket's send buffer (see REPLAY_SEND_BUFFER)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and not transport.is_closing():
        # (Not a TCP socket, or uvloop's stand-in without the option: the system's buffer.)
        with contextlib.suppress(OSError, AttributeError, ValueError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)


@functools.cache
def _system_send_buffer() -> int:
    """The send buffer asked for once a replay is out: what the socket may grow to by itself
    (Linux: half of tcp_wmem's maximum, as the kernel doubles a set size), which the kernel cuts
    to what a process may set (net.core.wmem_max); elsewhere 4 MiB, cut the same way."""
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem", encoding="ascii") as handle:
            return max(REPLAY_SEND_BUFFER, int(handle.read().split()[2]) // 2)
    except (OSError, ValueError, IndexError):
        return 4 << 20


async def _serve(response: web.StreamResponse, subscriber: Subscriber,
                 keepalive_s: float) -> None:
    """Write the backlog when there is one (aiohttp's writer waits for the socket to drain),
    else let the hub write directly, waking only for a backlog or a keep-alive."""
    while not subscriber.ended:
        if subscriber.backlog:
            await response.write(subscriber.backlog.popleft())
            subscriber.sent_at = time.monotonic()
            continue
        subscriber.held = False  # nothing is ahead of the next event: the hub may write it
        idle_s = time.monotonic() - subscriber.sent_at
        if idle_s < keepalive_s:
            await subscriber.wait(keepalive_s - idle_s)
        elif subscriber.transport.get_write_buffer_size() <= BEHIND_BYTES:
            await response.write(_KEEPALIVE)  # also notices a client that went away
            subscriber.sent_at = time.monotonic()
        else:
            await subscriber.wait(keepalive_s)  # bytes are still going out: not idle

"""How a service process lives: bind, start, run until a signal, stop, and say so.

Both services run through here. The order matters:

1. Every listening socket is bound before anything else starts (no database, no thread), so a
   port in use ends the process at once with one line naming the address, instead of leaving
   threads behind that keep it alive.
2. The app starts (its database opens), the sockets start accepting, and one line says where it
   listens, with the real port when port 0 asked for a free one.
3. The first SIGTERM or SIGINT stops it: listening ends, long polls and streams are answered at
   once, requests in progress get `grace_s` to finish (an upload that never completes is cut),
   then the database writer commits every write it had accepted and closes. A write is only
   ever acknowledged after its COMMIT, so nothing acknowledged is lost either way.
4. A second signal exits at once, with a line saying it did not wait.

Every connection counts against a cap below the process's descriptor limit (RLIMIT_NOFILE):
past it a new connection is closed at once and a warning says so (at most once a minute), so
the descriptors left over always open the database, artifact files and the log. At the limit
itself the event loop would drop every new connection without a word and SQLite could no longer
open its files. One peer (an IPv4 address, an IPv6 /64) may hold only a share of the cap
(FLEET_MAX_PEER_CONNECTIONS), so a neighbour that opens connections until the cap is reached
does not lock out every agent, dashboard and health check; loopback is exempt. Request heads are
held to MAX_HEADERS lines of MAX_FIELD_SIZE bytes at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import struct
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler

try:  # the socket's own send queue (StallWatch); Linux only
    import fcntl
    import termios

    _OUTQ: int | None = termios.TIOCOUTQ if sys.platform.startswith("linux") else None
except ImportError:  # Windows
    _OUTQ = None

from fleet_min import dirlock
from fleet_min.db import StorageError
from fleet_min.http import WRITE_STALL_KEY, WRITE_STALL_S, error_response
from fleet_min.logs import Throttled

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

# aiohttp keeps an unfinished request head in memory at about twice its size, and its defaults
# (128 lines of 8190 bytes) let one connection hold ~2 MiB that way: a few thousand connections
# that never end their heads took gigabytes. 32 lines leave room for a browser's (15 to 20) and
# a proxy's additions; 8190 bytes a line (aiohttp's and Apache's default) keeps a Cookie header
# that other sites on the same host name have filled. A head past them is answered 400/431.
MAX_HEADERS = 32
MAX_FIELD_SIZE = 8190
MAX_LINE_SIZE = 8190  # the request line: a long query string still fits
HEAD_LIMITS = {"max_headers": MAX_HEADERS, "max_field_size": MAX_FIELD_SIZE,
               "max_line_size": MAX_LINE_SIZE}
# Descriptors kept out of the connection cap: the database (its file, -wal and -shm on each of
# its connections), artifact files being sent or received, the log, the listening sockets, the
# event loop's own, and a few to spare.
FD_RESERVE = 128
BACKLOG = 128  # of each listening socket
MIN_CAP = 16


def connection_cap(accept_burst: int, soft_limit: int | None = None) -> int:
    """How many connections may be open at once: the descriptor limit less FD_RESERVE and less
    `accept_burst`, the connections the event loop may accept before it counts the first (16
    at least). 0 where there is no limit to keep below."""
    if soft_limit is None:
        try:
            import resource
        except ImportError:  # Windows: no RLIMIT_NOFILE
            return 0
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft_limit == resource.RLIM_INFINITY:
            return 0
    return max(soft_limit - FD_RESERVE - accept_burst, MIN_CAP)


# What one peer may hold when FLEET_MAX_PEER_CONNECTIONS is auto: a quarter of the cap, so it
# takes four busy neighbours to fill it, and at least PEER_SHARE_MIN, so a host executor or a few
# agents behind one NAT address still fit under a small descriptor limit.
PEER_SHARE_DIVISOR = 4
PEER_SHARE_MIN = 64
PEER_SHARE_ENV = "FLEET_MAX_PEER_CONNECTIONS"


def peer_share(cap: int, setting: str = "auto") -> int:
    """The most connections one peer group may hold: `setting` as a count (0: no per-peer
    rule), or for auto a quarter of `cap`, PEER_SHARE_MIN at least (0 where there is no cap:
    no descriptor limit to share)."""
    if setting != "auto":
        return int(setting)
    return max(cap // PEER_SHARE_DIVISOR, PEER_SHARE_MIN) if cap else 0


_MAPPED = bytes(10) + b"\xff\xff"  # ::ffff:0:0/96, IPv4-mapped IPv6
_LOOPBACK6 = bytes(15) + b"\x01"


def peer_group(peername: Any) -> str | None:
    """The group a peer's connections count in, as a log line names it: an IPv4 address, an
    IPv4-mapped IPv6 address as its IPv4 address, an IPv6 address as its /64 prefix (a host is
    handed a whole /64 and may use any address in it), a link-local IPv6 address whole (all
    neighbours share fe80::/64). None for the exempt: loopback (a reverse proxy or a benchmark
    on this host), a Unix socket, no peer name at all. (inet_pton, not ipaddress: this runs
    for every connection, and ipaddress takes ten times as long.)"""
    host = peername[0] if isinstance(peername, tuple) and peername else None
    if not host or not isinstance(host, str):
        return None
    if ":" not in host:  # IPv4, as the kernel writes it: the common case, with no parsing
        return None if host.startswith("127.") else host
    try:
        packed = socket.inet_pton(socket.AF_INET6, host.partition("%")[0])
    except OSError:
        return None
    if packed.startswith(_MAPPED):
        return None if packed[12] == 127 else socket.inet_ntop(socket.AF_INET, packed[12:])
    if packed == _LOOPBACK6:
        return None
    if packed[0] == 0xFE and packed[1] & 0xC0 == 0x80:  # fe80::/10
        return host
    return socket.inet_ntop(socket.AF_INET6, packed[:8] + bytes(8)) + "/64"


def accept_burst(loop: asyncio.AbstractEventLoop, sockets: int) -> int:
    """asyncio's own loop accepts up to a backlog of connections in one go and makes their
    protocols a step later, so that many descriptors can be open beyond the count; uvloop makes
    each connection's protocol as it accepts it."""
    return BACKLOG * sockets if isinstance(loop, asyncio.BaseEventLoop) else 0


class _Counted(asyncio.Protocol):
    """A connection as the cap admitted it, counted in `held` since it was made. Once its peer
    is known it is also counted in its peer group, or, past the group's share, closed at once
    and counted out again; only an admitted connection gets the server's protocol, and only it
    is counted out when it ends."""

    __slots__ = ("_cap", "_factory", "_group", "_inner", "_stall", "_transport")

    def __init__(self, factory: Callable[[], asyncio.Protocol], cap: ConnectionCap) -> None:
        self._factory, self._cap = factory, cap
        self._inner: asyncio.Protocol | None = None
        self._group: str | None = None
        self._transport: asyncio.Transport | None = None
        self._stall: StallWatch | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cap = self._cap
        if cap.peer_cap:
            group = peer_group(transport.get_extra_info("peername"))
            if group is not None:
                held = cap.peers.get(group, 0)
                if held >= cap.peer_cap:
                    cap.held -= 1
                    cap.peer_refused(group, held)
                    cast(asyncio.Transport, transport).abort()  # see _Refused
                    return
                cap.peers[group] = held + 1
                self._group = group
        self._transport = cast(asyncio.Transport, transport)
        self._inner = self._factory()
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is None:  # refused by its peer's share: counted out already
            return
        if self._stall is not None:
            self._stall.stop()
            self._stall = None
        cap = self._cap
        cap.held -= 1
        if (group := self._group) is not None:
            left = cap.peers[group] - 1
            if left:
                cap.peers[group] = left
            else:  # a peer that is gone leaves nothing behind
                del cap.peers[group]
        self._inner.connection_lost(exc)

    # Called only after connection_made, and never on a refused connection (abort stops
    # reading and writing), so _inner is set.
    def data_received(self, data: bytes) -> None:
        cast(asyncio.Protocol, self._inner).data_received(data)

    def eof_received(self) -> bool | None:
        return cast(asyncio.Protocol, self._inner).eof_received()

    # The transport calls these when what it holds for the client passes its high-water mark
    # and when it falls under the low one. Between the two the client is taking its answer
    # slowly or not at all: the watch cuts it once it has taken nothing for the stall time.
    def pause_writing(self) -> None:
        if self._stall is None and self._cap.write_stall_s and self._transport is not None:
            self._stall = StallWatch(self._transport, self._cap)
        cast(asyncio.Protocol, self._inner).pause_writing()

    def resume_writing(self) -> None:
        if self._stall is not None:
            self._stall.stop()
            self._stall = None
        cast(asyncio.Protocol, self._inner).resume_writing()


class StallWatch:
    """Cuts a connection whose client takes none of what it is sent for the cap's
    `write_stall_s`. Every answer is covered, not only the streamed ones (which have their
    own deadline per piece, fleet_min.http.within_stall): aiohttp hands a whole JSON answer to
    the transport at once, and a client that asks for a large listing and never reads it
    would otherwise hold that answer's megabytes for as long as it keeps the socket open.
    A client that reads slowly but steadily is not cut: the watch looks again after each
    period, and only bytes queued for it that have not gone down since end the connection.
    Those are the transport's and, where the system says (Linux), the socket's own: the kernel
    takes more from the transport only once a third of its send buffer (megabytes) is free, so
    a client reading a few hundred KiB a second can leave the transport's count unchanged for
    seconds."""

    __slots__ = ("_cap", "_handle", "_left", "_transport")

    def __init__(self, transport: asyncio.Transport, cap: ConnectionCap) -> None:
        self._transport, self._cap = transport, cap
        self._left = _queued(transport)
        self._handle = asyncio.get_running_loop().call_later(cap.write_stall_s, self._look)

    def _look(self) -> None:
        transport = self._transport
        if transport.is_closing():
            return
        left = _queued(transport)
        if left and left >= self._left:
            peer = transport.get_extra_info("peername")
            self._cap.stalled(peer[0] if isinstance(peer, tuple) and peer else "?",
                              self._cap.write_stall_s, left)
            transport.abort()
            return
        self._left = left
        self._handle = asyncio.get_running_loop().call_later(self._cap.write_stall_s,
                                                             self._look)

    def stop(self) -> None:
        self._handle.cancel()


def _queued(transport: asyncio.Transport) -> int:
    """Bytes waiting for the client: in the transport, and in the socket's send queue where the
    system tells (SIOCOUTQ, which is TIOCOUTQ's number, on Linux)."""
    queued = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if _OUTQ is not None and sock is not None:
        # (Closed meanwhile, or not a socket that keeps a send queue: the transport's count.)
        with contextlib.suppress(OSError, ValueError):
            queued += struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, bytes(4)))[0]
    return queued


class _Refused(asyncio.Protocol):
    """A connection past the cap: closed as soon as it is made."""

    __slots__ = ()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Nothing of it is read; its descriptor is free again at once. (An asyncio.Transport:
        # uvloop's transports have its methods but not its class.)
        cast(asyncio.Transport, transport).abort()


class ConnectionCap:
    """Counts the open connections of a service's listening sockets and refuses those past
    `cap` (0: no cap), and those of a peer group that holds `peer_cap` already (0: no such
    rule; see peer_group). It wraps the protocol factory the sockets accept with, so it works
    the same on any event loop (asyncio's, uvloop's)."""

    def __init__(self, cap: int, log: logging.Logger, peer_cap: int = 0,
                 write_stall_s: float = WRITE_STALL_S) -> None:
        self.cap, self.held, self.peer_cap = cap, 0, peer_cap
        self.write_stall_s = write_stall_s  # see StallWatch; 0: no watch
        self.peers: dict[str, int] = {}  # connections held by each peer group holding any
        self.refused = Throttled(log, "%d connections are open, the most this process's "
                                      "descriptor limit allows with some to spare: new ones are "
                                      "closed at once; raise the limit (LimitNOFILE=, ulimit -n)")
        self.stalled = Throttled(log, "cut a client at %s that took nothing for %g s of the "
                                      "%d bytes queued for it (FLEET_WRITE_STALL_S)")
        self.peer_refused = Throttled(log, f"%s holds %d connections, the most one peer may "
                                           f"hold ({PEER_SHARE_ENV}); new ones from it are "
                                           f"closed at once")

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        def make() -> asyncio.Protocol:
            if self.cap and self.held >= self.cap:
                self.refused(self.held)
                return _Refused()
            # Counted when made, not when connected: asyncio makes a burst of protocols
            # before the first of them is connected.
            self.held += 1
            return _Counted(factory, self)
        return make

    def report(self) -> dict[str, int]:
        return {"held": self.held, "cap": self.cap, "refused": self.refused.count,
                "peer_cap": self.peer_cap, "peer_refused": self.peer_refused.count}


CONNECTIONS: web.AppKey[ConnectionCap] = web.AppKey("connections", ConnectionCap)


class CappedSite(web.BaseSite):
    """A bound listening socket served through the app's runner, every connection counted
    against `cap` (web.SockSite, with the cap's protocol factory)."""

    __slots__ = ("_cap", "_sock")

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, cap: ConnectionCap) -> None:
        super().__init__(runner)
        self._sock, self._cap = sock, cap

    @property
    def name(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://{url_host(host)}:{port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._cap.wrap(_answering_in_json(server)), sock=self._sock, backlog=BACKLOG)


# What was wrong with a request aiohttp could not read, by the parser's exception (most
# specific first). aiohttp's own text quotes the request's bytes back; the answer says what
# kind of fault it was and never repeats what the client sent.
_UNREADABLE: tuple[tuple[type[Exception], str], ...] = (
    (http_exceptions.LineTooLong, "a line of its head is too long"),
    (http_exceptions.BadHttpMethod, "its method is not an HTTP method"),
    (http_exceptions.InvalidURLError, "its target is not a valid URL"),
    (http_exceptions.BadStatusLine, "its request line is malformed"),
    (http_exceptions.InvalidHeader, "a header is malformed"),
    (http_exceptions.PayloadEncodingError,
     "its body does not match its Content-Length or Transfer-Encoding"),
)
# The parser's own description, when it is only that: a few words, no quotes, nothing after a
# colon ("Invalid header value char:", "Too many headers received"). Anything else may carry
# the client's bytes and is not repeated.
_PLAIN_DESCRIPTION = re.compile(r"[A-Za-z][A-Za-z0-9 -]{0,79}")


def unreadable_reason(status: int, exc: BaseException | None) -> str:
    """The error message of an answer made outside the app (aiohttp's handle_error): a request
    it could not parse, a timeout, a failure no middleware caught."""
    if status == 504:
        return "the request took too long"
    if status >= 500:
        return "internal error"
    what = "the request could not be read as HTTP/1.1"
    for kind, reason in _UNREADABLE:
        if isinstance(exc, kind):
            return f"{what}: {reason}"
    described = str(getattr(exc, "message", "") or "").split("\n", 1)[0].removesuffix(":")
    if _PLAIN_DESCRIPTION.fullmatch(described):
        return f"{what}: {described[:1].lower()}{described[1:]}"
    return what


class JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering what never reaches the app in the app's own
    shape. A request aiohttp cannot parse (a bad method, a control character in a header, a
    line past MAX_LINE_SIZE), and the rare failure outside every middleware, are answered by
    aiohttp itself: text/plain that quotes the offending bytes, without the security headers
    every other answer carries. Here they are `{"error": ...}` JSON with those headers, so a
    client reads every refusal the same way and no page can get its bytes echoed back."""

    __slots__ = ()

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None, message: str | None = None
                     ) -> web.StreamResponse:
        # aiohttp's own logs the fault (MalformedRequests turns a parse error into one line)
        # and refuses when part of an answer was sent already; its answer is replaced.
        super().handle_error(request, status, exc, message)
        response = error_response(status, unreadable_reason(status, exc))
        response.force_close()
        return response


def _answering_in_json(server: web.Server) -> Callable[[], asyncio.Protocol]:
    """aiohttp's connection factory, its handlers made JsonErrorHandler. aiohttp builds them
    (with every setting the runner was given); the subclass adds no state, only the method, so
    its class is set on each as it is made. Should a later aiohttp's handler refuse that (a
    layout of its own), connections keep aiohttp's handler and its plain-text refusals: the
    service still serves."""
    def make() -> asyncio.Protocol:
        handler = server()
        with contextlib.suppress(TypeError):
            handler.__class__ = JsonErrorHandler
        return handler
    return make


class BindError(OSError):
    """A listening address could not be taken; the message is the whole sentence."""


def url_host(host: str) -> str:
    """The host as it appears in a URL: IPv6 addresses in brackets."""
    return f"[{host}]" if ":" in host else host


def reason(exc: OSError) -> str:
    """An OSError's reason as the end of a sentence: 'address already in use'."""
    text = exc.strerror or str(exc)
    return text[:1].lower() + text[1:]


def _listener(info: tuple[Any, ...]) -> socket.socket:
    family, kind, proto, _, address = info
    sock = socket.socket(family, kind, proto)
    try:
        if os.name == "posix":  # what asyncio does: a restart need not wait out TIME_WAIT
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # "::" means IPv6 only; 0.0.0.0 is its own address
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def bind(hosts: Sequence[str], port: int) -> list[socket.socket]:
    """Listening sockets for every address of every host, all on one port.

    Port 0 takes a free port on the first address and the others then use that same port, so
    the service has one port whatever it listens on. BindError names the address that failed
    and why ("cannot listen on 127.0.0.1:7878: address already in use"); nothing stays bound.
    """
    sockets: list[socket.socket] = []
    for host in hosts:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
            for info in dict.fromkeys(infos):  # a name can resolve to one address twice
                sockets.append(_listener(info))
                port = port or sockets[0].getsockname()[1]
        except OSError as exc:
            for sock in sockets:
                sock.close()
            raise BindError(f"cannot listen on {url_host(host)}:{port}: {reason(exc)}"
                            ) from None
    return sockets


def addresses(sockets: Sequence[socket.socket]) -> list[tuple[str, int]]:
    """(address, port) of each socket as bound (port 0 resolved)."""
    return [(str(s.getsockname()[0]), int(s.getsockname()[1])) for s in sockets]


class Stopper:
    """SIGTERM/SIGINT handling: the first signal asks for a graceful stop, the second ends the
    process at once (128 + the signal's number, as a shell reports a signal)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.log = logging.getLogger(f"fleet_min.{name}")
        self.why: str | None = None
        self.event = asyncio.Event()

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            try:
                loop.add_signal_handler(sig, self.on_signal, sig)
            except NotImplementedError:  # Windows: a plain handler that calls into the loop
                signal.signal(sig, lambda num, _frame: loop.call_soon_threadsafe(
                    self.on_signal, num))

    def on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.why is None:
            self.why = name
            self.log.info("%s stopping (%s); a second signal exits at once", self.name, name)
            self.event.set()
            return
        self.log.warning("%s: second signal (%s), exiting now without waiting for open "
                         "requests or queued writes", self.name, name)
        logging.shutdown()  # flush the log; os._exit runs no handlers
        os._exit(128 + sig)


async def serve(app: web.Application, sockets: Sequence[socket.socket], *, name: str,
                grace_s: float, announce: Callable[[list[tuple[str, int]]], None],
                peer_connections: str = "auto", **runner_kwargs: Any) -> str:
    """Run `app` on the bound sockets until a stop signal; the name of the signal. The sockets
    are closed either way; a failure of the app's start-up propagates after whatever had
    started is cleaned up. `peer_connections` is FLEET_MAX_PEER_CONNECTIONS (see peer_share)."""
    stopper = Stopper(name)
    stopper.install()  # a signal during start-up is kept and honoured once started
    burst = accept_burst(asyncio.get_running_loop(), len(sockets))
    limit = connection_cap(burst)
    cap = ConnectionCap(limit, stopper.log, peer_share(limit, peer_connections),
                        app.get(WRITE_STALL_KEY, WRITE_STALL_S))
    app[CONNECTIONS] = cap  # for the service's health report
    # keepalive_timeout also closes a connection that never completes a request (slow loris).
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=grace_s,
                           access_log=None, keepalive_timeout=75.0,
                           **{**HEAD_LIMITS, **runner_kwargs})
    try:
        await runner.setup()
        if stopper.why is None:
            for sock in sockets:
                await CappedSite(runner, sock, cap).start()
            announce(addresses(sockets))
            await stopper.event.wait()
    finally:
        await runner.cleanup()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()
    assert stopper.why is not None  # only a signal ends the wait
    return stopper.why


def run(name: str, directory: Path, shown: str, what: str, hosts: Sequence[str], port: int,
        make_app: Callable[[], web.Application], *, grace_s: float,
        announce: Callable[[list[tuple[str, int]]], None], log_file: str = "",
        dir_mode: int = 0o700, peer_connections: str = "auto", **runner_kwargs: Any) -> int:
    """A service's whole life, the same for both: own its directory (made with `dir_mode` when
    missing; `what` names it in a refusal, `shown` as the person gave it), bind, build the app,
    run until a signal, and say how it ended. The exit code: 0 after a signal, 1 when it could
    not start. `peer_connections`: FLEET_MAX_PEER_CONNECTIONS (see peer_share)."""
    log = logging.getLogger(f"fleet_min.{name}")
    try:
        dirlock.hold(directory, name, shown=shown, mode=dir_mode)  # held until the process ends
        sockets = bind(hosts, port)
    except (dirlock.DirectoryInUse, BindError) as exc:
        return _refuse(name, str(exc))
    except OSError as exc:
        return _refuse(name, f"cannot use the {what} {shown}: {reason(exc)}")
    try:
        why = asyncio.run(serve(make_app(), sockets, name=name, grace_s=grace_s,
                                announce=announce, peer_connections=peer_connections,
                                **runner_kwargs))
    except StorageError as exc:
        log.error("%s", exc)
        # The log went to a file: the person at the terminal is told too.
        return _refuse(name, str(exc)) if log_file else 1
    except OSError as exc:  # a file of its own it cannot write (a token, the collector id)
        return _refuse(name, f"cannot start: {reason(exc)}: {exc.filename}")
    log.info("%s stopped (%s)", name, why)
    return 0


def _refuse(name: str, sentence: str) -> int:
    print(f"fleet-min {name}: {sentence}", file=sys.stderr)
    return 1

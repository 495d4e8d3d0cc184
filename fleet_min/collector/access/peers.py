"""Other collectors, known only as addresses to read (FLEET_PEERS).

Each peer is checked through its /api/health every REFRESH_S seconds and on demand; its stable
id (`collector` in that health answer) is how the proxy addresses it. A configured address keeps
the id it named first: a later answer naming another id, or two addresses naming the same id,
puts that id in doubt, and an id in doubt is never served (a peer cannot take over another's
id, nor answer under one id today and another tomorrow). The pin is stored (the `meta` table),
so a restart of this collector does not hand the address to whoever answers first after it;
only POST /api/peers/forget lets an address name a new id. The proxy only reads: GET
requests to an allow-list of read endpoints, no client header forwarded (in particular never the
client's X-Fleet-Token), no redirect followed, a short timeout and a cap on the answer's size.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import sqlite3
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import aiohttp
from yarl import URL

from fleet_min import jsonio
from fleet_min.config import CollectorConfig, ConfigError
from fleet_min.db import Database
from fleet_min.errors import BadRequest, Forbidden, NotFound, Refused
from fleet_min.http import read_capped
from fleet_min.timeutil import iso, now

log = logging.getLogger("fleet_min.collector.peers")

REFRESH_S = 30.0
TIMEOUT_S = 3.0
MAX_BODY = 8 << 20  # bytes of one proxied answer
# Proxied reads in flight at once; more wait their turn. Each holds up to MAX_BODY while its JSON
# is checked, and the client session alone would allow 100: 800 MiB on a Pi for a neighbour who
# asks a hundred times at once.
MAX_READS = 8
HEALTH_MAX = 64 << 10
PARSE_INLINE = 256 << 10  # a proxied answer larger than this is parsed off the loop
WARN_EVERY_S = 600.0  # at most one warning per peer this often, not one per check
# Not `.` or `..`: the dashboard puts a peer's id in its paths (/dash/@<id>/...), where those
# name a directory, and every read of that peer's view went to another path.
COLLECTOR_ID = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9._:-]{1,128}")

# The read endpoints a peer may be asked for; `{}` is one path segment.
READABLE: tuple[str, ...] = (
    "/api/health", "/api/overview", "/api/system",
    "/api/devices", "/api/devices/{}", "/api/devices/{}/beacons",
    "/api/jobs", "/api/jobs/{}",
    "/api/results", "/api/results/{}",
    "/api/schedules", "/api/schedules/{}", "/api/schedules/{}/history",
    "/api/alerts",
    "/api/artifacts", "/api/artifacts/gc-candidates", "/api/artifacts/{}",
    "/api/events", "/api/events/{}",
)


class BadGateway(Refused):
    status = 502


# -- pins, kept across restarts -------------------------------------------------------------------

PIN_KEY = "peer_pin "  # + the peer's base URL: a meta row whose value is the pinned id


def stored_pins(conn: sqlite3.Connection) -> dict[str, str]:
    """Base URL -> the id it was pinned to. A value that is no collector id (a hand-edited or
    restored row) pins nothing: the address is pinned again at its next answer."""
    rows = conn.execute("SELECT substr(key, ?), value FROM meta WHERE key >= ? AND key < ?",
                        (len(PIN_KEY) + 1, PIN_KEY, PIN_KEY[:-1] + "!")).fetchall()
    return {url: ident for url, ident in rows
            if isinstance(ident, str) and COLLECTOR_ID.fullmatch(ident)}


def store_pin(conn: sqlite3.Connection, url: str, ident: str) -> None:
    # Only the first answer pins: a row already there (from before a restart) is kept.
    conn.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING",
                 (PIN_KEY + url, ident))


def drop_pin(conn: sqlite3.Connection, url: str) -> None:
    conn.execute("DELETE FROM meta WHERE key = ?", (PIN_KEY + url,))


def check_forget(body: dict[str, Any]) -> str:
    """The base URL a POST /api/peers/forget names, or BadRequest (400)."""
    url = body.get("url")
    if set(body) != {"url"} or not isinstance(url, str) or not url.strip() or len(url) > 2048:
        raise BadRequest('the body must be {"url": "<a peer address as FLEET_PEERS lists it>"}')
    if any(ord(c) <= 32 or ord(c) == 127 for c in url.strip()):
        raise BadRequest("a peer address holds no spaces or control characters")
    try:
        return base_url(url)
    except ConfigError as exc:
        raise BadRequest(str(exc).removeprefix("FLEET_PEERS: ")) from None


def settings(config: CollectorConfig) -> list[str]:
    """FLEET_PEERS as normalised base URLs."""
    return [base_url(part) for part in config.peers if part.strip()]


def base_url(text: str) -> str:
    """`host:port` or `http(s)://host:port` -> `http(s)://host:port`; anything else refused."""
    value = text.strip()
    shown = _without_credentials(value)
    if "://" not in value:
        value = "http://" + value
    try:
        parts = urlsplit(value)  # raises on a lone bracket, or a host NFKC folds into a '/'
    except ValueError:
        raise ConfigError(f"FLEET_PEERS: {shown!r} is not a URL") from None
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"FLEET_PEERS: {shown!r} has an invalid port") from None
    if (parts.scheme not in ("http", "https") or not parts.hostname or parts.username
            or parts.password or parts.path not in ("", "/") or parts.query or parts.fragment):
        raise ConfigError(f"FLEET_PEERS: {shown!r} is not a collector address such as "
                          "http://pi5.local:8788 or 100.100.1.2:8788")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


def _without_credentials(address: str) -> str:
    """An address as a refusal quotes it: what stands before its last '@' (a user and a
    password, which the start-up error and the log would otherwise show) left out."""
    head, at, rest = address.rpartition("@")
    if not at:
        return address
    scheme, separator, _ = head.partition("://")
    return (scheme + separator if separator else "") + "<credentials>@" + rest


def readable_path(raw_tail: str) -> str:
    """The peer path to read, re-encoded segment by segment, or Forbidden (403).

    `raw_tail` is the still percent-encoded rest of the URL after /api/peers/{id}/, so an
    encoded slash stays inside its segment and cannot change which endpoint is asked for.
    """
    segments = [unquote(s) for s in raw_tail.split("/")]
    for segment in segments:
        if (segment in ("", ".", "..") or len(segment) > 256
                or any(ord(c) < 32 or ord(c) == 127 for c in segment)):
            raise Forbidden(f"/{raw_tail[:200]} is not a path the peer proxy reads")
    for pattern in READABLE:
        wanted = pattern.strip("/").split("/")
        if len(wanted) == len(segments) and all(
                w == "{}" or w == s for w, s in zip(wanted, segments, strict=True)):
            return "/" + "/".join(quote(s, safe="") for s in segments)
    raise Forbidden(f"the peer proxy only reads {', '.join(READABLE)}; "
                    f"/{raw_tail[:200]} is not one of them")


@dataclass
class Peer:
    url: str
    id: str | None = None  # pinned: the id this address named when it first answered
    claimed: str | None = None  # the id its latest answer named, when that is another
    name: str | None = None
    instance: str | None = None
    reachable: bool = False
    last_checked: float | None = None
    latency_ms: float | None = None
    error: str | None = None

    def record(self, doubt: str | None) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "url": self.url,
                "reachable": self.reachable and doubt is None,
                "last_checked": iso(self.last_checked), "latency_ms": self.latency_ms,
                "instance": self.instance, "error": doubt or self.error,
                "claimed": self.claimed}


def _problem(exc: BaseException) -> str:
    """A sentence about a failed request that carries no header or token."""
    if isinstance(exc, BadGateway):
        return exc.message
    if isinstance(exc, TimeoutError):
        return f"no answer within {TIMEOUT_S:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or type(exc.os_error).__name__})"
    return f"request failed ({type(exc).__name__})"


class Peers:
    def __init__(self, urls: list[str]) -> None:
        self.peers = [Peer(url) for url in dict.fromkeys(urls)]
        self._db: Database | None = None  # where pins are kept, once attached
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self._refreshing: asyncio.Task[None] | None = None
        self._warned: dict[str, float] = {}  # url -> when its last warning was logged
        self._reads = asyncio.Semaphore(MAX_READS)

    async def close(self) -> None:
        self._closed = True
        if self._refreshing is not None:
            self._refreshing.cancel()
            await asyncio.gather(self._refreshing, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """Made on first use, so a collector that fails to start leaves no session open."""
        if self._closed:
            raise BadGateway("this collector is shutting down; peers cannot be read")
        if self._session is None:
            # trust_env=False: peers are on the LAN or the mesh, never behind a web proxy.
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=TIMEOUT_S), trust_env=False,
                headers={"User-Agent": "fleet-min-collector"})
        return self._session

    async def attach(self, db: Database) -> None:
        """Take the pins stored before this start, and keep new ones in `db` from now on.
        Called before the first check, so no address can be pinned afresh by answering first."""
        pins = await db.read_in_thread(stored_pins)
        for peer in self.peers:
            peer.id = pins.get(peer.url, peer.id)
        self._db = db

    async def forget(self, url: str) -> dict[str, Any]:
        """Unpin a configured address (a peer replaced on purpose) and check it at once, so
        it is pinned to whatever id it names now. The peer's record after that check."""
        peer = next((p for p in self.peers if p.url == url), None)
        if peer is None:
            raise NotFound(f"{url} is not one of this collector's peers (FLEET_PEERS); "
                           "GET /api/peers lists them")
        was = peer.id
        peer.id = peer.claimed = None
        if self._db is not None:
            await self._db.write(drop_pin, url)
        log.warning("peer %s: its pinned id %s was forgotten on request", url, was)
        await self._check(peer)
        return {"ok": True, "forgotten": was, "peer": peer.record(self.doubt(peer))}

    async def loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("checking the peers failed; trying again in %s s", REFRESH_S)
            await asyncio.sleep(REFRESH_S)

    async def refresh(self, started_after: bool = False) -> None:
        """Check every peer once; callers arriving during a refresh share it. With
        `started_after` the check shared is one that began after this call (GET
        /api/peers?refresh=1 asks for the peers as they are now: a check already in flight may
        have had its answer before the peer changed)."""
        running = self._refreshing
        if started_after and running is not None and not running.done():
            await asyncio.shield(running)
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._check_all())
        await asyncio.shield(self._refreshing)

    async def _check_all(self) -> None:
        await asyncio.gather(*(self._check(peer) for peer in self.peers))
        for peer in self.peers:
            doubt = self.doubt(peer)
            if doubt is not None:
                self._warn(peer.url, doubt)

    async def _check(self, peer: Peer) -> None:
        started = time.perf_counter()
        try:
            async with self.session.get(peer.url + "/api/health", allow_redirects=False,
                                        headers={"Accept": "application/json"}) as resp:
                body = await _capped(resp, HEALTH_MAX)
                health = _json_object(body) if resp.status == 200 else None
                problem = None if health else f"/api/health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, BadGateway) as exc:
            health, problem = None, _problem(exc)
        peer.last_checked = now()
        peer.latency_ms = round((time.perf_counter() - started) * 1000, 1)
        ident = (health or {}).get("collector")
        if health is not None and not (isinstance(ident, str) and COLLECTOR_ID.fullmatch(ident)):
            problem = "/api/health did not name a collector id"
        if problem is not None:
            peer.reachable, peer.error = False, problem
            return
        assert health is not None and isinstance(ident, str)
        name = health.get("name")
        if peer.id is None:
            peer.id = ident  # pinned on first contact, before the write: no second pin races it
            if self._db is not None:
                await self._db.write(store_pin, peer.url, ident)
        peer.claimed = ident if ident != peer.id else None
        peer.reachable, peer.error = True, None
        peer.name = name if isinstance(name, str) else None
        instance = health.get("instance")
        peer.instance = instance if isinstance(instance, str) else None

    def doubt(self, peer: Peer) -> str | None:
        """Why this peer's pinned id cannot be trusted to name it, or None."""
        if peer.id is None:
            return None
        if peer.claimed is not None:
            return (f"its /api/health now names collector {peer.claimed}, but it named "
                    f"{peer.id} when first contacted; it is not served under either id until "
                    "it names the first again (if the peer was replaced on purpose, POST "
                    "/api/peers/forget with its url)")
        others = [p.url for p in self.peers if p is not peer and p.id == peer.id]
        if others:
            return (f"collector id {peer.id} is also claimed by {', '.join(others)}; no "
                    "address is served under an id two claim (list each collector once in "
                    "FLEET_PEERS, and remove the address that is not that collector)")
        return None

    def _warn(self, url: str, problem: str) -> None:
        """Log a problem with a peer at most once per WARN_EVERY_S, not at every check (a peer
        that changes its answer at will cannot flood the log either)."""
        at = time.monotonic()
        last = self._warned.get(url)
        if last is None or at - last >= WARN_EVERY_S:
            self._warned[url] = at
            log.warning("peer %s: %s", url, problem)

    def listing(self) -> dict[str, Any]:
        return {"peers": [peer.record(self.doubt(peer)) for peer in self.peers]}

    async def find(self, peer_id: str) -> Peer:
        """The one peer pinned to this id; an unknown id triggers one refresh before a 404, an
        id in doubt (changed, or claimed by two addresses) is BadGateway (502)."""
        for attempt in range(2):
            matches = [p for p in self.peers if p.id == peer_id]
            if matches:
                doubt = self.doubt(matches[0])
                if doubt is not None:
                    raise BadGateway(f"peer {peer_id} at {matches[0].url} is not served: {doubt}")
                return matches[0]
            if attempt == 0 and self.peers:
                await self.refresh()
        raise NotFound(f"no peer collector with id {peer_id!r}; GET /api/peers lists them")

    async def read(self, peer_id: str, raw_tail: str, raw_query: str) -> tuple[int, bytes]:
        """GET an allow-listed path from a peer: (status, JSON body bytes); MAX_READS at once."""
        path = readable_path(raw_tail)
        peer = await self.find(peer_id)
        async with self._reads:
            return await self._read(peer, peer_id, path, raw_query)

    async def _read(self, peer: Peer, peer_id: str, path: str, raw_query: str
                    ) -> tuple[int, bytes]:
        url = URL(peer.url + path + (f"?{raw_query}" if raw_query else ""), encoded=True)
        try:
            async with self.session.get(url, allow_redirects=False,
                                        headers={"Accept": "application/json"}) as resp:
                status = resp.status
                if not (200 <= status < 300 or 400 <= status < 600):
                    raise BadGateway(f"peer {peer_id} answered {path} with status {status}; "
                                     "the proxy relays only 2xx, 4xx and 5xx answers")
                body = await _capped(resp, MAX_BODY)
                if not resp.content_type.startswith("application/json"):
                    raise BadGateway(f"peer {peer_id} answered {path} with {status} and no JSON")
        except (aiohttp.ClientError, TimeoutError) as exc:
            peer.reachable, peer.error = False, _problem(exc)
            raise BadGateway(f"peer {peer_id} at {peer.url} is unreachable: "
                             f"{_problem(exc)}") from None
        await _check_json(body, f"peer {peer_id} answered {path} with {status} and")
        peer.reachable, peer.error = True, None
        return status, body


async def _capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole (decompressed) body, or BadGateway once it passes `limit` bytes."""
    body = await read_capped(resp, limit)
    if body is None:
        raise BadGateway(f"the peer's answer is larger than the proxy's {limit}-byte limit")
    return body


async def _check_json(body: bytes, said: str) -> None:
    """BadGateway unless the body is JSON nested no deeper than the collector accepts on input:
    what is relayed as application/json must be that. A large body is parsed on a thread so the
    loop keeps serving meanwhile."""
    try:
        if len(body) > PARSE_INLINE:
            await asyncio.to_thread(functools.partial(jsonio.loads_foreign, constants=False),
                                    body)
        else:
            jsonio.loads_foreign(body, constants=False)
    except jsonio.TooDeep:
        raise BadGateway(f"{said} JSON nested deeper than {jsonio.MAX_DEPTH} levels, which "
                         "the proxy does not relay") from None
    except ValueError:
        raise BadGateway(f"{said} a body that is not JSON, which the proxy does not relay"
                         ) from None


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        value = jsonio.loads_foreign(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None

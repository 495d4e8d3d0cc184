"""The mesh allowlist: an agent request from the mesh network must come from a node the operator
listed by name, and names that node so the request may act only for what that node may act for.

A peer's address is classified first. Only addresses in the mesh ranges (100.64.0.0/10 and
fd7a:115c:a1e0::/48) are looked up; loopback, LAN and every other address is admitted, because
for those the network itself (FLEET_BIND) is the access control. A mesh address is resolved with
the mesh's identity lookup, `tailscale whois --json <ip>` (an argv list, never a shell), and
admitted only when the node's name is in FLEET_MESH_ALLOW. Which device or executor name an
admitted node may act for is decided by fleet_min.collector.jobs.authority.

Which name counts: `Node.Name` (the MagicDNS name the coordination server assigns, e.g.
`pi5.example.ts.net.`, compared without the trailing dot) and `Node.ComputedName` (its short
form, e.g. `pi5`; for a node shared in from another tailnet it is the full name, so a short name
cannot be borrowed across tailnets). `Node.ComputedName` is only trusted when `Node.Name` is set,
because without a MagicDNS name it falls back to the host name the node reports about itself.
`Node.Hostinfo.Hostname` is never used for the same reason: any node can claim any host name.
The node a request comes from is named by its `Node.Name`, unique within the mesh.

Answers are cached per address for CACHE_S; an answer still in use near the end of that time is
looked up again in the background, so a busy agent never waits for the lookup on its hot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleet_min import jsonio
from fleet_min.config import CollectorConfig
from fleet_min.errors import Forbidden

log = logging.getLogger("fleet_min.collector.mesh")

MESH_V4 = ipaddress.ip_network("100.64.0.0/10")
MESH_V6 = ipaddress.ip_network("fd7a:115c:a1e0::/48")
LOOKUP_TIMEOUT_S = 3.0
CACHE_S = 60.0
REFRESH_AHEAD_S = 15.0  # a cached answer used this close to its end is looked up again
CACHE_MAX = 4096
MAX_OUTPUT = 1 << 20  # bytes of a lookup's answer; past it the process is stopped
MAX_ERROR = 4 << 10  # bytes of its stderr kept (for the first line of a failure)
READ_CHUNK = 64 << 10
PARALLEL_LOOKUPS = 4

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class MeshSettings:
    allow: frozenset[str] | None  # None: everyone admitted
    whois: str
    trusted_proxies: tuple[IpNetwork, ...] = ()  # whose X-Forwarded-For is believed


def settings(config: CollectorConfig) -> MeshSettings:
    """FLEET_MESH_ALLOW, FLEET_MESH_WHOIS, FLEET_TRUST_PROXY (already checked by config.py)."""
    allow = frozenset(normalise_name(n) for n in config.mesh_allow if n.strip()) or None
    whois = str(config.mesh_whois).strip() or "tailscale"
    proxies = tuple(ipaddress.ip_network(n, strict=False) for n in config.trust_proxy)
    return MeshSettings(allow, whois, proxies)


def normalise_name(name: str) -> str:
    """Node names compare as DNS names: without a trailing dot, case-insensitively."""
    return name.strip().rstrip(".").lower()


def parse_address(text: str | None) -> IpAddress | None:
    if not text:
        return None
    try:
        address = ipaddress.ip_address(text.strip().split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def classify(address: IpAddress | None) -> str:
    """'mesh', 'loopback', 'lan' (private or link-local), 'other', or 'unknown'."""
    if address is None:
        return "unknown"
    if address in MESH_V4 or address in MESH_V6:
        return "mesh"
    if address.is_loopback:
        return "loopback"
    if address.is_private or address.is_link_local:
        return "lan"
    return "other"


def peer_address(remote: str | None, forwarded_for: str | None,
                 trusted: tuple[IpNetwork, ...]) -> IpAddress | None:
    """The requesting peer's address: the socket's, unless that is a proxy named in
    FLEET_TRUST_PROXY; then the address that proxy saw, the last X-Forwarded-For entry (the one
    it added). Walking right to left past every trusted proxy finds the first hop no trusted
    proxy vouches for; entries left of it are the client's own say-so and never read. An entry
    that is not an address gives None (unknown), which the allowlist refuses."""
    address = parse_address(remote)
    if not trusted or not forwarded_for:
        return address
    hops = forwarded_for.split(",")
    while address is not None and hops and _trusted(address, trusted):
        address = parse_address(hops.pop())
    return address


def _trusted(address: IpAddress, trusted: tuple[IpNetwork, ...]) -> bool:
    # An address never belongs to a network of the other IP version (the test is just False).
    return any(address in network for network in trusted)


def node_names(whois: Any) -> set[str]:
    """The names a whois answer vouches for (see the module docstring for which and why)."""
    node = whois.get("Node") if isinstance(whois, dict) else None
    if not isinstance(node, dict):
        return set()
    name = node.get("Name")
    if not isinstance(name, str) or not normalise_name(name):
        return set()
    names = {normalise_name(name)}
    computed = node.get("ComputedName")
    if isinstance(computed, str) and normalise_name(computed):
        names.add(normalise_name(computed))
    return names


def node_name(whois: Any) -> str | None:
    """The node's own name, `Node.Name` normalised: what binds a device or an executor name."""
    node = whois.get("Node") if isinstance(whois, dict) else None
    name = node.get("Name") if isinstance(node, dict) else None
    if not isinstance(name, str):
        return None
    return normalise_name(name) or None


@dataclass(frozen=True)
class Lookup:
    names: frozenset[str]
    problem: str | None  # why the peer could not be identified
    node: str | None = None  # Node.Name, when identified


class MeshGate:
    """Admits or refuses agent requests by the mesh node they come from; caches identity
    lookups for CACHE_S seconds and refreshes a cached answer in use before it runs out."""

    def __init__(self, settings: MeshSettings, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.settings = settings
        self._clock = clock
        self._cache: OrderedDict[str, tuple[float, Lookup]] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[Lookup]] = {}
        self._parallel = asyncio.Semaphore(PARALLEL_LOOKUPS)
        self._refreshing: set[asyncio.Task[Lookup]] = set()
        self.lookups = 0  # processes started, for tests and /api/health curiosity

    @property
    def enabled(self) -> bool:
        return self.settings.allow is not None

    async def identify(self, remote: str | None, forwarded_for: str | None) -> str | None:
        """The mesh node an agent request comes from (its Node.Name), or None for a peer outside
        the mesh ranges or while no allowlist is set; Forbidden (403) for a mesh peer that is
        unidentified or not listed, and for a peer whose address cannot be told."""
        allow = self.settings.allow
        if allow is None:
            return None
        address = peer_address(remote, forwarded_for, self.settings.trusted_proxies)
        kind = classify(address)
        if kind == "unknown":
            raise Forbidden("this collector could not tell the requesting peer's address, "
                            "so the mesh allowlist refuses it")
        if kind != "mesh":
            return None
        found = await self.lookup(str(address))
        if found.problem is not None or found.node is None:
            log.warning("mesh peer %s refused: %s", address, found.problem)
            raise Forbidden(f"the mesh peer {address} could not be identified ({found.problem}); "
                            "unidentified mesh peers may not register or act for a device here")
        if not found.names & allow:
            shown = min(found.names, key=len)
            log.warning("mesh peer %s (%s) refused: not in FLEET_MESH_ALLOW", address, shown)
            raise Forbidden(f"mesh node {shown} is not in this collector's FLEET_MESH_ALLOW "
                            "list; ask its operator to add the node name")
        return found.node

    async def lookup(self, ip: str) -> Lookup:
        cached = self._cache.get(ip)
        if cached is not None:
            expires, found = cached
            left = expires - self._clock()
            if left > 0:
                if left < REFRESH_AHEAD_S and ip not in self._inflight:
                    self._refresh(ip)
                return found
        pending = self._inflight.get(ip)
        if pending is not None:  # one process per address however many polls ask at once
            return await asyncio.shield(pending)
        return await self._fetch(ip)

    def _refresh(self, ip: str) -> None:
        """Look a cached answer up again in the background while it is still served."""
        task = asyncio.get_running_loop().create_task(self._fetch(ip), name=f"whois-{ip}")
        self._refreshing.add(task)
        task.add_done_callback(self._refreshed)

    def _refreshed(self, task: asyncio.Task[Lookup]) -> None:
        self._refreshing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("refreshing a mesh identity failed: %s", task.exception())

    async def close(self) -> None:
        tasks = list(self._refreshing)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _fetch(self, ip: str) -> Lookup:
        future: asyncio.Future[Lookup] = asyncio.get_running_loop().create_future()
        self._inflight[ip] = future
        try:
            async with self._parallel:
                found, cacheable = await self._whois(ip)
            if cacheable:
                self._remember(ip, found)
            future.set_result(found)
            return found
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # marked retrieved: the waiters re-raise it themselves
            raise
        finally:
            del self._inflight[ip]

    def _remember(self, ip: str, found: Lookup) -> None:
        self._cache[ip] = (self._clock() + CACHE_S, found)
        self._cache.move_to_end(ip)
        while len(self._cache) > CACHE_MAX:
            self._cache.popitem(last=False)

    async def _whois(self, ip: str) -> tuple[Lookup, bool]:
        """Run the lookup; the flag says whether the answer may be cached (a definite answer
        may, a timeout or a missing binary may not: the next registration tries again)."""
        self.lookups += 1
        argv = [self.settings.whois, "whois", "--json", ip]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            return Lookup(frozenset(), f"cannot run {self.settings.whois}: {exc.strerror}"), False
        ran = await _output(proc)
        if ran is None:
            return Lookup(frozenset(), f"the identity lookup took over {LOOKUP_TIMEOUT_S:g} s"
                          ), False
        out, err = ran
        if len(out) > MAX_OUTPUT:  # it was stopped there, whatever it would have said after
            return Lookup(frozenset(), "the identity lookup answered more than "
                          f"{MAX_OUTPUT >> 20} MiB"), True
        if proc.returncode != 0:
            reason = err.decode("utf-8", "replace").strip().splitlines()[:1]
            detail = reason[0][:200] if reason else f"exit status {proc.returncode}"
            return Lookup(frozenset(), f"the identity lookup failed: {detail}"), True
        return _parse_whois(out), True


def _kill(proc: asyncio.subprocess.Process) -> None:
    """Stop the lookup and whatever it started (it runs in a session of its own): a script's
    child still holding the pipes would otherwise write on into them."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()


async def _output(proc: asyncio.subprocess.Process) -> tuple[bytes, bytes] | None:
    """The lookup's stdout, at most MAX_OUTPUT + 1 bytes (past MAX_OUTPUT it is stopped rather
    than read to its end), and the start of its stderr, once it has ended; None when it ran
    past LOOKUP_TIMEOUT_S (stopped then too). Each pipe has one reader for its whole life."""
    assert proc.stdout is not None and proc.stderr is not None
    deadline = asyncio.get_running_loop().time() + LOOKUP_TIMEOUT_S
    out = asyncio.ensure_future(_read_upto(proc.stdout, MAX_OUTPUT + 1))
    err = asyncio.ensure_future(_read_upto(proc.stderr, MAX_ERROR, drain=True))
    ended = asyncio.ensure_future(proc.wait())
    try:
        if await _within(deadline, out) and len(out.result()) <= MAX_OUTPUT:
            if await _within(deadline, err, ended):
                return out.result(), err.result()
        elif out.done():  # too much: it is stopped, and what it said so far is the answer
            await _reap(proc, out, err, ended)
            return out.result(), b""
        await _reap(proc, out, err, ended)
        return None
    finally:  # also when the collector stops while a lookup runs
        for task in (out, err, ended):
            task.cancel()
        if proc.returncode is None:
            _kill(proc)


async def _within(deadline: float, *tasks: asyncio.Future[Any]) -> bool:
    """Whether these all end before the deadline (they are left running if not)."""
    left = deadline - asyncio.get_running_loop().time()
    _done, pending = await asyncio.wait(tasks, timeout=max(left, 0))
    return not pending


async def _reap(proc: asyncio.subprocess.Process, out: asyncio.Future[bytes],
                *others: asyncio.Future[Any]) -> None:
    """Stop the lookup, then read its pipes to their end while waiting for it: a pipe left
    holding unread output is never seen to close, and the process is then never reaped.
    Bounded in case something it started left its session and still holds a pipe."""
    _kill(proc)
    assert proc.stdout is not None
    stdout = proc.stdout

    async def rest_of_stdout() -> None:
        await asyncio.gather(out, return_exceptions=True)  # its one reader ends first
        await _read_upto(stdout, 0, drain=True)

    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LOOKUP_TIMEOUT_S):
            await asyncio.gather(rest_of_stdout(), *others, return_exceptions=True)
            return
    log.warning("the identity lookup (pid %s) did not end once stopped", proc.pid)


async def _read_upto(stream: asyncio.StreamReader, limit: int, drain: bool = False) -> bytes:
    """At most `limit` bytes of a stream, read until it ends or they are in; with `drain`, the
    rest is read and dropped, so a process writing more than that is never blocked on it."""
    data = bytearray()
    while True:
        chunk = await stream.read(READ_CHUNK if drain else min(READ_CHUNK, limit - len(data)))
        if not chunk:
            break
        if len(data) < limit:
            data += chunk[:limit - len(data)]
        if len(data) >= limit and not drain:
            break
    return bytes(data)


def _parse_whois(out: bytes) -> Lookup:
    try:
        # Depth-checked before parsing: nesting past jsonio.MAX_DEPTH is a ValueError like
        # any other answer that is not JSON, never a RecursionError.
        answer = jsonio.loads_foreign(out)
    except ValueError:
        return Lookup(frozenset(), "the identity lookup did not answer JSON")
    names = node_names(answer)
    if not names:
        return Lookup(frozenset(), "the identity lookup named no node")
    return Lookup(frozenset(names), None, node_name(answer))

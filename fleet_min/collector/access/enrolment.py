"""Enrolment: what a person adding a device needs to point it at this collector.

The hard part of enrolling a phone is typing the collector's address on a touch keyboard, so
the "add a device" page shows the addresses worth encoding (as a one-line command and a QR
code). They come from what the collector is bound to, never from the request: a browser that
reached the dashboard through an SSH tunnel sees 127.0.0.1, which no phone can use.

- A specific FLEET_BIND address is listed as is; 0.0.0.0 lists this machine's IPv4 interface
  addresses (Linux: SIOCGIFADDR per interface; elsewhere the address that routes to the LAN).
- Exact FLEET_ALLOWED_HOSTS names (patterns cannot be typed) and the mDNS name, when
  advertising, follow as names.
- Order: LAN, mesh (100.64.0.0/10: works from anywhere on the tailnet), names, loopback (a
  simulator on this machine only).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import sqlite3
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from fleet_min.collector.access import mdns
from fleet_min.db import Database
from fleet_min.netkind import kind_of
from fleet_min.timeutil import iso

RUNNER_APP = "fleet-runner-android"  # x-artifact-app of the phone runner builds
AGENT_PATH = "/agent/fleet_agent.py"
QR_TEXT_MAX = 512
SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's IPv4 address
ORDER = {"lan": 0, "mesh": 1, "name": 2, "other": 3, "loopback": 4}


@dataclass(frozen=True)
class Base:
    address: str      # an IP address or a host name
    kind: str         # lan, mesh, name, loopback, other
    via: str          # the interface, "bind", "allowed-hosts" or "mdns"


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) of each interface that has one; empty where the ioctl is not
    Linux's (the caller falls back to the routed address)."""
    try:
        import fcntl  # not on Windows
        names = socket.if_nameindex()
    except (ImportError, OSError):
        return []
    found = []
    for _, name in names:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET,
                                                         socket.SOCK_DGRAM) as probe:
            packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
            found.append((name, socket.inet_ntoa(packed[20:24])))
    return found


def bound_bases(bind: Iterable[str]) -> list[Base]:
    """The addresses the collector answers on, as a device would type them."""
    bases: list[Base] = []
    for text in bind:
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            bases.append(Base(text, kind_of(text), "bind"))
            continue
        if not ip.is_unspecified:
            bases.append(Base(str(ip), kind_of(str(ip)), "bind"))
        elif isinstance(ip, ipaddress.IPv4Address):
            found = [(n, a) for n, a in interface_addresses()
                     if not ipaddress.ip_address(a).is_loopback]
            if not found:
                found = [("routed", a) for a in mdns.advertised_addresses(["0.0.0.0"])]
            bases.extend(Base(a, kind_of(a), name) for name, a in found)
            bases.append(Base("127.0.0.1", "loopback", "lo"))
    return bases


def name_bases(allowed_hosts: Iterable[str], mdns_name: str | None) -> list[Base]:
    names = [Base(h, "name", "allowed-hosts") for h in allowed_hosts
             if "*" not in h and h != "localhost"]
    if mdns_name:
        names.append(Base(mdns_name, "name", "mdns"))
    return names


def url_of(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


def command_for(url: str) -> str:
    """The one line that fetches the agent from this collector and starts it against it."""
    return (f"curl -fsSL {url}{AGENT_PATH} -o fleet_agent.py && "
            f"python3 fleet_agent.py --collector {url}")


def describe(bases: Iterable[Base], port: int) -> list[dict[str, Any]]:
    seen: set[str] = set()
    out = []
    for base in sorted(bases, key=lambda b: ORDER.get(b.kind, 3)):
        url = url_of(base.address, port)
        if url in seen:
            continue
        seen.add(url)
        out.append({"url": url, "address": base.address, "kind": base.kind, "via": base.via,
                    "command": command_for(url)})
    return out


async def runner_build(db: Database, app: str, pinned_only: bool) -> dict[str, Any] | None:
    """The build of `app` to offer: the newest pinned one, else (unless `pinned_only`) the
    newest published one, in the order queue.latest_build resolves `latest` by.

    Uploads are open (agents and CI publish builds), so a build is approved by pinning it,
    which the dashboard guard keeps to the operator when a token is set: then only a pinned
    build is offered, never one anyone on the network could have put there last."""
    # The original's runner builds arrive with no app header, named fleet-runner-<build>.apk.
    by_name = (" OR (app IS NULL AND name LIKE 'fleet-runner%.apk')" if app == RUNNER_APP
               else "")
    row = await db.read_one("SELECT sha256, name, app, build, platform, size, created_at, "
                            "pinned_reason IS NOT NULL AS pinned "
                            f"FROM artifacts WHERE (app = ?{by_name})"
                            f"{' AND pinned_reason IS NOT NULL' if pinned_only else ''} "
                            "ORDER BY pinned DESC, created_at DESC, rowid DESC LIMIT 1", (app,))
    if row is None:
        return None
    sha = row["sha256"]
    filename = row["name"] or f"{app}-{row['build'] or sha[:12]}"
    return {"sha256": row["sha256"], "name": row["name"], "app": row["app"],
            "build": row["build"], "platform": row["platform"], "size": row["size"],
            "created_at": iso(row["created_at"]), "filename": filename,
            "approved": bool(row["pinned"]),
            "download": f"/artifacts/{sha}?filename={quote(filename, safe='')}"}


# The page shows who registered since it opened and the pools an agent may join; neither needs
# the whole registry. Reading every device's pools (64 of 100 characters each, 25,000 devices)
# made one answer 163 MB and held the loop 2.65 s. The ids are the devices seen most recently
# (those a new device would be listed among), with the count of all; the pools are distinct,
# the first POOLS_SHOWN SQLite finds, and say when more exist.
KNOWN_IDS = 1_000
POOLS_SHOWN = 500

_KNOWN_IDS = "SELECT device_id FROM devices ORDER BY last_seen DESC, device_id LIMIT ?"
_DEVICE_COUNT = "SELECT COUNT(*) AS n FROM devices"
# An operator's override stands for the reported pools; a value that is not an array of text
# (a database edited by hand) has no pools. DISTINCT with a LIMIT stops the scan once found.
_POOLS_IN_USE = (
    "SELECT DISTINCT p.value AS pool FROM devices AS d, json_each(CASE WHEN "
    "json_valid(COALESCE(d.pools_override, d.pools)) AND json_type(COALESCE(d.pools_override, "
    "d.pools)) = 'array' THEN COALESCE(d.pools_override, d.pools) ELSE '[]' END) AS p "
    "WHERE p.type = 'text' LIMIT ?")
_TAKEN = "SELECT 1 FROM devices WHERE device_id = ?"


@dataclass(frozen=True)
class KnownDevices:
    ids: list[str]         # the KNOWN_IDS devices seen most recently, newest first
    count: int             # of all registered devices
    pools: list[str]       # in use, sorted, at most POOLS_SHOWN
    pools_truncated: bool  # more pools are in use than listed


async def known_devices(db: Database) -> KnownDevices:
    """The devices already registered and the pools in use, each bounded."""
    ids = [row["device_id"] for row in await db.read(_KNOWN_IDS, (KNOWN_IDS,))]
    counted = await db.read_one(_DEVICE_COUNT)
    # On a worker thread: with fewer pools in use than the limit the query reads every
    # device's pools, and at 25,000 devices of 64 pools each it held the shared reader (and
    # every request waiting for it) 1.7 s.
    async with db.slots("registry reads", 2):
        pools = await db.read_in_thread(_pools_in_use)
    return KnownDevices(ids, counted["n"] if counted else 0, sorted(pools[:POOLS_SHOWN]),
                        len(pools) > POOLS_SHOWN)


def _pools_in_use(conn: sqlite3.Connection) -> list[str]:
    return [str(row[0]) for row in conn.execute(_POOLS_IN_USE, (POOLS_SHOWN + 1,))]


async def device_id_taken(db: Database, device_id: str) -> bool:
    """Is a device registered under this id (one lookup, whatever the registry's size)?"""
    return await db.read_one(_TAKEN, (device_id,)) is not None

"""Optional mDNS/DNS-SD advertising of the collector as `_fleet-collector._tcp.local` (FLEET_MDNS).

A small stdlib responder, so fleet.pyz needs nothing extra: it joins 224.0.0.251:5353 (IPv4 only)
and answers PTR, SRV, TXT and A questions about this collector, plus the DNS-SD enumeration
question `_services._dns-sd._udp.local`. It announces itself at start and says goodbye (TTL 0)
at stop. It does not probe for name conflicts: the instance and host names carry the collector's
unique id, so two collectors cannot pick the same ones.

Answers go where RFC 6762 says: a query from a port other than 5353 (a "legacy" one-shot
resolver, and the tests) gets a unicast reply with the query id and the questions answered
echoed and TTLs capped at 10 s; a query asking for unicast (the QU bit) is answered to the
sender; the rest are multicast. Only sources on a local network are answered (on_local_network),
so the responder cannot be used to reflect traffic at an address elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from fleet_min.config import CollectorConfig

log = logging.getLogger("fleet_min.collector.mdns")

GROUP = "224.0.0.251"
PORT = 5353
SERVICE = "_fleet-collector._tcp.local"
ENUMERATION = "_services._dns-sd._udp.local"
A, PTR, TXT, SRV, ANY = 1, 12, 16, 33, 255
IN = 1
CACHE_FLUSH = 0x8000
QU = 0x8000
MAX_PACKET = 9000
MAX_JUMPS = 32
LEGACY_TTL = 10
LABEL_MAX = 63  # bytes of one DNS label
HASH_LEN = 10  # hex digits of the hash that stands for the rest of a long collector id
NAME_ROOM = 16  # bytes of the instance label kept for the collector's name beside a long id


class MalformedPacket(ValueError):
    pass


def enabled(config: CollectorConfig) -> bool:
    """FLEET_MDNS; off by default."""
    return bool(config.mdns)


# -- wire format ----------------------------------------------------------------------------------


def encode_name(name: str) -> bytes:
    out = bytearray()
    for label in name.rstrip(".").split("."):
        raw = label.encode("utf-8")
        if not 0 < len(raw) <= 63:
            raise ValueError(f"DNS label {label!r} must be 1 to 63 bytes")
        out += bytes([len(raw)]) + raw
    return bytes(out + b"\x00")


def read_name(packet: bytes, offset: int) -> tuple[str, int]:
    """A possibly compressed name at offset: (name, offset just past it in the original run)."""
    labels: list[str] = []
    end = None
    jumps = 0
    while True:
        if offset >= len(packet):
            raise MalformedPacket("a name runs past the end of the packet")
        length = packet[offset]
        if length & 0xC0 == 0xC0:
            if offset + 1 >= len(packet) or jumps >= MAX_JUMPS:
                raise MalformedPacket("a compressed name is broken or loops")
            end = offset + 2 if end is None else end
            offset = ((length & 0x3F) << 8) | packet[offset + 1]
            jumps += 1
            continue
        if length & 0xC0:
            raise MalformedPacket("a label uses an unknown encoding")
        offset += 1
        if length == 0:
            break
        if offset + length > len(packet):
            raise MalformedPacket("a label runs past the end of the packet")
        labels.append(packet[offset:offset + length].decode("utf-8", "replace"))
        offset += length
    return ".".join(labels), (offset if end is None else end)


@dataclass(frozen=True)
class Question:
    name: str
    qtype: int
    unicast: bool


def parse_query(packet: bytes) -> tuple[int, list[Question]]:
    """(query id, questions) of a query packet; responses and junk raise MalformedPacket."""
    if len(packet) < 12 or len(packet) > MAX_PACKET:
        raise MalformedPacket("not a DNS packet")
    ident, flags, qdcount = struct.unpack_from("!HHH", packet, 0)
    if flags & 0x8000:
        raise MalformedPacket("a response, not a query")
    questions, offset = [], 12
    for _ in range(min(qdcount, 64)):
        name, offset = read_name(packet, offset)
        if offset + 4 > len(packet):
            raise MalformedPacket("a question is cut short")
        qtype, qclass = struct.unpack_from("!HH", packet, offset)
        offset += 4
        if qclass & 0x7FFF in (IN, ANY):
            questions.append(Question(name, qtype, bool(qclass & QU)))
    return ident, questions


@dataclass(frozen=True)
class Record:
    name: str
    rtype: int
    ttl: int
    data: bytes  # already-encoded rdata
    unique: bool  # sets the cache-flush bit (not in legacy unicast replies)

    def encode(self, ttl_cap: int | None = None, legacy: bool = False) -> bytes:
        ttl = self.ttl if ttl_cap is None else min(self.ttl, ttl_cap)
        rclass = IN | (CACHE_FLUSH if self.unique and not legacy else 0)
        return (encode_name(self.name) + struct.pack("!HHIH", self.rtype, rclass, ttl,
                                                     len(self.data)) + self.data)


def txt_data(entries: Iterable[str]) -> bytes:
    out = bytearray()
    for entry in entries:
        raw = entry.encode("utf-8")[:255]
        out += bytes([len(raw)]) + raw
    return bytes(out or b"\x00")


def build_response(records: list[Record], ident: int = 0,
                   questions: list[Question] | None = None, legacy: bool = False,
                   goodbye: bool = False) -> bytes:
    qs = questions or []
    header = struct.pack("!HHHHHH", ident, 0x8400, len(qs), len(records), 0, 0)
    body = b"".join(encode_name(q.name) + struct.pack("!HH", q.qtype, IN) for q in qs)
    cap = 0 if goodbye else (LEGACY_TTL if legacy else None)
    return header + body + b"".join(r.encode(cap, legacy) for r in records)


# -- what this collector says about itself --------------------------------------------------------


def clip(text: str, max_bytes: int) -> str:
    """The longest start of `text` that fits `max_bytes` of UTF-8, never half a character."""
    return text.encode("utf-8", "replace")[:max(max_bytes, 0)].decode("utf-8", "ignore")


def id_part(collector_id: str, max_bytes: int) -> str:
    """The collector id as a name may carry it: dots made dashes (a dot would split the label),
    and an id longer than `max_bytes` cut short with a hash of the whole id appended, so two
    long ids that start alike still give two names."""
    text = collector_id.replace(".", "-")
    if len(text.encode("utf-8", "replace")) <= max_bytes:
        return text
    digest = hashlib.sha256(collector_id.encode("utf-8", "surrogatepass")).hexdigest()[:HASH_LEN]
    return clip(text, max_bytes - HASH_LEN - 1) + "-" + digest


def instance_label(name: str, collector_id: str) -> str:
    """`<name> (<id>)` in one label of at most 63 bytes: the name is shortened first, the id
    only when it would leave the name fewer than NAME_ROOM bytes."""
    room = NAME_ROOM if name.strip() else 0
    ident = f"({id_part(collector_id, LABEL_MAX - 3 - room)})"
    shown = clip(name.replace(".", "-"), LABEL_MAX - len(ident.encode("utf-8")) - 1).rstrip()
    return f"{shown} {ident}" if shown else ident


def host_label(collector_id: str) -> str:
    """`fleet-<id>`, the advertised host's one label, at most 63 bytes."""
    return "fleet-" + id_part(collector_id, LABEL_MAX - len("fleet-"))


@dataclass(frozen=True)
class Advert:
    name: str
    collector_id: str
    port: int
    addresses: tuple[str, ...]  # IPv4 addresses peers can reach

    def with_id(self, collector_id: str) -> Advert:
        return Advert(self.name, collector_id, self.port, self.addresses)

    @property
    def instance(self) -> str:
        return f"{instance_label(self.name, self.collector_id)}.{SERVICE}"

    @property
    def host(self) -> str:
        return f"{host_label(self.collector_id)}.local"

    def records(self) -> dict[str, Record]:
        srv = struct.pack("!HHH", 0, 0, self.port) + encode_name(self.host)
        txt = txt_data([f"id={self.collector_id}", f"name={self.name}", "path=/api/health",
                        "v=1"])
        out = {
            "ptr": Record(SERVICE, PTR, 4500, encode_name(self.instance), False),
            "enum": Record(ENUMERATION, PTR, 4500, encode_name(SERVICE), False),
            "srv": Record(self.instance, SRV, 120, srv, True),
            "txt": Record(self.instance, TXT, 4500, txt, True),
        }
        for index, address in enumerate(self.addresses):
            out[f"a{index}"] = Record(self.host, A, 120, socket.inet_aton(address), True)
        return out

    def answer(self, questions: list[Question]) -> list[Record]:
        """The records that answer these questions, with the ones a browser needs next."""
        return self.answered(questions)[1]

    def answered(self, questions: list[Question]) -> tuple[list[Question], list[Record]]:
        """(the questions this collector has an answer to, the records answering them)."""
        rec = self.records()
        addresses = [r for key, r in rec.items() if key.startswith("a")]
        asked: list[Question] = []
        wanted: list[Record] = []
        for q in questions:
            found = self._answer_one(q, rec, addresses)
            if found:
                asked.append(q)
                wanted += found
        return asked, list(dict.fromkeys(wanted))

    def _answer_one(self, q: Question, rec: dict[str, Record], addresses: list[Record]
                    ) -> list[Record]:
        name, qtype = q.name.lower().rstrip("."), q.qtype
        if name == SERVICE.lower() and qtype in (PTR, ANY):
            return [rec["ptr"], rec["srv"], rec["txt"], *addresses]
        if name == ENUMERATION.lower() and qtype in (PTR, ANY):
            return [rec["enum"]]
        if name == self.instance.lower():
            return ([rec["srv"], *addresses] if qtype in (SRV, ANY) else []) + (
                [rec["txt"]] if qtype in (TXT, ANY) else [])
        if name == self.host.lower() and qtype in (A, ANY):
            return addresses
        return []


def on_local_network(host: str) -> bool:
    """Whether a query's source may be answered (RFC 6762 section 11: only the local link).
    Which subnets are directly connected cannot be read portably, so this holds to the
    addresses a local network uses: loopback, link-local and the private ranges. A public
    source (the spoofed victim of a reflection) and a mesh address (100.64.0.0/10, which
    carries no multicast) are not answered."""
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or address.is_link_local or address.is_private


# -- the responder -------------------------------------------------------------------------


class Responder(asyncio.DatagramProtocol):
    def __init__(self, advert: Advert, group_port: int = PORT, multicast: bool = True) -> None:
        self.advert = advert
        self.group = (GROUP, group_port)
        self.multicast = multicast
        self.transport: asyncio.DatagramTransport | None = None
        self.answered = 0
        self.dropped = 0  # malformed queries and queries that could not be answered
        self.refused = 0  # queries from sources off the local network

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # CPython's selector datagram transport does not subclass DatagramTransport.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        # Nothing a packet holds may raise out of here: the loop would log a traceback for
        # each one, and anyone on the network could fill the log.
        if not on_local_network(str(addr[0])):
            self.refused += 1
            return
        try:
            reply = self._reply(data, addr)
        except ValueError:  # MalformedPacket, or a name that cannot be encoded back
            self.dropped += 1
            return
        if reply is not None and self.transport is not None:
            self.answered += 1
            with contextlib.suppress(OSError):
                self.transport.sendto(*reply)

    def _reply(self, data: bytes, addr: tuple[str | Any, int]
               ) -> tuple[bytes, tuple[str | Any, int]] | None:
        """(packet, where to) answering a query, or None when there is nothing to say."""
        ident, questions = parse_query(data)
        asked, answers = self.advert.answered(questions)
        if not answers:
            return None
        if addr[1] != self.group[1]:  # a one-shot resolver: unicast, id echoed, short TTLs
            # Only the questions answered are echoed: the others may hold names (the root,
            # an empty label, undecodable bytes) that cannot be written back.
            return build_response(answers, ident, asked, legacy=True), addr
        if all(q.unicast for q in questions) or not self.multicast:
            return build_response(answers), addr
        return build_response(answers), self.group

    def announce(self, goodbye: bool = False) -> None:
        if self.transport is not None and self.multicast:
            packet = build_response(list(self.advert.records().values()), goodbye=goodbye)
            with contextlib.suppress(OSError):
                self.transport.sendto(packet, self.group)


def multicast_socket(port: int = PORT) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):  # share 5353 with avahi or mDNSResponder
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("", port))
        membership = struct.pack("4s4s", socket.inet_aton(GROUP), socket.inet_aton("0.0.0.0"))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, membership)
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 255)
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def advertised_addresses(bind: Iterable[str]) -> tuple[str, ...]:
    """The IPv4 addresses to advertise: specific bind addresses, or for 0.0.0.0 the address
    this host would use to reach the mDNS group (no packet is sent to find it)."""
    found: list[str] = []
    for text in bind:
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            continue
        if not isinstance(address, ipaddress.IPv4Address) or address.is_loopback:
            continue
        if address.is_unspecified:
            with contextlib.suppress(OSError), socket.socket(socket.AF_INET,
                                                             socket.SOCK_DGRAM) as probe:
                probe.connect((GROUP, PORT))
                primary = probe.getsockname()[0]
                if primary and not ipaddress.ip_address(primary).is_unspecified:
                    found.append(primary)
        else:
            found.append(str(address))
    return tuple(dict.fromkeys(found))


class Advertiser:
    """Starts and stops the responder; never stops the collector from starting."""

    def __init__(self, advert: Advert) -> None:
        self.advert = advert
        self.state = "off"
        self._protocol: Responder | None = None
        self._announcer: asyncio.Task[None] | None = None

    async def start(self, sock: socket.socket | None = None, multicast: bool = True,
                    group_port: int = PORT) -> None:
        """Start answering (tests pass their own socket and group port; 5353 otherwise)."""
        if not self.advert.addresses:
            self.state = "unavailable: no non-loopback IPv4 address to advertise"
            log.warning("mDNS %s (FLEET_BIND holds only loopback or IPv6 addresses)", self.state)
            return
        try:
            sock = sock or multicast_socket(group_port)
            loop = asyncio.get_running_loop()
            _transport, protocol = await loop.create_datagram_endpoint(
                lambda: Responder(self.advert, group_port, multicast), sock=sock)
        except OSError as exc:
            self.state = f"unavailable: {exc.strerror or exc}"
            log.warning("mDNS advertising is unavailable: %s", exc)
            return
        self._protocol = protocol
        self.state = "advertising"
        self._announcer = asyncio.ensure_future(self._announce())
        log.info("mDNS: advertising %s on %s", self.advert.instance, ",".join(
            self.advert.addresses))

    async def _announce(self) -> None:
        for _ in range(2):  # RFC 6762 section 8.3: at least twice, one second apart
            if self._protocol is not None:
                self._protocol.announce()
            await asyncio.sleep(1.0)

    async def stop(self) -> None:
        if self._announcer is not None:
            self._announcer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._announcer
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.announce(goodbye=True)
            self._protocol.transport.close()
        self._protocol = None
        if self.state == "advertising":
            self.state = "off"

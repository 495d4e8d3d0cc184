"""mDNS advertising (FLEET_MDNS): the responder answered over real UDP sockets on this host.

The answers are decoded here by a small reader written for the test, independent of the
encoder in fleet_min.collector.access.mdns.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from fleet_min.collector.access import mdns
from tests.support.collector import CollectorProcess

ADVERT = mdns.Advert("shelf", "col-0123456789abcdef", 8788, ("192.0.2.10",))
WAIT_S = 10


def query(name, qtype, ident=0x1234, unicast=False):
    qclass = 1 | (0x8000 if unicast else 0)
    return (struct.pack("!HHHHHH", ident, 0, 1, 0, 0, 0) + mdns.encode_name(name)
            + struct.pack("!HH", qtype, qclass))


def decode_name(data, offset):
    labels = []
    end = None
    while True:
        length = data[offset]
        if length >= 0xC0:
            end = end or offset + 2
            offset = ((length & 0x3F) << 8) | data[offset + 1]
            continue
        offset += 1
        if not length:
            return ".".join(labels), end or offset
        labels.append(data[offset:offset + length].decode())
        offset += length


def decode_response(data):
    ident, flags, qd, an, ns, ar = struct.unpack_from("!HHHHHH", data)
    offset = 12
    for _ in range(qd):
        _name, offset = decode_name(data, offset)
        offset += 4
    records = []
    for _ in range(an + ns + ar):
        name, offset = decode_name(data, offset)
        rtype, rclass, ttl, length = struct.unpack_from("!HHIH", data, offset)
        offset += 10
        rdata = data[offset:offset + length]
        if rtype == mdns.PTR:
            value = decode_name(data, offset)[0]
        elif rtype == mdns.SRV:
            value = (*struct.unpack_from("!HHH", rdata), decode_name(data, offset + 6)[0])
        elif rtype == mdns.TXT:
            value, i = [], 0
            while i < len(rdata):
                value.append(rdata[i + 1:i + 1 + rdata[i]].decode())
                i += 1 + rdata[i]
        elif rtype == mdns.A:
            value = socket.inet_ntoa(rdata)
        else:
            value = rdata
        records.append((name, rtype, rclass, ttl, value))
        offset += length
    return ident, flags, qd, records


class Receiver(asyncio.DatagramProtocol):
    def __init__(self):
        self.packets = asyncio.Queue()

    def datagram_received(self, data, addr):
        self.packets.put_nowait((data, addr))


async def unicast_responder(advert=ADVERT):
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    advertiser = mdns.Advertiser(advert)
    await advertiser.start(sock=sock, multicast=False)
    return advertiser, sock.getsockname()


async def ask(address, packet):
    loop = asyncio.get_running_loop()
    transport, receiver = await loop.create_datagram_endpoint(Receiver,
                                                              local_addr=("127.0.0.1", 0))
    try:
        transport.sendto(packet, address)
        async with asyncio.timeout(WAIT_S):
            data, _ = await receiver.packets.get()
        return decode_response(data)
    finally:
        transport.close()


# -- wire format ---------------------------------------------------------------------------------


def test_names_round_trip_and_bad_packets_are_refused():
    packet = query("_fleet-collector._tcp.local", mdns.PTR, unicast=True)
    ident, [q] = mdns.parse_query(packet)
    assert ident == 0x1234 and q == mdns.Question("_fleet-collector._tcp.local", mdns.PTR, True)
    looping = struct.pack("!HHHHHH", 1, 0, 1, 0, 0, 0) + b"\xc0\x0c" + b"\x00\x0c\x00\x01"
    one_question = struct.pack("!HHHHHH", 1, 0, 1, 0, 0, 0)
    for bad in (b"x", b"\x00" * 11, looping, packet[:-3], one_question + b"\x3fab",
                one_question + b"\x80ab", b"\x00" * (mdns.MAX_PACKET + 1)):
        with pytest.raises(mdns.MalformedPacket):
            mdns.parse_query(bad)
    response = bytearray(packet)
    response[2] |= 0x80
    with pytest.raises(mdns.MalformedPacket):
        mdns.parse_query(bytes(response))


def test_long_names_are_shortened_to_one_label():
    label = mdns.instance_label("a" * 80, "col-0123456789abcdef")
    assert len(label.encode()) <= 63 and label.endswith("(col-0123456789abcdef)")
    assert "." not in mdns.instance_label("pi5.local", "col-1")


LONG_IDS = ["col-" + "a" * 76, "col-" + "b" * 196, "c" * 58, "col-" + "é" * 60,
            "col-" + "😀" * 50, "col." + "d" * 70]


@pytest.mark.timeout(10)  # the label once never came back for an id over 58 characters
@pytest.mark.parametrize("name", ["shelf", "", "a" * 80, "ünïcødé nåme 😀" * 6, "pi5.local"])
@pytest.mark.parametrize("collector_id", LONG_IDS, ids=lambda i: f"{len(i)}-chars")
def test_a_long_collector_id_still_gives_names_that_fit(name, collector_id):
    label = mdns.instance_label(name, collector_id)
    host = mdns.host_label(collector_id)
    for one in (label, host):
        assert 0 < len(one.encode()) <= 63 and "." not in one
        one.encode("utf-8")  # whole characters only
    advert = mdns.Advert(name, collector_id, 8788, ("192.0.2.10",))
    assert advert.host == host + ".local"
    records = advert.records()  # every name and record encodes
    assert mdns.read_name(records["ptr"].data, 0)[0] == advert.instance
    if name.strip():
        assert label.startswith(name.replace(".", "-")[:4])  # the name keeps a place
    # two long ids that start alike still give two names
    other = collector_id[:-1] + "z"
    assert mdns.instance_label(name, other) != label and mdns.host_label(other) != host


def test_ids_that_fit_are_advertised_whole():
    assert mdns.host_label("col-0123456789abcdef") == "fleet-col-0123456789abcdef"
    assert mdns.instance_label("vm", "col-" + "a" * 40) == f"vm (col-{'a' * 40})"


# -- the responder over UDP ----------------------------------------------------------------------


async def test_browse_answers_ptr_with_srv_txt_and_address():
    advertiser, address = await unicast_responder()
    try:
        ident, flags, qd, records = await ask(address, query(mdns.SERVICE, mdns.PTR))
    finally:
        await advertiser.stop()
    assert ident == 0x1234 and flags & 0x8000 and qd == 1  # legacy unicast: id and question
    by_type = {r[1]: r for r in records}
    instance = "shelf (col-0123456789abcdef)._fleet-collector._tcp.local"
    assert by_type[mdns.PTR][0] == mdns.SERVICE and by_type[mdns.PTR][4] == instance
    assert by_type[mdns.SRV][4] == (0, 0, 8788, "fleet-col-0123456789abcdef.local")
    assert by_type[mdns.TXT][4] == ["id=col-0123456789abcdef", "name=shelf",
                                    "path=/api/health", "v=1"]
    assert by_type[mdns.A][0] == "fleet-col-0123456789abcdef.local"
    assert by_type[mdns.A][4] == "192.0.2.10"
    assert all(r[3] <= 10 for r in records)  # legacy replies cap TTLs at 10 s
    assert all(r[2] == 1 for r in records)  # and carry no cache-flush bit


async def test_instance_host_and_enumeration_questions():
    advertiser, address = await unicast_responder()
    try:
        _, _, _, srv = await ask(address, query(ADVERT.instance, mdns.SRV))
        _, _, _, txt = await ask(address, query(ADVERT.instance.upper(), mdns.TXT))
        _, _, _, a = await ask(address, query(ADVERT.host, mdns.A))
        _, _, _, enum = await ask(address, query(mdns.ENUMERATION, mdns.PTR))
    finally:
        await advertiser.stop()
    assert {r[1] for r in srv} == {mdns.SRV, mdns.A}
    assert [r[1] for r in txt] == [mdns.TXT]
    assert [r[4] for r in a] == ["192.0.2.10"]
    assert [r[4] for r in enum] == [mdns.SERVICE]


async def test_other_questions_and_junk_get_no_answer():
    advertiser, address = await unicast_responder()
    loop = asyncio.get_running_loop()
    transport, receiver = await loop.create_datagram_endpoint(Receiver,
                                                              local_addr=("127.0.0.1", 0))
    try:
        transport.sendto(query("_http._tcp.local", mdns.PTR), address)
        transport.sendto(b"\xff" * 40, address)
        transport.sendto(query(mdns.SERVICE, mdns.PTR, ident=7), address)  # the marker
        async with asyncio.timeout(WAIT_S):
            data, _ = await receiver.packets.get()
        assert decode_response(data)[0] == 7  # the first answer is the marker's
    finally:
        transport.close()
        await advertiser.stop()


PTR_QUESTION = mdns.encode_name(mdns.SERVICE) + struct.pack("!HH", mdns.PTR, 1)


@pytest.mark.parametrize("odd", [
    b"\x00",  # the root name
    bytes([63]) + b"\xff" * 63 + b"\x00",  # a label that is no UTF-8
    b"\x01.\x00",  # a label holding a dot: an empty label once written back
], ids=["root", "0xff-label", "dot-label"])
async def test_a_question_that_cannot_be_written_back_is_not_echoed(odd, caplog):
    """A valid question beside an odd one is answered, echoing only the question answered;
    nothing is logged as an error, and the responder keeps answering."""
    caplog.set_level("DEBUG")
    advertiser, address = await unicast_responder()
    packet = (struct.pack("!HHHHHH", 0x4242, 0, 2, 0, 0, 0) + PTR_QUESTION + odd
              + struct.pack("!HH", mdns.A, 1))
    try:
        ident, _, qd, records = await ask(address, packet)
        assert ident == 0x4242 and qd == 1
        assert {r[1] for r in records} >= {mdns.PTR, mdns.SRV}
        odd_only = struct.pack("!HHHHHH", 7, 0, 1, 0, 0, 0) + odd + struct.pack("!HH", 1, 1)
        loop = asyncio.get_running_loop()
        transport, receiver = await loop.create_datagram_endpoint(
            Receiver, local_addr=("127.0.0.1", 0))
        try:
            for _ in range(50):
                transport.sendto(odd_only, address)
            transport.sendto(query(mdns.SERVICE, mdns.PTR, ident=8), address)  # the marker
            async with asyncio.timeout(WAIT_S):
                data, _ = await receiver.packets.get()
            assert decode_response(data)[0] == 8  # the odd ones got nothing
        finally:
            transport.close()
    finally:
        await advertiser.stop()
    assert not [r for r in caplog.records if r.levelno >= 40], caplog.text


@pytest.mark.parametrize(("source", "answered"), [
    ("127.0.0.1", True), ("192.168.1.20", True), ("10.1.2.3", True), ("172.16.0.9", True),
    ("169.254.7.7", True), ("fe80::1%eth0", True), ("fd00::5", True), ("::ffff:192.168.1.2", True),
    ("8.8.8.8", False), ("203.0.114.9", False), ("100.64.0.5", False), ("2001:4860::8888", False),
    ("::ffff:8.8.8.8", False), ("not an address", False),
])
def test_only_sources_on_a_local_network_are_answered(source, answered):
    """RFC 6762 section 11: a reply to any source would let a spoofed query reflect it at an
    address elsewhere. (A public source address cannot be sent from on a test machine, so the
    rule is shown here; the responder consults it before anything else.)"""
    assert mdns.on_local_network(source) is answered


async def test_multicast_query_gets_a_multicast_answer():
    """On the real group address (on a free port, not 5353, so nothing else is disturbed)."""
    port = free_udp_port()
    try:
        responder_sock = mdns.multicast_socket(port)
        listener = mdns.multicast_socket(port)
    except OSError as exc:
        pytest.skip(f"no IPv4 multicast on this host: {exc}")
    advertiser = mdns.Advertiser(ADVERT)
    loop = asyncio.get_running_loop()
    transport, receiver = await loop.create_datagram_endpoint(Receiver, sock=listener)
    await advertiser.start(sock=responder_sock, group_port=port)
    try:
        assert advertiser.state == "advertising"
        transport.sendto(query(mdns.SERVICE, mdns.PTR, ident=0), (mdns.GROUP, port))
        async with asyncio.timeout(WAIT_S):
            while True:
                data, _ = await receiver.packets.get()
                if data[2] & 0x80:  # a response (the listener also hears its own query)
                    break
    except (OSError, TimeoutError) as exc:
        pytest.skip(f"multicast is not delivered on this host: {exc}")
    finally:
        transport.close()
        await advertiser.stop()
    _, _, _, records = decode_response(data)
    assert any(r[1] == mdns.SRV and r[2] & 0x8000 for r in records)  # cache-flush on unique


def free_udp_port():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_only_routable_ipv4_addresses_are_advertised():
    assert mdns.advertised_addresses(["127.0.0.1", "::1", "fd7a:115c:a1e0::1"]) == ()
    assert mdns.advertised_addresses(["192.0.2.7", "127.0.0.1"]) == ("192.0.2.7",)


async def test_nothing_to_advertise_is_reported_not_fatal():
    advertiser = mdns.Advertiser(mdns.Advert("x", "col-1", 8788, ()))
    await advertiser.start()
    assert advertiser.state.startswith("unavailable")
    await advertiser.stop()


async def test_collector_health_shows_mdns_state(collector_factory, monkeypatch):
    monkeypatch.delenv("FLEET_MDNS", raising=False)
    client = await collector_factory()
    assert (await (await client.get("/api/health")).json())["mdns"] == "off"


async def test_collector_on_loopback_only_says_mdns_is_unavailable(collector_factory,
                                                                   monkeypatch, tmp_path):
    monkeypatch.setenv("FLEET_MDNS", "1")
    client = await collector_factory(mdns=True)  # the test collector binds 127.0.0.1 only
    health = await (await client.get("/api/health")).json()
    assert health["mdns"].startswith("unavailable") and health["ok"] is True


async def test_the_advertised_name_is_a_name_the_collector_answers_to(collector_factory,
                                                                      monkeypatch):
    monkeypatch.setenv("FLEET_MDNS", "1")
    client = await collector_factory(mdns=True)
    collector = (await (await client.get("/api/health")).json())["collector"]
    resp = await client.get("/api/health", headers={"Host": f"fleet-{collector}.local:8788"})
    assert resp.status == 200
    resp = await client.get("/api/health", headers={"Host": "fleet-col-0000000000000000.local"})
    assert resp.status == 421  # another collector's name is not this one's


async def test_without_mdns_the_advertised_name_is_not_answered(collector_factory, monkeypatch):
    monkeypatch.delenv("FLEET_MDNS", raising=False)
    client = await collector_factory()
    collector = (await (await client.get("/api/health")).json())["collector"]
    resp = await client.get("/api/health", headers={"Host": f"fleet-{collector}.local"})
    assert resp.status == 421


@pytest.mark.timeout(90)
@pytest.mark.parametrize("length", [76, 200])
def test_a_collector_with_a_long_id_starts_advertises_and_stops(tmp_path, length):
    """A real collector process whose id (as a restored backup may hold) is too long for one
    DNS label: it starts, advertises shortened names, answers to the advertised host name and
    stops on SIGTERM."""
    lan = mdns.advertised_addresses(["0.0.0.0"])
    if not lan:
        pytest.skip("this machine has no non-loopback IPv4 address to advertise")
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    collector_id = "col-" + "a" * (length - 4)
    (data / "collector-id").write_text(collector_id + "\n")
    proc = CollectorProcess(data, env={"FLEET_MDNS": "1"}, bind=f"127.0.0.1,{lan[0]}")
    try:
        proc.start()
        status, health = proc.client.get("/api/health")
        assert status == 200 and health["collector"] == collector_id
        if health["mdns"].startswith("unavailable"):
            pytest.skip(f"mDNS cannot run here: {health['mdns']}")
        assert health["mdns"] == "advertising"
        host = mdns.Advert("x", collector_id, proc.port, ()).host
        status, _ = proc.client.get("/api/health", headers={"Host": f"{host}:{proc.port}"})
        assert status == 200
        assert f"mDNS: advertising {mdns.Advert(health['name'], collector_id, 0, ()).instance}" \
            in proc.log()
    finally:
        code = proc.stop(timeout=30)
    assert code == 0, proc.log()

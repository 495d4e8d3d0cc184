"""Which peer a connection counts against (fleet_min.serving.peer_group) and how many one peer
may hold (peer_share, FLEET_MAX_PEER_CONNECTIONS): plain functions, no sockets. The collector
processes that apply them are in tests/collector/test_connection_limits.py."""

from __future__ import annotations

import pytest

from fleet_min.config import peer_connections
from fleet_min.serving import peer_group, peer_share


@pytest.mark.parametrize(("peername", "group"), [
    (("203.0.113.7", 50000), "203.0.113.7"),
    (("203.0.113.8", 50000), "203.0.113.8"),  # each IPv4 address is a peer of its own
    (("10.0.0.5", 1), "10.0.0.5"),
    # IPv6: the /64, whatever address in it the host picked
    (("2001:db8:1:2::1", 50000, 0, 0), "2001:db8:1:2::/64"),
    (("2001:db8:1:2:aaaa:bbbb:cccc:dddd", 50000, 0, 0), "2001:db8:1:2::/64"),
    (("2001:db8:1:3::1", 50000, 0, 0), "2001:db8:1:3::/64"),
    (("fd00::2", 1, 0, 0), "fd00::/64"),
    # IPv4-mapped IPv6 is the IPv4 address it carries
    (("::ffff:203.0.113.7", 50000, 0, 0), "203.0.113.7"),
    (("::ffff:cb00:7107", 50000, 0, 0), "203.0.113.7"),
    # link-local: every neighbour shares fe80::/64, so each address is its own peer
    (("fe80::1%eth0", 1, 0, 2), "fe80::1%eth0"),
    (("fe80::2", 1, 0, 2), "fe80::2"),
])
def test_a_peer_counts_as_its_address_or_its_ipv6_prefix(peername, group):
    assert peer_group(peername) == group


@pytest.mark.parametrize("peername", [
    ("127.0.0.1", 50000), ("127.0.0.53", 50000), ("127.255.255.254", 1),  # all of 127.0.0.0/8
    ("::1", 50000, 0, 0),
    ("::ffff:127.0.0.1", 50000, 0, 0),
    "",  # a Unix socket's peer
    b"",
    None,  # no peer name at all
    (),
    ("", 0),
])
def test_loopback_unix_sockets_and_unknown_peers_are_exempt(peername):
    assert peer_group(peername) is None


def test_the_automatic_share_is_a_quarter_of_the_cap_and_64_at_least():
    assert peer_share(19872) == 4968  # a limit of 20,000 under uvloop
    assert peer_share(272) == 68  # a limit of 400
    assert peer_share(144) == 64
    assert peer_share(16) == 64  # more than the cap: the cap decides
    assert peer_share(0) == 0  # no descriptor limit, no cap: no share of it either


def test_a_share_that_was_set_is_taken_as_it_is():
    assert peer_share(272, "500") == 500
    assert peer_share(272, "1") == 1
    assert peer_share(272, "0") == 0  # the rule is off


@pytest.mark.parametrize(("text", "value"), [("auto", "auto"), (" AUTO ", "auto"),
                                             ("0", "0"), ("64", "64"), (" 007 ", "7")])
def test_the_setting_reads_auto_or_a_count(text, value):
    assert peer_connections(text) == value


@pytest.mark.parametrize("text", ["-1", "many", "1.5", "", "64k"])
def test_the_setting_refuses_anything_else_with_a_sentence(text):
    with pytest.raises(ValueError, match="must be auto or a number of connections"):
        peer_connections(text)

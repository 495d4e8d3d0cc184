"""What kind of network an address is on, as a person reading a device or enrolment row thinks
of it: the shelf's LAN, the mesh (a tailnet's 100.64.0.0/10), the machine itself, a name, or
anything else. Shared by the collector's enrolment page and its device rows."""

from __future__ import annotations

import ipaddress

MESH = ipaddress.ip_network("100.64.0.0/10")  # the carrier-grade NAT range tailnets use


def kind_of(address: str) -> str:
    """lan, mesh, loopback, name (not an IP literal) or other."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return "name"
    if ip.is_loopback:
        return "loopback"
    if isinstance(ip, ipaddress.IPv4Address) and ip in MESH:
        return "mesh"
    if ip.is_private or ip.is_link_local:
        return "lan"
    return "other"

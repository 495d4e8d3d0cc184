"""URLs a hostile job names, against the agent's address rule, its host executor's adb and its
Chromium. The browser and the collector are real processes; adb is a fake executable that does
what real adb does with `shell` (joins its arguments into one line and gives it to the device's
sh), its "device" a scratch folder."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

# --- the address rule: IPv6 forms that carry a private IPv4 address ---

REFUSED = [
    "127.0.0.1", "169.254.169.254", "::1", "::ffff:169.254.169.254",
    "64:ff9b::a9fe:a9fe",  # NAT64 (well-known prefix) of 169.254.169.254
    "64:ff9b::c0a8:101",  # NAT64 of 192.168.1.1
    "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
    "64:ff9b:1::808:808",  # local-use NAT64 (RFC 8215): refused whatever it carries
    "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
    "2002:c0a8:101::1",  # 6to4 of 192.168.1.1
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
    "2001:0:c0a8:101::1",  # Teredo
    "::127.0.0.1", "::a9fe:a9fe", "::8.8.8.8",  # IPv4-compatible (deprecated)
    "::ffff:0:7f00:1", "::ffff:0:c0a8:101",  # IPv4-translated
]
ALLOWED = ["8.8.8.8", "2606:4700:4700::1111", "64:ff9b::808:808", "2002:808:808::1",
           "::ffff:8.8.8.8"]


@pytest.mark.parametrize("address", REFUSED)
def test_private_ipv4_inside_ipv6_is_refused(fa, address):
    assert fa.address_allowed(address, False) is False
    assert fa.address_allowed(address, True) is True  # the owner's --allow-private-urls


@pytest.mark.parametrize("address", ALLOWED)
def test_public_addresses_stay_allowed(fa, address):
    assert fa.address_allowed(address, False) is True


def test_an_ipv6_literal_url_is_fetched(fa):
    """web-unfurl's fetch of http://[::ffff:127.0.0.1]:port/ (allowed by the owner) reaches the
    page; http.client took what follows a bare IPv6 host's last colon for a port, so this ended
    in InvalidURL ("nonnumeric port") before any connection."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = b"<html><title>six</title></html>"
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://[::ffff:127.0.0.1]:{server.server_address[1]}/"
        hops, body, _ = fa.fetch_chain(url, 10, True)
        assert [h["status"] for h in hops] == [200] and b"<title>six</title>" in body
        with pytest.raises(PermissionError):  # and without the owner's leave, refused
            fa.fetch_chain(url, 10, False)
    finally:
        server.shutdown()
        server.server_close()

"""The boundary against web pages elsewhere: which requests a service answers at all.

Three rules, shared by the collector and the control plane. Each service's access check (run by
fleet_min.http's one middleware before every handler) calls them; they are plain functions over
header values plus one small class built once from the configuration, so they are tested
without HTTP.

- **Host** (DNS rebinding). A page on evil.example can point its own name at 127.0.0.1 or at a
  LAN address; the browser then takes the service for evil.example and lets the page read and
  drive it as its own. The name the browser used arrives in `Host`, so a service answers only
  names it knows: IP literals, `localhost` and `*.localhost`, the machine's own names and the
  names the operator lists in FLEET_ALLOWED_HOSTS. Any other name gets 421 Misdirected Request.
- **Origin** on every mutating request: a browser names the page a request comes from, and a
  page of another origin (or an opaque `null` one) may not change anything, token or not.
- **Body type** on every mutating request: the types a page may send to any site without asking
  first (a CORS preflight) are refused with 415, so is a body without a type. JSON and binary
  uploads need a preflight, which neither service ever grants.
- **A GET that changes something** (the collector's job claims: the agents' protocol polls with
  GET) is refused when a browser says another page asked for it (`check_page_read`): a page
  sends such a GET with an `<img>` or a link, and no Origin comes with it.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from fleet_min.errors import BadRequest, Forbidden, Misdirected, UnsupportedMediaType

ALLOWED_HOSTS_ENV = "FLEET_ALLOWED_HOSTS"
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# What a page may send anywhere without a preflight (the Fetch standard's CORS-safelisted
# Content-Type values), compared by essence: "text/plain;charset=UTF-8" is text/plain.
SIMPLE_BODY_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded",
                               "multipart/form-data"})
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"

_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,62})")
_PORT = re.compile(r"[0-9]{0,5}")
_SHOWN = re.compile(r"[^A-Za-z0-9._:\[\]-]")
_DEFAULT_PORTS = {"http": 80, "https": 443}


# -- names ---------------------------------------------------------------------------------


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def split_host(value: str) -> tuple[str, int | None] | None:
    """(name, port) of a Host header value: the name lower-case, without brackets or a trailing
    dot; None when the value is not `name[:port]` or `[IPv6][:port]`."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        name, rest = value[1:end], value[end + 1:]
        if end < 0 or not _is_ipv6(name) or (rest and not rest.startswith(":")):
            return None
        port = rest[1:]
    else:
        name, _, port = value.partition(":")
        if ":" in port:
            return None  # an IPv6 address needs its brackets
    name = name.lower().rstrip(".")
    if (not _PORT.fullmatch(port) or (port and int(port) > 65535)
            or not (_is_name(name) or is_ip_literal(name))):
        return None
    return name, int(port) if port else None


def _is_ipv6(name: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(name), ipaddress.IPv6Address)
    except ValueError:
        return False


def _is_name(name: str) -> bool:
    return 0 < len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split("."))


def host_patterns(text: str) -> tuple[str, ...]:
    """FLEET_ALLOWED_HOSTS: comma-separated host names, `*.domain` patterns (any name under
    the domain, not the domain itself) or `*` (any name: the rebinding check is off)."""
    out = []
    for part in text.split(","):
        entry = part.strip().lower().rstrip(".")
        if not entry:
            continue
        bare = entry.removeprefix("*.")
        if entry != "*" and not (_is_name(bare) or is_ip_literal(bare.strip("[]"))):
            raise ValueError("must be host names or *.domain patterns separated by commas, got "
                             f"{part.strip()[:80]!r}")
        out.append(entry)
    return tuple(out)


def own_names(extra: Iterable[str] = ()) -> frozenset[str]:
    """This machine's names: its host name, the short form, `<short>.local` (mDNS), and extra."""
    host = socket.gethostname().lower().rstrip(".")
    short = host.split(".")[0]
    names = (host, short, f"{short}.local" if short else "", *extra)
    return frozenset(name.lower().rstrip(".") for name in names if name)


def shown(value: str) -> str:
    """A header value safe to quote in an error sentence (and short)."""
    return _SHOWN.sub("?", value[:100])


class HostGate:
    """The names one service answers to, decided once at start; `check` costs a dict lookup for
    every Host seen before (admitted ones are remembered, up to CACHE_LIMIT)."""

    CACHE_LIMIT = 256

    def __init__(self, service: str, patterns: Iterable[str], own: Iterable[str] = ()) -> None:
        self.service = service
        wanted = tuple(patterns)
        self.any_name = "*" in wanted
        self.names = {"localhost", *own, *(p for p in wanted if not p.startswith("*"))}
        self.suffixes = (".localhost", *(p[1:] for p in wanted if p.startswith("*.")))
        self._admitted: dict[str, None] = {}

    def admit(self, name: str) -> None:
        """Answer to one more name (the mDNS name, known once the service has its id)."""
        self.names.add(name.lower().rstrip("."))

    def answers_to(self, name: str) -> bool:
        return (self.any_name or name in self.names or name.endswith(self.suffixes)
                or is_ip_literal(name))

    def check(self, host: str | None) -> None:
        """Refuse a request sent to a name this service does not answer to. A request without
        Host (HTTP/1.0) is admitted: a browser always sends one."""
        if not host or host in self._admitted:
            return
        parts = split_host(host)
        if parts is None:
            raise BadRequest(f"the Host header '{shown(host)}' is not a host name or address "
                             "with an optional port")
        if not self.answers_to(parts[0]):
            raise Misdirected(f"this {self.service} does not answer to the name "
                              f"'{shown(parts[0])}'; add it to {ALLOWED_HOSTS_ENV} if agents "
                              "or browsers reach it by that name")
        if len(self._admitted) >= self.CACHE_LIMIT:
            self._admitted.clear()  # a rare reset keeps the memory bounded; names are re-checked
        self._admitted[host] = None


# -- origins -------------------------------------------------------------------------------


def same_origin(origin: str, host: str) -> bool:
    """Whether an Origin header names the host and port the request was sent to (Host).

    A default port may be left out on either side: through a TLS proxy that keeps Host, the
    page is https://name and Host is `name`.
    """
    try:
        parts = urlsplit(origin)
        origin_port = parts.port
    except ValueError:
        return False
    default = _DEFAULT_PORTS.get(parts.scheme)
    target = split_host(host) if host else None
    if default is None or not parts.hostname or target is None:
        return False
    name, port = target
    return (parts.hostname.rstrip(".") == name
            and (origin_port or default) == (port or default))


def check_same_origin(headers: Mapping[str, str], message: str) -> None:
    """Refuse a browser request made by a page of another origin, whatever token it carries.

    A request without Origin (curl, agents, scripts) is not a browser's cross-site request:
    browsers send Origin with every POST, PUT, PATCH and DELETE.
    """
    if headers.get("Sec-Fetch-Site", "").strip().lower() == "cross-site":
        raise Forbidden(message)
    origin = headers.get("Origin")
    if origin is not None and (origin == "null" or not same_origin(origin,
                                                                   headers.get("Host", ""))):
        raise Forbidden(message)


def from_a_page(headers: Mapping[str, str]) -> bool:
    """Whether a request carries any header by which a browser names the page behind it.
    Agents and scripts send none of them, so their requests cost three lookups here."""
    return "Sec-Fetch-Site" in headers or "Origin" in headers or "Referer" in headers


def check_page_read(headers: Mapping[str, str], message: str) -> None:
    """Refuse a GET that changes state (a job claim) asked for by a page other than the
    service's own.

    A plain GET (an `<img>`, a link, a form with method=get) carries no Origin, so the check of
    the mutating methods cannot see it. `Sec-Fetch-Site` can: anything but `same-origin` (the
    service's own pages) or `none` (an address the person typed) was asked for by another page,
    `same-site` included, which is also a page on another port of the same host. A browser too
    old to send it sends a Referer, unless the page suppressed that.
    """
    site = headers.get("Sec-Fetch-Site")
    if site is not None:
        if site.strip().lower() not in ("same-origin", "none"):
            raise Forbidden(message)
    else:
        referer = headers.get("Referer")
        if referer and not same_origin(referer, headers.get("Host", "")):
            raise Forbidden(message)
    check_same_origin(headers, message)  # an Origin, when one came, names this service


# -- body types ----------------------------------------------------------------------------


def has_body(headers: Mapping[str, str]) -> bool:
    length = headers.get("Content-Length")
    return (length is not None and length.strip() != "0") or "Transfer-Encoding" in headers


def check_body_type(headers: Mapping[str, str], service: str, wanted: str = JSON_TYPE) -> None:
    """Refuse a body of a type any page can send without a preflight, or of no type at all."""
    raw = headers.get("Content-Type")
    essence = (raw or "").split(";", 1)[0].strip().lower()
    if essence in SIMPLE_BODY_TYPES or (not essence and has_body(headers)):
        refused = essence or "a body without a Content-Type"
        raise UnsupportedMediaType(
            f"send the body as {wanted} (curl: -H 'Content-Type: {wanted}'): this {service} "
            f"refuses {refused}, which a page on any web site can send it")


def check_request(method: str, headers: Mapping[str, str], service: str, cross_site: str,
                  wanted: str = JSON_TYPE) -> None:
    """Origin, then body type, for a mutating request; nothing for a read."""
    if method in MUTATING:
        check_same_origin(headers, cross_site)
        check_body_type(headers, service, wanted)
